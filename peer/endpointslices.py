"""List+watch of EndpointSlices with kubernetes-asyncio: one engine, two uses.

The replica watches `discovery.k8s.io/v1` EndpointSlices twice: `--kv-peer-selector` names
its siblings (fed to the PeerRegistry), `--worker-selector` its workers (fed to the worker
registry). What a slice means lives in `peer.slices`, what the view holds in
`peer.slice_view`; this file is the thin loop around them.

The loop (the same division as client-go's Reflector):

    list (paged) ---> watch from the list's resourceVersion, with bookmarks ---> clean end:
      ^                 |                                                       watch again
      |                 +-- 410 Expired (an ERROR event or an HTTP 410) --> relist
      |                 +-- any other error: back off (jittered, capped), keep the view and
      +-----------------    the resourceVersion; a later 410 forces the relist

- `timeout_seconds` is always passed, which turns off kubernetes-asyncio's hidden retries
  (a silent re-watch on a clean end, one repeat with the same too-old resourceVersion on a
  410): the loop decides every case itself. The client gets a total timeout a little longer
  than the server's, so a half-open connection cannot hang the watch forever.
- A watch that ends cleanly within `min_watch_s` with no event at all is treated as a
  failure and backed off: a server (or proxy) that closes every watch at once must not turn
  the loop into a busy one.
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
from typing import Any

import aiohttp
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from peer.slice_view import SliceView
from peer.slices import EndpointSlice, Extraction, SliceError, decode_slice
from peer.supervise import Supervisor
from peer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Publish = Callable[[tuple[str, ...]], None]


@dataclass(frozen=True, slots=True)
class WatchSettings:
    page_size: int = 500  # items per list page, as kubectl asks
    watch_timeout_s: int = 300  # the server ends each watch after this (timeoutSeconds)
    request_grace_s: float = 30.0  # the client gives up this long after the server should have
    list_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    min_watch_s: float = 1.0
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
    # expired, http_<status>, transport, short_watch, unexpected
    failures: Counter[str] = field(default_factory=Counter)


class EndpointSliceWatch:
    """Keeps one selector's URL set current and hands every new set to `publish`."""

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
        self.stats = WatchStats()

    async def run(self) -> None:
        """Forever, until cancelled."""
        log.info("%s: watching EndpointSlices %r in %s", self.what, self.selector, self._where)
        while True:
            try:
                if self.view.needs_list:
                    await self._relist()
                await self._watch()
            except ApiException as exc:
                self.view.abandon_relist()
                if exc.status == 410:
                    self.stats.failures["expired"] += 1
                    await self._on_expired(exc)
                else:
                    self.stats.failures[f"http_{exc.status}"] += 1
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
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "label_selector": self.selector,
                "limit": self.settings.page_size,
                "_request_timeout": self.settings.list_timeout_s,
            }
            if token:
                kwargs["_continue"] = token
            page = await self._list(**kwargs)
            self.view.relist_page(self._decode_all(page.items or ()))
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                break
        relisted = self.view.finish_relist(page.metadata.resource_version)
        assert relisted is not None, "begun above"
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
            len(relisted.urls),
        )
        self._publish(relisted.urls)

    def _list(self, **kwargs: Any) -> Awaitable[Any]:
        if self.namespace:
            return self.api.list_namespaced_endpoint_slice(self.namespace, **kwargs)
        return self.api.list_endpoint_slice_for_all_namespaces(**kwargs)

    def _decode_all(self, items: Any) -> list[EndpointSlice]:
        out = []
        for item in items:
            decoded = self._decode(self.api.api_client.sanitize_for_serialization(item))
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
        events = 0
        # "object": events stay dicts; the client's typed models would be built and thrown
        # away (we read `raw_object`), and they cost more than everything else per event.
        async with watch.Watch(return_type="object") as stream:
            async for event in stream.stream(
                func,
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
                events += 1
                self._on_event(event)
        if events == 0 and self._clock() - started < settings.min_watch_s:
            raise _ShortWatch(f"the watch ended after {self._clock() - started:.2f} s, empty")

    def _on_event(self, event: Any) -> None:
        if not isinstance(event, dict):  # a line that was not JSON comes through as text
            raise ValueError(f"not a watch event: {str(event)[:200]!r}")
        kind = event.get("type")
        raw = event.get("raw_object")
        self.backoff.reset()
        self._expired_in_a_row = 0
        self.stats.events[str(kind)] += 1
        if kind == "BOOKMARK":
            self.view.bookmark(raw["metadata"]["resourceVersion"])
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring a watch event of type %r", self.what, kind)
            return
        item = self._decode(raw)
        if item is None:
            return
        urls = self.view.apply(kind, item)
        if urls is not None:
            log.info(
                "%s: %s %s/%s: %d URL(s)",
                self.what,
                kind.lower(),
                item.metadata.namespace,
                item.metadata.name,
                len(urls),
            )
            self._publish(urls)

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


class _ShortWatch(Exception):
    """A watch that ended at once with nothing in it."""


def _api_problem(exc: ApiException, namespace: str) -> str:
    text = f"HTTP {exc.status} {exc.reason}".strip()
    if exc.status in (401, 403):
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
        # `run` survives every failure it knows of; the supervisor catches the rest (a
        # `publish` callback that raises) and restarts it.
        self._tasks.append(self.supervisor.spawn("discovery", f"endpointslices {what}", w.run))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.client.close()
