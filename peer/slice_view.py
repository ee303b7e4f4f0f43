"""SliceView: the current set of EndpointSlices behind one selector, and the URLs they name.

Rules of this file: no I/O and no asyncio. The list+watch loop (`peer.endpointslices`) feeds
it what the API server said; it answers with the listing to publish (the ready URLs, and the
unready ones when its rules keep them), or None when there is nothing new to say. Only the
methods below change its state.

Theory of operation
-------------------
A list+watch consumer sees the world in two ways, and must never mix them up:

    phase      | begin_relist | relist_page   | finish_relist(rv)          | apply / bookmark
    -----------+--------------+---------------+----------------------------+-----------------
    watching   | -> relisting | ViewError     | None (a stray end: ignored)| update, maybe publish
    relisting  | restart      | buffer items  | replace all, publish once  | ViewError
               |              |               | -> watching                |

    abandon_relist(): drop the buffer (a relist that failed part-way) -> watching, view kept
    expire():         410 Expired: forget the resourceVersion, so the loop relists

- A relist replaces the whole view at once and publishes exactly once, even when the set did
  not change: that first publish is what tells the PeerRegistry it is synced. A relist that
  fails between pages publishes nothing: a partial set would make siblings or workers that
  merely sat on a later page look gone.
- A watch event upserts (ADDED, MODIFIED) or removes (DELETED) one slice, by namespace and
  name, and publishes only when the listing changed.
- A URL offered both ready and unready (one pod in two slices during controller churn) is
  ready.
- Errors never clear the view: the last complete picture stays in force until a new one
  arrives. Only `expire` forgets the resourceVersion, and even then the view is kept until the
  relist that replaces it completes.
- The resourceVersion is opaque: it is stored and passed back, never compared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from peer.slices import Backend, BackendSet, EndpointSlice, Extraction, backends

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


class ViewError(Exception):
    """A call out of order (a bug in the loop, never the server's doing)."""


@dataclass(frozen=True, slots=True)
class Listing:
    """What the slices name: ready URLs, and apart those listed not ready (not terminating)
    when the rules keep them (`Extraction.keep_unready`)."""

    urls: tuple[str, ...] = ()
    unready: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Relisted:
    listing: Listing
    slices: int  # how many slices the list returned (0: the selector matched nothing)


class SliceView:
    def __init__(self, rules: Extraction) -> None:
        self.rules = rules
        self.resource_version: str | None = None
        self._backends: dict[tuple[str, str], tuple[Backend, ...]] = {}
        self._ready = BackendSet()
        self._unready = BackendSet()
        self._buffer: dict[tuple[str, str], tuple[Backend, ...]] | None = None
        self._listing = Listing()

    @property
    def urls(self) -> tuple[str, ...]:
        return self._listing.urls

    @property
    def listing(self) -> Listing:
        return self._listing

    @property
    def slices(self) -> int:
        return len(self._backends)

    @property
    def relisting(self) -> bool:
        return self._buffer is not None

    @property
    def needs_list(self) -> bool:
        return self.resource_version is None

    # -- relist ----------------------------------------------------------------------------

    def begin_relist(self) -> None:
        self._buffer = {}

    def relist_page(self, items: Iterable[EndpointSlice]) -> None:
        if self._buffer is None:
            raise ViewError("relist_page outside a relist")
        for item in items:
            self._buffer[item.key] = backends(item, self.rules)

    def finish_relist(self, resource_version: str) -> Relisted | None:
        """Install the relisted set; None for an end with no relist begun."""
        if self._buffer is None:
            return None
        self._backends, self._buffer = self._buffer, None
        self._ready, self._unready = BackendSet(), BackendSet()
        for group in self._backends.values():
            self._merge((), group)
        self.resource_version = resource_version
        self._listing = self._merged()
        return Relisted(self._listing, len(self._backends))

    def abandon_relist(self) -> None:
        self._buffer = None

    def expire(self) -> None:
        self._buffer = None
        self.resource_version = None

    # -- watch -----------------------------------------------------------------------------

    def apply(self, kind: str, item: EndpointSlice) -> Listing | None:
        """One ADDED/MODIFIED/DELETED event; the new listing when it changed."""
        if self._buffer is not None:
            raise ViewError("a watch event during a relist")
        if kind == DELETED:
            new: tuple[Backend, ...] = ()
            old = self._backends.pop(item.key, ())
        elif kind in (ADDED, MODIFIED):
            new = backends(item, self.rules)
            old = self._backends.get(item.key, ())
            self._backends[item.key] = new
        else:
            raise ViewError(f"unknown event type {kind!r}")
        self._merge(old, new)
        if item.metadata.resource_version:
            self.resource_version = item.metadata.resource_version
        listing = self._merged()
        if listing == self._listing:
            return None
        self._listing = listing
        return listing

    def bookmark(self, resource_version: str) -> None:
        """The server's progress marker: resume from here (it may skip writes we never see)."""
        if self._buffer is not None:
            raise ViewError("a bookmark during a relist")
        self.resource_version = resource_version

    # -- merging ---------------------------------------------------------------------------

    def _merge(self, removed: tuple[Backend, ...], added: tuple[Backend, ...]) -> None:
        self._ready.update((b for b in removed if b.ready), (b for b in added if b.ready))
        self._unready.update((b for b in removed if not b.ready), (b for b in added if not b.ready))

    def _merged(self) -> Listing:
        urls = self._ready.urls
        unready = self._unready.urls
        if unready:
            ready = set(urls)
            unready = tuple(u for u in unready if u not in ready)
        return Listing(urls, unready)
