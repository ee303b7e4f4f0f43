"""PeerRegistry: the sibling replicas this replica may ask for a snapshot.

Rules of this file: no I/O and no asyncio. Discovery (an EndpointSlice watch, or the static
`--peer` list) calls `replace` with the whole current set; sweeps and probes read `peers`,
`candidates()` and the flags. Everything runs on one event loop, so nothing here locks.

Theory of operation
-------------------
A sweep must tell "no siblings exist" apart from "not told yet" and from "the siblings
blinked out for a moment", because only the first lets a booting replica stop looking and run
cold at once. Three facts answer that:

    synced          discovery has delivered a set at least once
    ever_had_peers  some delivered set was non-empty
    peers           the current set

`known_to_have_no_peers()` is `synced and not peers and not ever_had_peers`. Before the first
delivery an empty set means nothing; after siblings have been seen, an empty set is a dip
(a rolling update, a watch relist), and the sweep keeps waiting for its deadline instead.

Self is never a peer: asking ourselves for a snapshot would find our own cold tree. URLs are
compared without trailing slashes, deduplicated and kept sorted, so `peers` is a canonical
value. `version` counts changes of the set (not deliveries), so a sweep that saw version v at
the start of a pass can tell the candidate set moved under it, even when a swap kept its size,
and discard a "the whole fleet is cold" verdict built from peers that are gone.

`candidates()` is a fresh shuffled copy: replicas that boot together then spread their
fetches over the siblings instead of all asking the first one. The random source is injected
so tests can fix the order.
"""

from __future__ import annotations

import random
from collections.abc import Iterable


class PeerRegistry:
    def __init__(self, self_url: str | None = None, rng: random.Random | None = None) -> None:
        self._self = _normalize(self_url) if self_url else None
        self._rng = rng if rng is not None else random.Random()
        self._peers: tuple[str, ...] = ()
        self._synced = False
        self._ever_had_peers = False
        self._version = 0

    @classmethod
    def static(
        cls,
        urls: Iterable[str],
        self_url: str | None = None,
        rng: random.Random | None = None,
    ) -> PeerRegistry:
        """A fixed list (`--peer URL`, repeatable): synced from the start, even when empty."""
        registry = cls(self_url, rng)
        registry.replace(urls)
        return registry

    def replace(self, urls: Iterable[str]) -> bool:
        """Install the whole current set; returns True when it differs from the last one."""
        peers = tuple(sorted({u for u in map(_normalize, urls) if u and u != self._self}))
        self._synced = True
        if peers:
            self._ever_had_peers = True
        if peers == self._peers:
            return False
        self._peers = peers
        self._version += 1
        return True

    @property
    def peers(self) -> tuple[str, ...]:
        return self._peers

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def ever_had_peers(self) -> bool:
        return self._ever_had_peers

    @property
    def version(self) -> int:
        """Bumped on every change of the set; equal versions mean the same set."""
        return self._version

    def known_to_have_no_peers(self) -> bool:
        return self._synced and not self._peers and not self._ever_had_peers

    def candidates(self) -> list[str]:
        """The current peers in a fresh random order."""
        out = list(self._peers)
        self._rng.shuffle(out)
        return out

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and _normalize(url) in self._peers

    def __repr__(self) -> str:
        return (
            f"PeerRegistry(peers={list(self._peers)}, synced={self._synced}, "
            f"ever_had_peers={self._ever_had_peers}, version={self._version})"
        )


def _normalize(url: str) -> str:
    return url.strip().rstrip("/")
