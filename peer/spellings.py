"""One sibling, however the static `--peer` list spells it; this replica, however it is listed.

Rules of this file: plain functions, no I/O but `machine_hosts` (this machine's names and
addresses, from the standard library's resolver). The caller passes what it knows of this
replica (its listen host and ports, `--self-url`, `POD_IP`, the machine's addresses);
`sort_out` answers which listed URLs are siblings to ask, once each, and which it left out
and why.

Theory of operation
-------------------
Every replica is often given one list, itself included, and a list may name one sibling
twice (`http://127.0.0.1:8081` and `http://localhost:8081/`). A sibling counted twice is
asked twice for snapshots, gets each routing decision twice, and weighs the cost's backlog
term as one replica more; this replica counted as its own sibling asks itself for snapshots
and adopts its own decisions. Two URLs are the same replica only when that is certain:

  - spelling: scheme and host case, a trailing slash, the scheme's default port written out
    or not, an IPv6 literal's many spellings, an IPv4-mapped IPv6 address and its IPv4 one:
    always the same socket;
  - `localhost` and `127.0.0.1` on one port: the same replica only on a fleet that listens
    on this machine's loopback, which this replica does when it listens on loopback or the
    wildcard (then a sibling given by a loopback URL is on this machine too). A replica
    listening on a routable address says nothing about what its host's loopback runs, so
    there they stay apart. `[::1]` stays apart too: another listener may hold the port on
    IPv6 loopback (a replica on 127.0.0.1 does not listen there).

This replica is left out by its own URL (`--self-url`, else its listen address or `POD_IP` on
`--port` or `--control-port`). On the wildcard with neither `--self-url` nor `POD_IP` it has
no URL of its own; then a listed URL whose host is one of this machine's addresses (loopback,
its host name, what the host name resolves to) on one of its ports is taken for this replica
and left out with a warning that says to set `--self-url`: on one machine, one port is one
listener.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Folded as one replica's (see the module docstring); `::1` is another socket.
_IPV4_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
FOLDED_LOOPBACK = "loopback"  # the host `spelling` gives `_IPV4_LOOPBACK_NAMES` when it folds
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Listener:
    """What this replica knows of itself."""

    host: str  # --host
    ports: frozenset[int]  # --port and --control-port (when set)
    own_urls: frozenset[str]  # --self-url, else its listen address or POD_IP on its ports
    machine_hosts: frozenset[str] = frozenset()  # this machine's names and addresses

    @property
    def on_loopback_or_wildcard(self) -> bool:
        host = self.host.strip("[]").lower()
        return host in WILDCARDS or host in LOOPBACK_NAMES or _is_loopback(host)

    @property
    def guesses_itself(self) -> bool:
        """On the wildcard with no URL of its own: only its machine's addresses tell."""
        return self.host.strip("[]") in WILDCARDS and not self.own_urls


@dataclass(frozen=True, slots=True)
class Sorted:
    peers: tuple[str, ...]  # the siblings to ask, one URL each
    duplicates: tuple[tuple[str, str], ...]  # (left out, the spelling kept)
    guessed_self: tuple[str, ...]  # taken for this replica by its machine's addresses


def spelling(url: str, *, fold_loopback: bool) -> tuple[str, str, int]:
    """(scheme, host, port) as one replica is spelled once: host in lower case, an IPv6
    literal compressed, the default port written out; loopback names folded to one when
    `fold_loopback` (see the module docstring)."""
    parts = urlsplit(url.strip())  # scheme and host name come out in lower case
    scheme = parts.scheme
    host = canonical_host(parts.hostname or "")
    if fold_loopback and host in _IPV4_LOOPBACK_NAMES:
        host = FOLDED_LOOPBACK  # not the rest of 127/8: 127.0.0.2 is another address
    return scheme, host, parts.port or DEFAULT_PORTS.get(scheme, 0)


def sort_out(urls: Iterable[str], me: Listener) -> Sorted:
    """The listed siblings, this replica and second spellings left out (of one replica's
    spellings the smallest is kept, whatever the list's order)."""
    fold = me.on_loopback_or_wildcard
    mine = {spelling(u, fold_loopback=fold) for u in me.own_urls}
    machine = {canonical_host(h) for h in me.machine_hosts} | set(LOOPBACK_NAMES)
    kept: dict[tuple[str, str, int], str] = {}
    duplicates: list[tuple[str, str]] = []
    guessed: list[str] = []
    written = _written(urls)
    for url in sorted(written):
        key = spelling(url, fold_loopback=fold)
        if key in mine:
            continue
        _, host, port = key
        if me.guesses_itself and port in me.ports and _on_this_machine(host, machine):
            guessed.append(url)
            continue
        if key in kept:
            duplicates.extend((as_given, kept[key]) for as_given in written[url])
            continue
        kept[key] = url
        # Written more than one way that `_written` folds (host case, a trailing slash, a
        # default port): the others are second spellings too, and said as such.
        as_given = written[url]
        said_as = url if url in as_given else as_given[0]
        duplicates.extend((other, url) for other in as_given if other != said_as)
    return Sorted(tuple(sorted(kept.values())), tuple(duplicates), tuple(guessed))


def machine_hosts() -> frozenset[str]:
    """This machine's host name and the addresses it resolves to (empty when it does not)."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        infos = []
    return frozenset({name.lower(), *(str(info[4][0]) for info in infos)})


def _written(urls: Iterable[str]) -> dict[str, list[str]]:
    """Each URL spelled `scheme://host:port` (see `spelling`, loopback not folded), with the
    ways it was written (sorted): the spelling kept is the same whatever the list's order."""
    out: dict[str, set[str]] = {}
    for url in urls:
        if url.strip():
            scheme, host, port = spelling(url, fold_loopback=False)
            out.setdefault(f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}", set()).add(
                url.strip()
            )
    return {url: sorted(given) for url, given in out.items()}


def canonical_host(host: str) -> str:
    """`host` spelled once: lower case, no brackets, an IPv6 literal compressed, an
    IPv4-mapped one (`::ffff:127.0.0.1`, `::ffff:7f00:1`) as its IPv4 address: a connect to
    it is IPv4 traffic to that address, so it is the same socket."""
    host = host.strip("[]").lower()
    address, percent, zone = host.partition("%")
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return host
    mapped = getattr(parsed, "ipv4_mapped", None)
    compressed = (mapped or parsed).compressed
    # A link-local address's zone (`%25eth0` in a URL) says which interface reaches it: kept,
    # as the URL spells it, so two interfaces stay two siblings.
    return f"{compressed}%25{zone.removeprefix('25')}" if percent and not mapped else compressed


def _on_this_machine(host: str, machine: set[str]) -> bool:
    # The wildcard listens on every local address, all of 127/8 included.
    return host == FOLDED_LOOPBACK or host in machine or _is_loopback(host)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
