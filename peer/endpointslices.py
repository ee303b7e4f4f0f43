"""List+watch of EndpointSlices with kubernetes-asyncio: one engine, two uses.

The replica watches `discovery.k8s.io/v1` EndpointSlices twice: `--kv-peer-selector` names
its siblings (fed to the PeerRegistry), `--worker-selector` its workers (fed to the worker
registry). What a slice means lives in `peer.slices`, what the view holds in
`peer.slice_view`; this file is the thin loop around them.

The loop (the same division as client-go's Reflector):

    list (paged) ---> watch from the list's resourceVersion, with bookmarks ---> clean end:
      ^                 |                                                       watch again
      |                 +-- 410 Expired (an ERROR event or an HTTP 410) --> relist
      |                 +-- cut (its connection broke after `cut_min_run_s`): watch again
      |                 |   at once, the backoff reset
      |                 +-- any other error: back off (jittered, capped), keep the view and
      +-----------------    the resourceVersion; a later 410 forces the relist

- `timeout_seconds` is always passed, which turns off kubernetes-asyncio's hidden retries
  (a silent re-watch on a clean end, one repeat with the same too-old resourceVersion on a
  410): the loop decides every case itself. The client gets a total timeout a little longer
  than the server's, so a half-open connection cannot hang the watch forever.
- A watch that ends cleanly within `min_watch_s` with no event at all is treated as a
  failure and backed off: a server (or proxy) that closes every watch at once must not turn
  the loop into a busy one.
- A watch whose connection broke (FIN or RST mid-stream) after it was established (HTTP 200)
  and ran `cut_min_run_s` is a cut (`is_cut`), not a failure: a proxy or load balancer whose
  idle timeout is shorter than the API server's bookmark interval cuts every idle watch, and
  backed off as failures the re-watches grew to the 30-s cap and kept it, so every change
  reached the replica that late and the failing alert blamed the API server. A cut watches
  again at once from its resourceVersion (at most one watch a `cut_min_run_s`), counted as
  `cut` apart from the failures the alert reads, logged at INFO. A watch that breaks sooner
  or never starts backs off as any failure.
- `Watch` objects are closed on every path (`async with`).
- Time is injected (`clock`, `sleep`, `rng`), so tests of the backoff never wait.

How the API client is made, and which namespace is watched: `peer.kubeconfig`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.client.rest import RESTResponse

from peer.slice_view import Listing, SliceView
from peer.slices import EndpointSlice, Extraction, SliceError, decode_slice, unlisted_port
from peer.supervise import Supervisor
from peer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

EVENT_TYPES: Final = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})
# What an API server answers a list or watch with; any other status counts as `http_other`.
KNOWN_STATUSES: Final = frozenset({400, 401, 403, 404, 409, 410, 422, 429, 500, 502, 503, 504})
MAX_LIST_PAGES: Final = 100_000  # a list longer than this does not end (500 slices a page)

Publish = Callable[[Listing], None]


@dataclass(frozen=True, slots=True)
class WatchSettings:
    page_size: int = 500  # items per list page, as kubectl asks
    watch_timeout_s: int = 300  # the server ends each watch after this (timeoutSeconds)
    request_grace_s: float = 30.0  # the client gives up this long after the server should have
    list_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    min_watch_s: float = 1.0
    cut_min_run_s: float = 2.0  # an established watch that broke after this long is a cut
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0


@dataclass(slots=True)
class Backoff:
    """Exponential, capped, with equal jitter: [d/2, d] for d = initial * 2^n, capped."""

    initial_s: float
    max_s: float
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.max_s, self.initial_s * 2 ** min(self.failures, 30))
        self.failures += 1
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


@dataclass(slots=True)
class WatchStats:
    """What one watch has done, for the replica's metrics."""

    relists: int = 0  # complete lists that replaced the view
    events: Counter[str] = field(default_factory=Counter)  # ADDED/MODIFIED/DELETED/BOOKMARK
    # expired, cut (not a failure: `is_cut`), http_<status>, transport, short_watch, unexpected
    failures: Counter[str] = field(default_factory=Counter)


def is_cut(opened_at: float | None, broke_at: float, min_run_s: float) -> bool:
    """Whether a watch whose connection broke is a cut, watched again at once: it was
    established (its HTTP 200 arrived at `opened_at`; None: it never was) and ran at least
    `min_run_s`. One that broke sooner may be a server or a path that fails every watch: it is
    backed off, so that cuts cannot make the loop a busy one."""
    return opened_at is not None and broke_at - opened_at >= min_run_s


class EndpointSliceWatch:
    """Keeps one selector's listing current and hands every new one to `publish`."""

    def __init__(
        self,
        api: DiscoveryV1Api,
        *,
        what: str,
        namespace: str,
        selector: str,
        rules: Extraction,
        publish: Publish,
        settings: WatchSettings = WatchSettings(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.api = api
        self.what = what  # "siblings" or "workers", for the logs
        self.namespace = namespace
        self.selector = selector
        self.view = SliceView(rules)
        self.settings = settings
        self.backoff = Backoff(
            settings.backoff_initial_s, settings.backoff_max_s, rng or random.Random()
        )
        self._publish = publish
        self._clock = clock
        self._sleep = sleep
        self._where = f"namespace {namespace}" if namespace else "all namespaces"
        self._expired_in_a_row = 0
        # Slices skipped for not listing the port the rules require, with the ports they list
        # as warned of: each is warned of once, and again only when its ports change.
        self._unlisted: dict[tuple[str, str], tuple[int, ...]] = {}
        self.stats = WatchStats()

    async def run(self) -> None:
        """Forever, until cancelled."""
        log.info("%s: watching EndpointSlices %r in %s", self.what, self.selector, self._where)
        while True:
            try:
                if self.view.needs_list:
                    await self._relist()
                await self._watch()
            except _Cut as exc:
                self.stats.failures["cut"] += 1
                self.backoff.reset()
                log.info(
                    "%s: EndpointSlice watch cut (%s); watching again from resourceVersion %s",
                    self.what,
                    exc,
                    self.view.resource_version,
                )
            except ApiException as exc:
                self.view.abandon_relist()
                if exc.status == 410:
                    self.stats.failures["expired"] += 1
                    await self._on_expired(exc)
                else:
                    self.stats.failures[_status_label(exc.status)] += 1
                    await self._back_off(_api_problem(exc, self.namespace))
            except (aiohttp.ClientError, TimeoutError, ValueError, _ShortWatch) as exc:
                # ValueError: the client could not deserialize what the server sent.
                self.view.abandon_relist()
                short = isinstance(exc, _ShortWatch)
                self.stats.failures["short_watch" if short else "transport"] += 1
                await self._back_off(f"{type(exc).__name__}: {exc}")
            except Exception as exc:
                # kubernetes-asyncio raises a bare Exception for a malformed event. Discovery
                # must outlive anything one response can do to it; the traceback shows what.
                log.exception("%s: unexpected failure in the EndpointSlice watch", self.what)
                self.view.abandon_relist()
                self.stats.failures["unexpected"] += 1
                await self._back_off(f"{type(exc).__name__}: {exc}")

    # -- list ------------------------------------------------------------------------------

    async def _relist(self) -> None:
        self.view.begin_relist()
        unlisted: dict[tuple[str, str], tuple[int, ...]] = {}
        token: str | None = None
        tokens: set[str] = set()
        while True:
            kwargs: dict[str, Any] = {
                "label_selector": self.selector,
                "limit": self.settings.page_size,
                "_request_timeout": self.settings.list_timeout_s,
            }
            if token:
                kwargs["_continue"] = token
            page = await self._list_page(**kwargs)
            items = page.get("items") or []
            if not isinstance(items, list):
                raise ValueError(f"the list's items are no list: {str(items)[:200]!r}")
            page_slices = self._decode_all(items)
            for item in page_slices:
                self._check_port(item, unlisted)
            self.view.relist_page(page_slices)
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") if isinstance(metadata, dict) else None
            if not token:
                break
            if not isinstance(token, str) or token in tokens or len(tokens) >= MAX_LIST_PAGES:
                # A server that pages forever must not keep this loop busy: a failure, so
                # it backs off (`run`), and the set in force stays.
                raise ValueError(f"the list does not end (page {len(tokens) + 1}, {token!r:.80})")
            tokens.add(token)
        relisted = self.view.finish_relist(metadata.get("resourceVersion"))
        assert relisted is not None, "begun above"
        self._unlisted = unlisted
        self.backoff.reset()
        self.stats.relists += 1
        if relisted.slices == 0:
            log.warning(
                "%s: no EndpointSlice in %s matches %r; the selector applies to the slices' "
                "labels (kubernetes.io/service-name=<service>), not to pod labels",
                self.what,
                self._where,
                self.selector,
            )
        log.info(
            "%s: listed %d slice(s) at resourceVersion %s: %d URL(s)",
            self.what,
            relisted.slices,
            self.view.resource_version,
            len(relisted.listing.urls),
        )
        self._publish(relisted.listing)

    def _list(self, **kwargs: Any) -> Awaitable[Any]:
        if self.namespace:
            return self.api.list_namespaced_endpoint_slice(self.namespace, **kwargs)
        return self.api.list_endpoint_slice_for_all_namespaces(**kwargs)

    async def _list_page(self, **kwargs: Any) -> dict[str, Any]:
        """One page of the list as the server sent it. Not the client's typed models: they
        refuse a whole page for one slice they do not like (an endpoint without addresses),
        and every relist then failed; here each slice is decoded on its own (`_decode`), as
        the watch's are. An error status raises `ApiException` as the typed call would."""
        response = await self._list(_preload_content=False, **kwargs)
        try:
            data = await response.read()
        finally:
            response.release()
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=RESTResponse(response, data))
        page = msgspec.json.decode(data)  # a DecodeError is a ValueError: counted, backed off
        if not isinstance(page, dict):
            raise ValueError(f"the list is no JSON object: {data[:200]!r}")
        return page

    def _decode_all(self, items: list[Any]) -> list[EndpointSlice]:
        out = []
        for item in items:
            decoded = self._decode(item)
            if decoded is not None:
                out.append(decoded)
        return out

    def _decode(self, obj: Any) -> EndpointSlice | None:
        try:
            return decode_slice(obj)
        except SliceError as exc:
            log.warning("%s: ignoring an unreadable EndpointSlice: %s", self.what, exc)
            return None

    # -- watch -----------------------------------------------------------------------------

    async def _watch(self) -> None:
        settings = self.settings
        func = (
            self.api.list_namespaced_endpoint_slice
            if self.namespace
            else self.api.list_endpoint_slice_for_all_namespaces
        )
        args = (self.namespace,) if self.namespace else ()
        started = self._clock()
        opened_at: float | None = None
        events = 0

        async def opened(*args: Any, **kwargs: Any) -> Any:
            """The watch request, noting when its HTTP 200 arrived (an error status raises)."""
            nonlocal opened_at
            response = await func(*args, **kwargs)
            opened_at = self._clock()
            return response

        try:
            # "object": events stay dicts; the client's typed models would be built and
            # thrown away (we read `raw_object`), and they cost more than everything else
            # per event.
            async with watch.Watch(return_type="object") as stream:
                async for event in stream.stream(
                    opened,
                    *args,
                    label_selector=self.selector,
                    resource_version=self.view.resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=settings.watch_timeout_s,
                    _request_timeout=aiohttp.ClientTimeout(
                        total=settings.watch_timeout_s + settings.request_grace_s,
                        sock_connect=settings.connect_timeout_s,
                    ),
                ):
                    events += self._on_event(event)
        except aiohttp.ClientError as exc:
            # The connection broke. A client timeout is no cut: the server did not end the
            # watch when it should have (a half-open connection), and is backed off.
            if is_cut(opened_at, self._clock(), settings.cut_min_run_s):
                raise _Cut(f"{type(exc).__name__}: {exc}") from exc
            raise
        if events == 0 and self._clock() - started < settings.min_watch_s:
            raise _ShortWatch(
                f"the watch ended after {self._clock() - started:.2f} s, with nothing new"
            )

    def _on_event(self, event: Any) -> bool:
        """Apply one watch event; whether it moved the watch on (a slice applied, a bookmark
        further on). Only such an event ends the backoff and makes a watch more than short: a
        server that sends one stale or unknown event and closes is backed off as one that
        sends nothing."""
        if not isinstance(event, dict):  # a line that was not JSON comes through as text
            raise ValueError(f"not a watch event: {str(event)[:200]!r}")
        kind = event.get("type")
        raw = event.get("raw_object")
        self.stats.events[kind if kind in EVENT_TYPES else "other"] += 1
        if kind == "BOOKMARK":
            resource_version = raw["metadata"]["resourceVersion"]
            if resource_version == self.view.resource_version:
                return False
            self.view.bookmark(resource_version)
            self._moved_on()
            return True
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring a watch event of type %r", self.what, kind)
            return False
        item = self._decode(raw)
        if item is None:
            return False
        if kind == "DELETED":
            self._unlisted.pop(item.key, None)
        else:
            self._check_port(item, self._unlisted)
        self._moved_on()
        listing = self.view.apply(kind, item)
        if listing is not None:
            log.info(
                "%s: %s %s/%s: %d URL(s)",
                self.what,
                kind.lower(),
                item.metadata.namespace,
                item.metadata.name,
                len(listing.urls),
            )
            self._publish(listing)
        return True

    def _check_port(
        self, item: EndpointSlice, unlisted: dict[tuple[str, str], tuple[int, ...]]
    ) -> None:
        """Warn of a slice skipped for not listing the port the rules require (`--worker-port`),
        once per slice and port list, and note it in `unlisted`."""
        listed = unlisted_port(item, self.view.rules)
        if listed is None:
            unlisted.pop(item.key, None)
            return
        if self._unlisted.get(item.key) != listed:
            log.warning(
                "%s: EndpointSlice %s/%s lists port(s) %s, not --worker-port %d: its endpoints "
                "are skipped, not registered at another port; give --worker-port the port the "
                "slices list for the engines' HTTP API (the container's, not a Service's)",
                self.what,
                item.metadata.namespace,
                item.metadata.name,
                ", ".join(map(str, listed)),
                self.view.rules.port,
            )
        unlisted[item.key] = listed

    def _moved_on(self) -> None:
        self.backoff.reset()
        self._expired_in_a_row = 0

    # -- failures --------------------------------------------------------------------------

    async def _on_expired(self, exc: ApiException) -> None:
        self.view.expire()
        self._expired_in_a_row += 1
        log.info("%s: resourceVersion expired (%s); relisting", self.what, exc.reason)
        if self._expired_in_a_row > 1:
            # A fresh list's resourceVersion expired again before any event: the server is
            # compacting faster than we can watch, so do not hammer it.
            await self._back_off("expired again right after a relist")

    async def _back_off(self, problem: str) -> None:
        delay = self.backoff.next_delay()
        log.warning(
            "%s: EndpointSlice watch failed (%s); keeping the last %d URL(s), retrying in %.1f s",
            self.what,
            problem,
            len(self.view.urls),
            delay,
        )
        await self._sleep(delay)


def _status_label(status: Any) -> str:
    """The failure reason for an HTTP status: the ones an API server answers, else one
    label (a status comes from the server, and each label is a metric series)."""
    return f"http_{status}" if status in KNOWN_STATUSES else "http_other"


class _ShortWatch(Exception):
    """A watch that ended at once with nothing in it."""


class _Cut(Exception):
    """An established watch whose connection broke after it ran a while (`is_cut`)."""


def _api_problem(exc: ApiException, namespace: str) -> str:
    text = f"HTTP {exc.status} {exc.reason}".strip()
    if exc.status == 401:
        text += "; the API server refused the credentials (an expired or wrong token)"
    elif exc.status == 403:
        scope = f"in namespace {namespace}" if namespace else "cluster-wide (all namespaces)"
        text += (
            f"; the service account needs get/list/watch on endpointslices.discovery.k8s.io {scope}"
        )
    return text


class SliceDiscovery:
    """A replica's EndpointSlice watches, sharing one API client; `close` ends them all."""

    def __init__(
        self,
        client: ApiClient,
        namespace: str,
        settings: WatchSettings = WatchSettings(),
        supervisor: Supervisor | None = None,
    ) -> None:
        self.client = client
        self.supervisor = supervisor or Supervisor()
        self.api = DiscoveryV1Api(client)
        self.namespace = namespace
        self.settings = settings
        self.watches: list[EndpointSliceWatch] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, what: str, selector: str, rules: Extraction, publish: Publish) -> None:
        w = EndpointSliceWatch(
            self.api,
            what=what,
            namespace=self.namespace,
            selector=selector,
            rules=rules,
            publish=publish,
            settings=self.settings,
        )
        self.watches.append(w)
        # `run` survives every failure of a response, and a `publish` callback that raises
        # (its own `except Exception` logs it and backs off); the supervisor restarts it
        # should it end all the same.
        self._tasks.append(self.supervisor.spawn("discovery", f"endpointslices {what}", w.run))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.client.close()
