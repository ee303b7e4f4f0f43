"""A fake Kubernetes API server for EndpointSlices, faithful where clients can tell.

No real kube-apiserver runs on these machines, so discovery is tested with the real
kubernetes-asyncio client (and kubectl) against this aiohttp server on 127.0.0.1. It keeps
`discovery.k8s.io/v1` EndpointSlices with resourceVersions and reproduces the semantics of
`reference-k8s-testing.md` section 2.2:

- list and watch on `/apis/discovery.k8s.io/v1[/namespaces/{ns}]/endpointslices`, get on
  `.../{name}`; kubectl's discovery documents (`/version`, `/api`, `/apis`, ...);
- boolean query parameters parsed like apimachinery: false only when absent, "0" or "false"
  (kubernetes-asyncio sends `watch=True`);
- lists: items without `kind`/`apiVersion`, `limit`/`continue` paging from a snapshot,
  `remainingItemCount`, HTTP 410 `Expired` for a continue token older than a compaction;
- label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!`), field selectors on
  `metadata.name`/`metadata.namespace` only (else 400);
- watches: chunked JSON lines; no resourceVersion (or "0") starts with a synthetic ADDED per
  matching object; resourceVersion N replays every later event in order; a too-old N gets
  HTTP 200 and a single ERROR event (Status 410 `Expired`, upstream's message) then the end;
  selector transitions come as ADDED / MODIFIED / DELETED (the last carrying the previous
  content with the new event's resourceVersion); `timeoutSeconds` ends the stream cleanly;
  BOOKMARKs, on request (`bookmark()`), to watches that asked for them;
- errors are `Status` bodies (400, 401, 403 with details, 404, 410).

Test controls (call them on the test's loop; none waits): `put`, `delete`, `compact`,
`bookmark`, `reset_watches` (abort every open watch's TCP connection mid-stream: an RST),
`close_watches` (close it mid-stream: a FIN with no chunked end, as a proxy's idle timeout), `fail`
(answer a verb with an error status), `hang_watches`, `end_watches_at_once`, `endless_list`,
and `requests` (what each client asked, in order).

Changing the world while a client is cut off: `reset_watches()`, then writes, then
`compact()`, all without an `await` in between: the client cannot have re-watched yet, so it
resumes from a compacted resourceVersion and must relist.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from aiohttp import web

GROUP: Final = "discovery.k8s.io"
VERSION: Final = "v1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "EndpointSlice"
SERVICE_LABEL: Final = "kubernetes.io/service-name"
MANAGED_BY: Final = "endpointslice.kubernetes.io/managed-by"

_STOP: Final = object()


# -- fixtures shaped like the EndpointSlice controller's output -------------------------


def endpoint(
    address: str,
    pod: str | None = None,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    namespace: str | None = "default",
    uid: str | None = None,
    kind: str | None = "Pod",
    target_ref: bool = True,
) -> dict[str, Any]:
    """One endpoint as `podToEndpoint` writes it; None leaves a condition out."""
    conditions = {
        k: v
        for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
        if v is not None
    }
    out: dict[str, Any] = {"addresses": [address], "conditions": conditions, "nodeName": "node-1"}
    if target_ref and pod is not None:
        ref = {"kind": kind, "namespace": namespace, "name": pod, "uid": uid or f"uid-{pod}"}
        out["targetRef"] = {k: v for k, v in ref.items() if v is not None}
    return out


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]] | None,
    *,
    ports: Sequence[int] | None = (8080,),
    namespace: str = "default",
    address_type: str = "IPv4",
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A slice as the controller writes it (`endpoints: None` is its empty placeholder)."""
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generateName": f"{service}-",
            "labels": {
                SERVICE_LABEL: service,
                MANAGED_BY: "endpointslice-controller.k8s.io",
                **(labels or {}),
            },
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Service", "name": service, "uid": f"svc-{service}"}
            ],
            # Servers send these; a consumer must ignore what it does not know.
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}],
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": None
        if ports is None
        else [{"name": "http", "port": p, "protocol": "TCP"} for p in ports],
    }


# -- selectors and query parsing ----------------------------------------------------------


class BadQuery(ValueError):
    pass


def query_bool(value: str | None) -> bool:
    """apimachinery's Convert_Slice_string_To_bool: false only for absent, "0", "false"."""
    return value is not None and value.lower() not in ("0", "false")


_REQUIREMENT = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9./_-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9._-]*)"
    r"|\s(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def label_selector(text: str) -> list[tuple[str, str, frozenset[str]]]:
    """Parse `k=v,k!=v,k in (a,b),k notin (a),k,!k` into (key, op, values) requirements."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    out = []
    for part in parts:
        if not part.strip():
            if text.strip():
                raise BadQuery(f"unable to parse requirement: empty requirement in {text!r}")
            continue
        m = _REQUIREMENT.match(part)
        if m is None or (m["neg"] and (m["op"] or m["setop"])):
            raise BadQuery(f"unable to parse requirement: {part.strip()!r}")
        key = m["key"]
        if m["neg"]:
            out.append((key, "!", frozenset()))
        elif m["op"]:
            out.append((key, "!=" if m["op"] == "!=" else "=", frozenset([m["value"]])))
        elif m["setop"]:
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            out.append((key, m["setop"], values))
        else:
            out.append((key, "exists", frozenset()))
    return out


def labels_match(
    reqs: Iterable[tuple[str, str, frozenset[str]]], labels: Mapping[str, str]
) -> bool:
    for key, op, values in reqs:
        present = key in labels
        ok = {
            "=": present and labels.get(key) in values,
            "in": present and labels.get(key) in values,
            "!=": not present or labels.get(key) not in values,
            "notin": not present or labels.get(key) not in values,
            "exists": present,
            "!": not present,
        }[op]
        if not ok:
            return False
    return True


def field_selector(text: str) -> list[tuple[str, bool, str]]:
    """`metadata.name=x,metadata.namespace!=y` -> (field, equal, value); others are refused."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.match(r"^([A-Za-z.]+)\s*(==|=|!=)\s*(.*)$", part)
        if m is None:
            raise BadQuery(f"invalid selector: {part!r}; can't understand {part!r}")
        if m[1] not in ("metadata.name", "metadata.namespace"):
            raise BadQuery(f'field label not supported: "{m[1]}"')
        out.append((m[1], m[2] != "!=", m[3]))
    return out


@dataclass(frozen=True, slots=True)
class Filter:
    namespace: str | None
    labels: list[tuple[str, str, frozenset[str]]]
    fields: list[tuple[str, bool, str]]

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        if self.namespace is not None and meta["namespace"] != self.namespace:
            return False
        for name, equal, value in self.fields:
            actual = meta["name"] if name == "metadata.name" else meta["namespace"]
            if (actual == value) != equal:
                return False
        return labels_match(self.labels, meta.get("labels") or {})


# -- the server -----------------------------------------------------------------------------


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


_REASONS: Final = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "AlreadyExists",
    410: "Expired",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@dataclass(eq=False, slots=True)
class _Watcher:
    filter: Filter
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    transport: asyncio.Transport | None = None


@dataclass(frozen=True, slots=True)
class _Change:
    rv: int
    old: dict[str, Any] | None
    new: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    verb: str  # list, watch, get, discovery

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")


class FakeApiServer:
    """See the module's opening. `async with FakeApiServer() as api: api.url`."""

    def __init__(
        self,
        *,
        first_rv: int = 1000,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._rv = first_rv
        self._floor = first_rv  # oldest resourceVersion a watch may resume from
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[_Change] = []
        self._watchers: set[_Watcher] = set()
        self._continues: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._tokens = itertools.count(1)
        self._uids = itertools.count(1)
        self._failures: dict[str, list[int]] = {}  # verb -> [status, remaining (-1: always)]
        self._token = token
        self._ssl = ssl_context
        self.requests: list[Request] = []
        # Misbehaviours a client must survive: a watch that never ends nor speaks (a half-open
        # connection, as the client sees it), one that ends as soon as it starts, and a list
        # that never ends (every page hands back the same continue token).
        self.hang_watches = False
        self.end_watches_at_once = False
        self.endless_list = False
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self._ssl else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.reset_watches()
        assert self._runner is not None
        await self._runner.cleanup()

    # -- test controls ---------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace a slice (MODIFIED carries the whole new object); returns it."""
        new = _copy(dict(obj))
        meta = new.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self._objects.get(key)
        self._rv += 1
        new["kind"], new["apiVersion"] = KIND, API_VERSION
        meta["resourceVersion"] = str(self._rv)
        meta["uid"] = old["metadata"]["uid"] if old else f"slice-uid-{next(self._uids)}"
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self._objects[key] = new
        self._record(_Change(self._rv, old, new))
        return _copy(new)

    def delete(self, name: str, namespace: str = "default") -> None:
        old = self._objects.pop((namespace, name))
        self._rv += 1
        self._record(_Change(self._rv, old, None))

    def compact(self) -> None:
        """Forget the event history and every continue token: older RVs now get 410."""
        self._history.clear()
        self._floor = self._rv
        self._continues.clear()

    def bookmark(self) -> None:
        """A BOOKMARK at the current resourceVersion to every watch that allows them."""
        event = {
            "type": "BOOKMARK",
            "object": {
                "kind": KIND,
                "apiVersion": API_VERSION,
                "metadata": {"resourceVersion": str(self._rv)},
                "endpoints": None,
            },
        }
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(event)

    def reset_watches(self) -> int:
        """Abort every open watch's connection mid-stream (an RST, no clean end); returns how
        many."""
        return self._cut_watches(lambda transport: transport.abort())

    def close_watches(self) -> int:
        """Close every open watch's connection mid-stream (a FIN before the chunked end);
        returns how many."""
        return self._cut_watches(lambda transport: transport.close())

    def _cut_watches(self, cut: Callable[[asyncio.Transport], None]) -> int:
        count = 0
        for watcher in list(self._watchers):
            self._watchers.discard(watcher)
            if watcher.transport is not None:
                cut(watcher.transport)
            watcher.queue.put_nowait(_STOP)
            count += 1
        return count

    def fail(self, verb: str, code: int | None, times: int = -1) -> None:
        """Answer `verb` (list, continue, watch) with a Status `code`; None stops failing."""
        if code is None:
            self._failures.pop(verb, None)
        else:
            self._failures[verb] = [code, times]

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def verbs(self) -> list[str]:
        """The endpointslice requests so far, by verb: e.g. ["list", "watch", "watch"]."""
        return [r.verb for r in self.requests if r.verb != "discovery"]

    # -- internals -------------------------------------------------------------------------

    def _record(self, change: _Change) -> None:
        self._history.append(change)
        for watcher in self._watchers:
            event = _convert(change, watcher.filter)
            if event is not None:
                watcher.queue.put_nowait(event)

    def _take_failure(self, verb: str) -> int | None:
        entry = self._failures.get(verb)
        if entry is None:
            return None
        code, remaining = entry
        if remaining > 0:
            entry[1] -= 1
            if entry[1] == 0:
                del self._failures[verb]
        return code

    def _authorized(self, request: web.Request) -> bool:
        return self._token is None or request.headers.get("Authorization") == (
            f"Bearer {self._token}"
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        query = dict(request.query)
        resource = _RESOURCE.match(path)
        watching = query_bool(query.get("watch"))
        if resource is None:
            verb = "discovery"
        elif resource["name"]:
            verb = "get"
        elif watching:
            verb = "watch"
        else:
            verb = "continue" if query.get("continue") else "list"
        self.requests.append(Request(request.method, path, query, verb))
        if not self._authorized(request):
            return _error(401, "Unauthorized")
        if resource is None:
            return _discovery(path)
        namespace = resource["ns"]
        code = self._take_failure(verb)
        if code is not None:
            return _failure(code, verb, namespace)
        try:
            flt = Filter(
                namespace,
                label_selector(query.get("labelSelector", "")),
                field_selector(query.get("fieldSelector", "")),
            )
        except BadQuery as exc:
            return _error(400, str(exc))
        if verb == "get":
            obj = self._objects.get((namespace or "", resource["name"]))
            if obj is None:
                return _error(
                    404,
                    f'endpointslices.{GROUP} "{resource["name"]}" not found',
                    group=GROUP,
                    kind="endpointslices",
                    name=resource["name"],
                )
            return _json(obj)
        if verb == "watch":
            return await self._watch(request, flt, query)
        return self._list(flt, query)

    def _list(self, flt: Filter, query: dict[str, str]) -> web.Response:
        if self.endless_list:
            metadata = {"resourceVersion": str(self._rv), "continue": "again"}
            return _json({"kind": f"{KIND}List", "metadata": metadata, "items": []})
        token = query.get("continue")
        if token:
            snapshot = self._continues.pop(token, None)
            if snapshot is None:
                return _error(
                    410,
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                )
            rv, items = snapshot
        else:
            rv = self._rv
            items = [
                _without_kind(obj) for key, obj in sorted(self._objects.items()) if flt.matches(obj)
            ]
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = int(query.get("limit", "0") or 0)
        if limit > 0 and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            next_token = f"c{next(self._tokens)}"
            self._continues[next_token] = (rv, rest)
            metadata["continue"] = next_token
            metadata["remainingItemCount"] = len(rest)
        return _json(
            {"kind": f"{KIND}List", "apiVersion": API_VERSION, "metadata": metadata, "items": items}
        )

    async def _watch(
        self, request: web.Request, flt: Filter, query: dict[str, str]
    ) -> web.StreamResponse:
        raw_rv = query.get("resourceVersion")
        expired = False
        # Backlog and registration happen together, with no await between: no event is lost
        # or sent twice.
        if raw_rv in (None, "", "0"):
            backlog = [
                {"type": "ADDED", "object": _copy(obj)}
                for _, obj in sorted(self._objects.items())
                if flt.matches(obj)
            ]
        elif not raw_rv.isdigit():
            return _error(400, f"invalid resource version: {raw_rv!r}")
        elif int(raw_rv) < self._floor:
            # Past authn/authz, a watch fails only as an ERROR event on an HTTP 200.
            message = f"too old resource version: {raw_rv} ({self._floor + 1})"
            backlog = [{"type": "ERROR", "object": status(410, "Expired", message)}]
            expired = True
        else:
            since = int(raw_rv)
            converted = (_convert(c, flt) for c in self._history if c.rv > since)
            backlog = [e for e in converted if e is not None]
        watcher = _Watcher(flt, query_bool(query.get("allowWatchBookmarks")))
        if not expired:
            self._watchers.add(watcher)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            for event in backlog:
                await resp.write(_line(event))
            if expired or self.end_watches_at_once:
                await resp.write_eof()
                return resp
            watcher.transport = request.transport
            timeout = None
            if query.get("timeoutSeconds") and not self.hang_watches:
                timeout = float(query["timeoutSeconds"])
            try:
                async with asyncio.timeout(timeout):
                    while (event := await watcher.queue.get()) is not _STOP:
                        await resp.write(_line(event))
            except TimeoutError:
                await resp.write_eof()  # the server's deadline: a clean end
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        finally:
            self._watchers.discard(watcher)


_RESOURCE = re.compile(
    rf"^/apis/{re.escape(GROUP)}/{VERSION}(?:/namespaces/(?P<ns>[^/]+))?/endpointslices"
    r"(?:/(?P<name>[^/]+))?/?$"
)


def _convert(change: _Change, flt: Filter) -> dict[str, Any] | None:
    """The event one watcher sees for a change, after its selector (the cacher's rule)."""
    was, now = flt.matches(change.old), flt.matches(change.new)
    if was and now:
        return {"type": "MODIFIED", "object": _copy(change.new)}
    if now:
        return {"type": "ADDED", "object": _copy(change.new)}
    if was:
        assert change.old is not None
        gone = _copy(change.old)
        gone["metadata"]["resourceVersion"] = str(change.rv)
        return {"type": "DELETED", "object": gone}
    return None


def _copy(obj: Any) -> Any:
    """A deep copy of a JSON value (several times faster than copy.deepcopy)."""
    return msgspec.json.decode(msgspec.json.encode(obj))


def _without_kind(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = _copy(dict(obj))
    out.pop("kind", None)
    out.pop("apiVersion", None)
    return out


def _line(event: Mapping[str, Any]) -> bytes:
    return msgspec.json.encode(event) + b"\n"


def _json(body: Any, status_code: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status_code, content_type="application/json"
    )


def _error(code: int, message: str, **details: Any) -> web.Response:
    return _json(status(code, _REASONS.get(code, "Unknown"), message, **details), code)


def _failure(code: int, verb: str, namespace: str | None) -> web.Response:
    if code == 403:
        where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        return _error(
            403,
            f'endpointslices.{GROUP} is forbidden: User "system:serviceaccount:default:kvrouter" '
            f'cannot {"list" if verb == "continue" else verb} resource "endpointslices" in API '
            f'group "{GROUP}" {where}',
            group=GROUP,
            kind="endpointslices",
        )
    if code == 410:
        return _error(410, "The provided continue parameter is too old.")
    return _error(code, f"injected failure for {verb}")


def _discovery(path: str) -> web.Response:
    if path == "/version":
        return _json({"major": "1", "minor": "32", "gitVersion": "v1.32.0-fake"})
    if path == "/api":
        return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
    if path == "/api/v1":
        return _json({"kind": "APIResourceList", "groupVersion": "v1", "resources": []})
    group = {"name": GROUP, "versions": [{"groupVersion": API_VERSION, "version": VERSION}]}
    group["preferredVersion"] = group["versions"][0]
    if path == "/apis":
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]})
    if path == f"/apis/{GROUP}":
        return _json({"kind": "APIGroup", "apiVersion": "v1", **group})
    if path == f"/apis/{API_VERSION}":
        return _json(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": API_VERSION,
                "resources": [
                    {
                        "name": "endpointslices",
                        "singularName": "endpointslice",
                        "namespaced": True,
                        "kind": KIND,
                        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                    }
                ],
            }
        )
    return _error(404, "the server could not find the requested resource")
