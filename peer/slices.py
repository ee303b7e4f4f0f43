"""EndpointSlices as this router reads them, and the backend URLs they name.

Rules of this file: no I/O, no asyncio, no Kubernetes client. The structs below are the
wire shape of `discovery.k8s.io/v1` EndpointSlice, reduced to the fields we read; every field
is optional (the API leaves most of them out at will, and writes `"endpoints": null` for a
Service with no endpoints), and unknown fields such as `managedFields` are ignored.

Extraction (what one slice contributes), after the SGLang router's peer watch:

- A slice of the other address family than the one we listen on is skipped; FQDN and unknown
  address types are kept. `0.0.0.0` or any IPv4 literal listens on IPv4 only, a specific IPv6
  literal on IPv6 only, `::` or a host name on both.
- The port is the slice's port equal to our preferred one (our own `--port` for siblings,
  `--worker-port` for workers), else the slice's first port, else (a slice that lists none)
  the preferred one; a slice that yields no port at all contributes nothing. A preferred port
  the rules require (`exact_port`: a `--worker-port` given) is never guessed: a slice that
  lists ports, none of them it, contributes nothing (`unlisted_port` says which it lists):
  its first port may be anything (an engine's KV-event port), and a worker registered there
  answered nothing. Siblings (`one_per_pod`) are offered on each of a slice's ports equal to
  our `--control-port` or `--port`, else on its first one (see below).
- A terminating endpoint drops out at once (it stays `ready` when its Service publishes
  not-ready addresses, and goes all the same). Of the rest, ready ones count, and an absent
  `ready` means ready (the API's rule). A not-ready one drops out too, unless the rules keep
  it apart as unready (`keep_unready`, workers): a readiness probe that failed for a few
  seconds (a slow engine, its node NotReady) says nothing of the engine's cache, so the
  worker registry holds its ranks for a grace instead of forgetting them.
- Self is dropped (siblings only): an endpoint whose address is our `POD_IP`, or whose
  targetRef is our pod (kind Pod or absent, name `POD_NAME`, same namespace when both known).
- Only the first address is used (the controller writes exactly one); IPv6 is bracketed.
- The backend key is `targetRef.uid:port`, else the URL. The same pod may sit in two slices
  at once (the API allows it during controller churn) and a dual-stack pod sits in an IPv4
  and an IPv6 slice: merging by key keeps one URL per backend, the lexicographically smallest
  (which prefers the IPv4 one), then the URLs are sorted.
- Siblings are one per pod (`one_per_pod`): the key is `targetRef.uid`, else the endpoint's
  address, with no port. A replica's pod is in every Service that selects it, and the main
  port's Service and one for `--control-port` (for a NetworkPolicy) may both match the
  selector: keyed by port, each sibling was counted twice (two snapshots asked, two decision
  posts, a replica count one too high in the cost). Of the ports a pod is offered on (by all
  its slices; one Service listing both our ports offers both), the one equal to our own
  `--control-port` wins (the port meant for replica-to-replica traffic, the same flag across a
  Deployment), else the one equal to our `--port`, else the lowest.
  Workers keep the port in the key: one pod may run two engines.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from sortedcontainers import SortedList


class ObjectReference(msgspec.Struct):
    kind: str | None = None
    namespace: str | None = None
    name: str | None = None
    uid: str | None = None


class EndpointConditions(msgspec.Struct):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class Endpoint(msgspec.Struct, rename="camel"):
    addresses: list[str] | None = None
    conditions: EndpointConditions | None = None
    target_ref: ObjectReference | None = None


class EndpointPort(msgspec.Struct):
    name: str | None = None
    port: int | None = None
    protocol: str | None = None


class ObjectMeta(msgspec.Struct, rename="camel"):
    name: str = ""
    namespace: str | None = None
    resource_version: str | None = None


class EndpointSlice(msgspec.Struct, rename="camel"):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    address_type: str | None = None
    endpoints: list[Endpoint] | None = None
    ports: list[EndpointPort] | None = None

    @property
    def key(self) -> tuple[str, str]:
        """Slices are named per namespace: the view is keyed by (namespace, name)."""
        return (self.metadata.namespace or "", self.metadata.name)


class SliceError(ValueError):
    """An object that is not an EndpointSlice we can read."""


def decode_slice(obj: Mapping[str, Any]) -> EndpointSlice:
    """An EndpointSlice from its JSON object (camelCase keys, as served or sanitized)."""
    try:
        return msgspec.convert(obj, EndpointSlice)
    except msgspec.ValidationError as exc:
        raise SliceError(f"not an EndpointSlice: {exc}") from None


class Family(enum.Enum):
    IPV4 = "IPv4"
    IPV6 = "IPv6"
    ANY = "any"


def listen_family(host: str) -> Family:
    """The address family our listen address serves (see the module's opening)."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return Family.ANY  # a host name may resolve to either
    if addr.version == 4:
        return Family.IPV4
    return Family.ANY if addr.is_unspecified else Family.IPV6


@dataclass(frozen=True, slots=True)
class SelfIdentity:
    """Who we are, from the downward API; empty values count as unset."""

    pod_name: str | None = None
    namespace: str | None = None
    pod_ip: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SelfIdentity:
        return cls(
            pod_name=_set(environ.get("POD_NAME")) or _set(environ.get("HOSTNAME")),
            namespace=_set(environ.get("POD_NAMESPACE")),
            pod_ip=_set(environ.get("POD_IP")),
        )

    @property
    def known(self) -> bool:
        """Without a name or an IP we cannot recognise ourselves in a slice."""
        return bool(self.pod_name or self.pod_ip)

    def owns(self, endpoint: Endpoint) -> bool:
        ip = self.pod_ip
        if ip and any(a == ip or _same_ipv6(a, ip) for a in endpoint.addresses or ()):
            return True
        ref = endpoint.target_ref
        if ref is None or not self.pod_name or ref.kind not in (None, "Pod"):
            return False
        if ref.name != self.pod_name:
            return False
        return not (self.namespace and ref.namespace and ref.namespace != self.namespace)


@dataclass(frozen=True, slots=True)
class Extraction:
    """How slices become URLs for one use (siblings or workers)."""

    family: Family
    port: int | None  # preferred port; None: the slice's first port
    identity: SelfIdentity | None = None  # None: nothing to exclude (the worker watch)
    scheme: str = "http"
    one_per_pod: bool = False  # siblings: a pod is one backend whatever its ports
    control_port: int | None = None  # of a pod's ports, the one preferred (one_per_pod)
    keep_unready: bool = False  # a not-ready, not-terminating endpoint is kept, as unready
    exact_port: bool = False  # a `port` given must be listed by a slice that lists ports

    def port_choice(self, port: int) -> tuple[int, int]:
        """Sorts a pod's ports, best first: our control port, our port, then the lowest."""
        if not self.one_per_pod:
            return (0, 0)  # one port per backend: nothing to choose
        if port == self.control_port:
            return (0, port)
        return (1, port) if port == self.port else (2, port)


@dataclass(frozen=True, slots=True, order=True)
class Backend:
    key: str  # targetRef.uid:port, else the URL (one_per_pod: the pod, see above)
    url: str
    choice: tuple[int, int] = (0, 0)  # the smallest (choice, url) among a key's offers wins
    ready: bool = True  # False: listed not ready, not terminating (`Extraction.keep_unready`)


def slice_ports(ports: Iterable[EndpointPort] | None, rules: Extraction) -> tuple[int, ...]:
    """The ports a slice offers its endpoints on (see the module's opening); none: it
    contributes nothing."""
    numbers = [p.port for p in ports or () if p.port is not None]
    preferred = rules.port
    if not numbers:
        return () if preferred is None else (preferred,)
    if rules.one_per_pod:
        ours = tuple(dict.fromkeys(p for p in numbers if p in (rules.control_port, preferred)))
        return ours or (numbers[0],)
    if preferred in numbers:
        return (preferred,)
    return () if rules.exact_port and preferred is not None else (numbers[0],)


def unlisted_port(slice_: EndpointSlice, rules: Extraction) -> tuple[int, ...] | None:
    """The ports a slice lists when the port the rules require is not among them (its
    endpoints are skipped); None when nothing is amiss."""
    numbers = tuple(p.port for p in slice_.ports or () if p.port is not None)
    if not rules.exact_port or rules.port is None or not numbers or rules.port in numbers:
        return None
    return numbers


def backends(slice_: EndpointSlice, rules: Extraction) -> tuple[Backend, ...]:
    """What one slice contributes: its ready (and, kept apart, unready), non-terminating,
    non-self endpoints of our family."""
    address_type = slice_.address_type
    family = rules.family
    if (
        family is not Family.ANY
        and address_type in ("IPv4", "IPv6")
        and address_type != family.value
    ):
        return ()
    ports = slice_ports(slice_.ports, rules)
    out = []
    for endpoint in slice_.endpoints or ():
        conditions = endpoint.conditions
        if conditions is not None and conditions.terminating:
            continue
        ready = conditions is None or conditions.ready is not False
        if not ready and not rules.keep_unready:
            continue
        if not endpoint.addresses:
            continue
        if rules.identity is not None and rules.identity.owns(endpoint):
            continue
        address = endpoint.addresses[0]
        host = f"[{address}]" if ":" in address else address
        uid = endpoint.target_ref.uid if endpoint.target_ref is not None else None
        for port in ports:
            url = f"{rules.scheme}://{host}:{port}"
            if rules.one_per_pod:
                key = f"pod:{uid}" if uid else f"address:{address}"
            else:
                key = f"{uid}:{port}" if uid else url
            out.append(Backend(key, url, rules.port_choice(port), ready))
    return tuple(out)


class BackendSet:
    """Backends of many slices, merged: one URL per backend key (the smallest (choice, URL)),
    sorted.

    Kept up to date slice by slice: a watch event touches one slice, and re-merging every
    backend of a large fleet for each event cost milliseconds per thousand endpoints.
    """

    def __init__(self) -> None:
        # key -> (choice, URL) -> how many slices offer it
        self._offers: dict[str, Counter[tuple[tuple[int, int], str]]] = {}
        self._chosen: dict[str, str] = {}  # key -> its smallest offered URL
        self._choosers: Counter[str] = Counter()  # URL -> how many keys chose it
        self._urls: SortedList[str] = SortedList()  # the distinct chosen URLs

    def update(self, removed: Iterable[Backend], added: Iterable[Backend]) -> None:
        touched = set()
        for b in removed:
            offers = self._offers[b.key]
            offer = (b.choice, b.url)
            offers[offer] -= 1
            if offers[offer] == 0:
                del offers[offer]
                if not offers:
                    del self._offers[b.key]
            touched.add(b.key)
        for b in added:
            self._offers.setdefault(b.key, Counter())[(b.choice, b.url)] += 1
            touched.add(b.key)
        for key in touched:
            old = self._chosen.get(key)
            offers = self._offers.get(key)
            new = min(offers)[1] if offers else None
            if old == new:
                continue
            if old is not None:
                self._choosers[old] -= 1
                if self._choosers[old] == 0:
                    del self._choosers[old]
                    self._urls.remove(old)
            if new is None:
                del self._chosen[key]
                continue
            self._chosen[key] = new
            self._choosers[new] += 1
            if self._choosers[new] == 1:
                self._urls.add(new)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._urls)


def urls(slices: Iterable[EndpointSlice], rules: Extraction) -> tuple[str, ...]:
    merged = BackendSet()
    for s in slices:
        merged.update((), backends(s, rules))
    return merged.urls


def _set(value: str | None) -> str | None:
    return value if value else None


def _same_ipv6(a: str, b: str) -> bool:
    """IPv6 has many spellings of one address (IPv4's dotted quad, as Kubernetes writes it,
    has one), so only those are parsed: this runs for every endpoint of every slice."""
    if ":" not in a or ":" not in b:
        return False
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False
