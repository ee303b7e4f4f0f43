"""Worker and sibling URLs are origins: scheme, host and port, nothing else.

Rules of this file: no I/O. `origin_problem` says why a URL cannot name a worker (or a
sibling), `worker_origin_problem` adds what a worker's may not be, `canonical_origin` spells
an accepted one the one way the registry keys it, and `AllowList` is `--worker-allow-cidr`:
the networks an admin-added worker (and any worker's KV-event endpoints elsewhere than its
own host) may live in.

Why origins only: the router appends its own paths (`/server_info`, `/health`, `/v1/loads`,
`/v1/kv-snapshot`, the completion routes) to a worker's URL. A path, a query or a fragment
would let whoever registers a worker choose what the router fetches and relays instead
(`http://127.0.0.1:29999/latest/meta-data/iam#` turned every completion into a read of a
metadata service, its answer relayed to the client). Credentials in a URL would be sent to
every path and logged with it. So none of them is accepted, not even empty (`?` or `#` at
the end), and nothing is silently dropped either: a caller learns what was wrong.

The host is an IP literal or an ASCII hostname (labels of 1-63 characters, 253 in all): every
client the router talks to a worker with spells the host in ASCII (the data plane's pools
encode it as latin-1, `getaddrinfo` IDNA-encodes a name and fails on an over-long label), so
a host that is not one registered a worker no pass of the health loop could check (one such
worker stopped every worker's checks). A non-ASCII name is to be given in its IDNA form.
Port 0 is refused too: nothing is ever reachable there.

An IPv4 address is accepted only as a dotted quad (four decimal numbers 0-255, no leading
zeros, no trailing dot). A host whose last label is a number (`127.1`, `2130706433`,
`127.000.000.001`, `0x7f.1`, `127.0.0.1.`) is an IPv4 address to a URL parser (the WHATWG
rule), yet no host name: the C resolver reads the legacy spellings as addresses (the data
plane's pools and the health checks reached them), while aiohttp refuses every one but the
hex ones before connecting ("not a canonical IPv4 address"), so `/server_info`, the load and
snapshot fetches and a sibling's snapshot never worked: a worker stayed down, re-registered
at every health pass, and a joiner waited out its bootstrap for a sibling it never reached.
The refusal names the dotted quad the resolver reads, the spelling to give instead.

One engine is one worker however its address is spelt: it is keyed as siblings are
(`peer.spellings.spelling`: scheme and host in lower case, an IPv6 literal compressed, an
IPv4-mapped one as its IPv4 address, the scheme's default port written or not), else
`http://[::ffff:7f00:1]:P` beside `http://127.0.0.1:P`, or `http://w:80` beside `http://w`,
was a second worker, subscribed to the same stream, its ranks counted again in the index and
the loads, its requests and in-flight counts split between the two.

`localhost` is `127.0.0.1`, always (siblings fold the two only when this replica listens on
loopback, which says whether a sibling's loopback is this machine's; a worker's loopback is
this machine's wherever the replica listens): `http://localhost:P` is keyed, listed and
reached as `http://127.0.0.1:P`. In theory another listener could hold port P on IPv6
loopback, where a connect to `localhost` may go first; an engine told to listen on
`localhost` listens on 127.0.0.1 (on ::1 too, at most), and one on IPv6 loopback alone is
given unambiguously as `http://[::1]:P`, which stays apart. The registry logs the fold,
naming both spellings.

A worker's host may not be the unspecified address (`0.0.0.0`, `[::]`, what an engine's log
says it listens on): a connect to it reaches whatever listens on the connecting machine, so it
names no one worker, and no sibling can read it as this replica does.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from peer.spellings import DEFAULT_PORTS, FOLDED_LOOPBACK, canonical_host, spelling

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


_MAX_HOSTNAME = 253
_MAX_LABEL = 63
_LABEL = re.compile(r"[a-z0-9_-]+")  # hostname-ish; `hostname` is lower case already
_NUMBER = re.compile(r"[0-9]+|0x[0-9a-f]*")  # a label a URL parser reads as a number


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) URL with a host (a path is fine), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port out of range
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0 is not a port anything listens on"
    return host_problem(parts.hostname)


def host_problem(host: str) -> str | None:
    """Why `host` (as `urlsplit` gives it: no brackets, lower case) is neither an IP literal
    nor an ASCII hostname, or None."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host.isascii():
        return f"host {host!r} is not ASCII: use its IDNA (xn--) form"
    name = host.removesuffix(".")  # a fully qualified name's root dot
    if _NUMBER.fullmatch(name.rpartition(".")[2]):
        return _ipv4_spelling_problem(host, name)
    if len(name) > _MAX_HOSTNAME:
        return f"host name of {len(name)} characters: at most {_MAX_HOSTNAME}"
    for label in name.split("."):
        if not label or len(label) > _MAX_LABEL:
            return (
                f"host {host!r} has a label of {len(label)} characters: each one is 1 to "
                f"{_MAX_LABEL}"
            )
        if _LABEL.fullmatch(label) is None:
            return f"host {host!r} is not a host name: letters, digits, '-' and '_' only"
    return None


def _ipv4_spelling_problem(host: str, name: str) -> str:
    """Why `host`, which ends in a number and is no dotted quad, is refused."""
    quad = "four decimal numbers 0-255, no leading zeros, no trailing dot"
    try:
        # Pure parsing (no lookup): how the C resolver, and so a plain connect, reads it.
        address = ipaddress.IPv4Address(socket.inet_aton(name))
    except OSError:
        return (
            f"host {host!r} ends in a number, so it is read as an IPv4 address, and it is not "
            f"one ({quad})"
        )
    parts = name.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        # Leading zeros: the C resolver reads them as octal, where most who write them (and
        # the Kubernetes API server, which takes them) mean decimal: name both readings.
        decimal = ".".join(str(int(p)) for p in parts)
        if name == decimal:  # a quad but for its root dot
            return f"host {host!r} is an IPv4 address with a trailing dot: write it as {name}"
        if decimal == str(address):
            return f"host {host!r} is an IPv4 address with leading zeros: write it as {decimal}"
        return (
            f"host {host!r} is an IPv4 address with leading zeros, read two ways: as octal "
            f"({address}, how the C resolver reads it) or as decimal ({decimal}, how the "
            f"Kubernetes API server does); write the one meant, without them ({quad})"
        )
    return (
        f"host {host!r} is a legacy spelling of the IPv4 address {address} (as the C resolver "
        f"reads it; the router's HTTP client refuses it): write it as {address} ({quad})"
    )


def origin_problem(url: str) -> str | None:
    """Why `url` is not an http(s) origin, or None when it is one."""
    if any(c.isspace() or ord(c) < 0x20 or c == "\\" for c in url):
        return "whitespace, control characters or backslashes are not allowed"
    if (problem := url_problem(url)) is not None:
        return problem
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        return "credentials are not allowed in a worker URL (an origin: scheme://host:port)"
    if parts.path not in ("", "/"):
        return f"path {parts.path!r} is not allowed (an origin: scheme://host:port)"
    if "?" in url:
        return "a query is not allowed (an origin: scheme://host:port)"
    if "#" in url:
        return "a fragment is not allowed (an origin: scheme://host:port)"
    return None


def worker_origin_problem(url: str) -> str | None:
    """Why `url` cannot be a worker's origin, or None: `origin_problem`'s reasons, and a host
    that is the unspecified address."""
    if (problem := origin_problem(url)) is not None:
        return problem
    host = canonical_host(host_of(url))
    if is_unspecified(host):
        return (
            f"host {host} is the unspecified address: an engine listens on it to take "
            "connections on every address it has, but it names no machine to connect to "
            "(and no one worker: every replica would read it as its own machine); give the "
            "worker's address (127.0.0.1 for this machine)"
        )
    return None


def is_unspecified(host: str) -> bool:
    """Whether `host` (as `canonical_host` spells it) is `0.0.0.0` or `::`."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_link_scoped(host: str) -> bool:
    """Whether `host` (as `canonical_host` spells it) is an IPv6 address reached only through
    a named interface: link-local (`fe80::/10`), or given with a zone (`%25eth0`)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return isinstance(address, ipaddress.IPv6Address) and (
        address.is_link_local or address.scope_id is not None
    )


@lru_cache(maxsize=4096)  # ~35 us a spelling; siblings name the same few workers again and again
def canonical_origin(url: str) -> str:
    """`scheme://host[:port]` as `peer.spellings.spelling` reads it (scheme and host in lower
    case, an IP literal as `canonical_host` spells it, `localhost` as 127.0.0.1), no trailing
    slash, and the port left out when it is the scheme's default (as a URL parser serializes
    an origin).

    Only for URLs `origin_problem` accepts; anything else is returned with its trailing
    slashes stripped, so a lookup of a malformed URL finds nothing rather than raising.
    """
    if origin_problem(url) is not None:
        return url.rstrip("/")
    scheme, host, port = spelling(url, fold_loopback=True)
    if host == FOLDED_LOOPBACK:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" if port == DEFAULT_PORTS[scheme] else f"{scheme}://{host}:{port}"


def http_origin(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 literal in brackets (whether or not it came in them)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


@dataclass(frozen=True, slots=True)
class AllowList:
    """`--worker-allow-cidr`: networks an admin-added worker's addresses must all be in.

    Empty means no restriction (the bearer token is then the only gate). An address is
    checked as the one it connects to, an IPv4-mapped one as its IPv4 address, so an entry
    inside `::ffff:0:0/96` is read as the IPv4 network it maps (`::ffff:10.0.0.0/104` as
    `10.0.0.0/8`): kept in IPv6, it matched no address at all.
    """

    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, cidrs: Iterable[str]) -> AllowList:
        """Raises ValueError naming the entry that is not a network."""
        networks = []
        for cidr in cidrs:
            try:
                networks.append(_unmapped(ipaddress.ip_network(cidr.strip(), strict=False)))
            except ValueError as exc:
                raise ValueError(f"{cidr!r} is not a CIDR network: {exc}") from None
        return cls(tuple(networks))

    @property
    def restricts(self) -> bool:
        return bool(self.networks)

    def refusal(self, host: str, addresses: Sequence[str]) -> str | None:
        """Why a worker at `host`, which resolves to `addresses`, is refused; None if allowed."""
        if not self.networks:
            return None
        if not addresses:
            return f"{host} resolves to no address"
        for raw in addresses:
            try:
                address = ipaddress.ip_address(raw.split("%", 1)[0])
            except ValueError:
                return f"{host} resolves to {raw!r}, not an IP address"
            mapped = getattr(address, "ipv4_mapped", None)
            if mapped is not None:
                address = mapped
            if not any(address in net for net in self.networks):
                allowed = ", ".join(str(n) for n in self.networks)
                return f"{host} ({address}) is outside --worker-allow-cidr ({allowed})"
        return None


_IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def _unmapped(network: IPNetwork) -> IPNetwork:
    """A network inside `::ffff:0:0/96` as the IPv4 network it maps; any other as it is."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_IPV4_MAPPED):
        ipv4 = ipaddress.IPv4Address(int(network.network_address) & 0xFFFF_FFFF)
        return ipaddress.IPv4Network((ipv4, network.prefixlen - 96))
    return network
