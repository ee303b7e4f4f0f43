"""What an EndpointSlice contributes: ready endpoints, self excluded, one URL per backend."""

from __future__ import annotations

import pytest

from peer.slices import (
    Extraction,
    Family,
    SelfIdentity,
    SliceError,
    backends,
    decode_slice,
    listen_family,
    slice_ports,
    unlisted_port,
    urls,
)
from tests.support.fake_apiserver import endpoint, endpoint_slice

ME = SelfIdentity(pod_name="router-a", namespace="default", pod_ip="10.0.0.1")
SIBLINGS = Extraction(Family.IPV4, 8080, ME)


def sl(endpoints, **kw):
    return decode_slice(endpoint_slice(kw.pop("name", "s1"), "kvrouter", endpoints, **kw))


def peers(*slices, rules: Extraction = SIBLINGS) -> tuple[str, ...]:
    return urls(slices, rules)


# -- self identity ------------------------------------------------------------------------


def test_self_is_excluded_by_pod_ip_and_siblings_are_kept() -> None:
    s = sl([endpoint("10.0.0.1", "router-a"), endpoint("10.0.0.2", "router-b")])
    assert peers(s) == ("http://10.0.0.2:8080",)


def test_self_is_excluded_by_pod_name_when_the_ip_differs() -> None:
    s = sl([endpoint("10.9.9.9", "router-a"), endpoint("10.0.0.2", "router-b")])
    assert peers(s) == ("http://10.0.0.2:8080",)


def test_a_same_named_pod_in_another_namespace_is_a_sibling() -> None:
    s = sl([endpoint("10.0.0.5", "router-a", namespace="staging")])
    assert peers(s) == ("http://10.0.0.5:8080",)


def test_self_is_excluded_by_name_when_our_own_namespace_is_unknown() -> None:
    me = SelfIdentity(pod_name="router-a")
    s = sl([endpoint("10.0.0.5", "router-a", namespace="staging")])
    assert peers(s, rules=Extraction(Family.IPV4, 8080, me)) == ()


def test_self_is_excluded_by_name_when_the_target_ref_has_no_namespace() -> None:
    s = sl([endpoint("10.0.0.5", "router-a", namespace=None)])
    assert peers(s) == ()


def test_an_endpoint_without_target_ref_is_excluded_by_ip_alone() -> None:
    s = sl([endpoint("10.0.0.1", target_ref=False), endpoint("10.0.0.2", target_ref=False)])
    assert peers(s) == ("http://10.0.0.2:8080",)


def test_the_ip_match_excludes_the_whole_endpoint_whatever_its_target_ref() -> None:
    s = sl([endpoint("10.0.0.1", "someone-else")])
    assert peers(s) == ()


def test_a_target_ref_of_another_kind_is_not_self() -> None:
    s = sl([endpoint("10.0.0.7", "router-a", kind="Node")])
    assert peers(s) == ("http://10.0.0.7:8080",)


def test_a_target_ref_without_kind_counts_as_a_pod() -> None:
    s = sl([endpoint("10.0.0.7", "router-a", kind=None)])
    assert peers(s) == ()


def test_with_no_identity_known_the_replica_lists_itself() -> None:
    unknown = SelfIdentity.from_env({})
    assert not unknown.known
    s = sl([endpoint("10.0.0.1", "router-a")])
    assert peers(s, rules=Extraction(Family.IPV4, 8080, unknown)) == ("http://10.0.0.1:8080",)


def test_identity_from_env_treats_empty_values_as_unset_and_falls_back_to_hostname() -> None:
    env = {"POD_NAME": "", "HOSTNAME": "router-h", "POD_NAMESPACE": "", "POD_IP": ""}
    assert SelfIdentity.from_env(env) == SelfIdentity(pod_name="router-h")
    full = {"POD_NAME": "router-a", "POD_NAMESPACE": "ns", "POD_IP": "10.0.0.1"}
    assert SelfIdentity.from_env(full) == SelfIdentity("router-a", "ns", "10.0.0.1")


def test_pod_ip_matches_an_ipv6_address_written_another_way() -> None:
    me = SelfIdentity(pod_ip="fd00::0001")
    s = sl([endpoint("fd00::1", "x"), endpoint("fd00::2", "y")], address_type="IPv6")
    assert peers(s, rules=Extraction(Family.ANY, 8080, me)) == ("http://[fd00::2]:8080",)


# -- endpoint selection -------------------------------------------------------------------


def test_unready_and_terminating_endpoints_are_skipped_and_absent_ready_counts_as_ready() -> None:
    s = sl(
        [
            endpoint("10.0.0.2", "b", ready=None),
            endpoint("10.0.0.3", "c", ready=False),
            endpoint("10.0.0.4", "d", ready=False, serving=True, terminating=True),
            # A Service with publishNotReadyAddresses keeps a terminating pod `ready`.
            endpoint("10.0.0.5", "e", ready=True, serving=True, terminating=True),
        ]
    )
    assert peers(s) == ("http://10.0.0.2:8080",)


WORKERS = Extraction(Family.ANY, 8000, keep_unready=True)


@pytest.mark.parametrize(
    ("conditions", "listed"),
    [
        ({"ready": True}, "ready"),
        ({"ready": None}, "ready"),  # absent: ready (the API's rule)
        ({"ready": False}, "unready"),  # a readiness flap: kept apart, not dropped
        ({"ready": False, "serving": False}, "unready"),
        ({"ready": False, "serving": True, "terminating": True}, None),
        ({"ready": False, "serving": False, "terminating": True}, None),
        ({"ready": True, "serving": True, "terminating": True}, None),  # publishNotReady...
    ],
)
def test_workers_keep_an_unready_endpoint_apart_and_drop_a_terminating_one(
    conditions: dict, listed: str | None
) -> None:
    s = sl([endpoint("10.0.0.2", "w", **conditions)], ports=[8000])
    found = {b.url: b.ready for b in backends(s, WORKERS)}
    expected = {} if listed is None else {"http://10.0.0.2:8000": listed == "ready"}
    assert found == expected


def test_only_the_first_address_is_used() -> None:
    raw = endpoint_slice("s", "kvrouter", [endpoint("10.0.0.2", "b")])
    raw["endpoints"][0]["addresses"].append("10.0.0.3")
    assert peers(decode_slice(raw)) == ("http://10.0.0.2:8080",)


def test_a_slice_with_null_endpoints_or_null_ports_is_empty_not_an_error() -> None:
    assert peers(sl(None)) == ()
    assert peers(sl(None, ports=None)) == ()


def test_a_backend_in_two_slices_is_offered_once() -> None:
    a = sl([endpoint("10.0.0.2", "b")], name="s1")
    b = sl([endpoint("10.0.0.2", "b"), endpoint("10.0.0.3", "c")], name="s2")
    assert peers(a, b) == ("http://10.0.0.2:8080", "http://10.0.0.3:8080")


def test_a_dual_stack_sibling_is_offered_once_by_its_ipv4_url() -> None:
    v4 = sl([endpoint("10.0.0.2", "b")], name="v4")
    v6 = sl([endpoint("fd00::2", "b")], name="v6", address_type="IPv6")
    assert peers(v4, v6, rules=Extraction(Family.ANY, 8080, ME)) == ("http://10.0.0.2:8080",)


def test_urls_are_sorted() -> None:
    s = sl([endpoint("10.0.0.9", "z"), endpoint("10.0.0.3", "c"), endpoint("10.0.0.5", "e")])
    assert list(peers(s)) == sorted(peers(s))


# -- address families ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "host,family",
    [
        ("0.0.0.0", Family.IPV4),
        ("10.1.2.3", Family.IPV4),
        ("::", Family.ANY),
        ("[::]", Family.ANY),
        ("fd00::5", Family.IPV6),
        ("[fd00::5]", Family.IPV6),
        ("router.local", Family.ANY),
    ],
)
def test_the_peer_address_family_follows_the_listen_address(host: str, family: Family) -> None:
    assert listen_family(host) is family


def test_the_other_address_family_is_skipped_and_ipv6_is_bracketed() -> None:
    v4 = sl([endpoint("10.0.0.2", "b")], name="v4")
    v6 = sl([endpoint("fd00::3", "c")], name="v6", address_type="IPv6")
    assert peers(v4, v6) == ("http://10.0.0.2:8080",)
    assert peers(v4, v6, rules=Extraction(Family.IPV6, 8080, ME)) == ("http://[fd00::3]:8080",)
    both = peers(v4, v6, rules=Extraction(Family.ANY, 8080, ME))
    assert both == ("http://10.0.0.2:8080", "http://[fd00::3]:8080")


def test_fqdn_slices_are_kept_for_either_family() -> None:
    fqdn = sl([endpoint("router-b.example", "b")], address_type="FQDN")
    assert peers(fqdn) == ("http://router-b.example:8080",)
    assert peers(fqdn, rules=Extraction(Family.IPV6, 8080, ME)) == ("http://router-b.example:8080",)


# -- ports --------------------------------------------------------------------------------


def test_the_port_prefers_our_own_then_the_first_listed_then_our_own() -> None:
    ports = sl(None, ports=[9000, 8080]).ports
    assert slice_ports(ports, Extraction(Family.ANY, 8080)) == (8080,)
    assert slice_ports(ports, Extraction(Family.ANY, 7000)) == (9000,)
    assert slice_ports(None, Extraction(Family.ANY, 7000)) == (7000,)
    assert slice_ports([], Extraction(Family.ANY, None)) == ()
    s = sl([endpoint("10.0.0.2", "b")], ports=[9000])
    assert peers(s) == ("http://10.0.0.2:9000",)
    assert peers(sl([endpoint("10.0.0.2", "b")], ports=None)) == ("http://10.0.0.2:8080",)


def test_a_slice_without_ports_contributes_nothing_when_no_port_is_preferred() -> None:
    workers = Extraction(Family.ANY, None)
    assert peers(sl([endpoint("10.0.0.2", "b")], ports=None), rules=workers) == ()
    assert peers(sl([endpoint("10.0.0.2", "b")], ports=[8000]), rules=workers) == (
        "http://10.0.0.2:8000",
    )


def test_one_pod_on_two_ports_in_two_slices_is_two_backends() -> None:
    a = sl([endpoint("10.0.0.2", "b")], name="a", ports=[8000])
    b = sl([endpoint("10.0.0.2", "b")], name="b", ports=[9000])
    assert peers(a, b, rules=Extraction(Family.ANY, None)) == (
        "http://10.0.0.2:8000",
        "http://10.0.0.2:9000",
    )


SIBLINGS_CONTROL = Extraction(Family.IPV4, 8080, ME, one_per_pod=True, control_port=9090)


def two_services(*ports: int) -> list:
    """Slices of Services that each select the same replica pods, one port each."""
    pods = [endpoint("10.0.0.2", "b"), endpoint("10.0.0.3", "c")]
    return [sl(pods, name=f"svc{port}", ports=[port]) for port in ports]


def test_a_sibling_listed_by_two_services_is_one_sibling_on_our_control_port() -> None:
    slices = two_services(8080, 9090)
    want = ("http://10.0.0.2:9090", "http://10.0.0.3:9090")
    assert peers(*slices, rules=SIBLINGS_CONTROL) == want
    assert peers(*reversed(slices), rules=SIBLINGS_CONTROL) == want


def test_without_a_control_port_a_sibling_on_two_ports_is_offered_on_ours_else_the_lowest() -> None:
    ours = Extraction(Family.IPV4, 8080, ME, one_per_pod=True)
    assert peers(*two_services(9090, 8080), rules=ours) == (
        "http://10.0.0.2:8080",
        "http://10.0.0.3:8080",
    )
    assert peers(*two_services(9191, 9090), rules=ours) == (
        "http://10.0.0.2:9090",
        "http://10.0.0.3:9090",
    )


@pytest.mark.parametrize(
    ("ports", "control_port", "port"),
    [
        ([8080, 8081], 8081, 8081),  # one Service listing both: the control port wins
        ([8081, 8080], 8081, 8081),
        ([8080, 8081], None, 8080),  # no control port: ours
        ([9999, 8080], 8081, 8080),  # the control port not listed: ours
        ([9999, 7000], 8081, 9999),  # neither: the slice's first
    ],
)
def test_a_sibling_in_one_slice_of_two_ports_is_offered_on_each_and_our_control_port_wins(
    ports: list[int], control_port: int | None, port: int
) -> None:
    rules = Extraction(Family.IPV4, 8080, ME, one_per_pod=True, control_port=control_port)
    pods = [endpoint("10.0.0.2", "b"), endpoint("10.0.0.3", "c")]
    assert peers(sl(pods, ports=ports), rules=rules) == (
        f"http://10.0.0.2:{port}",
        f"http://10.0.0.3:{port}",
    )


WORKERS_ON_80 = Extraction(Family.ANY, 80, exact_port=True)


@pytest.mark.parametrize(
    ("ports", "found", "unlisted"),
    [
        ([24110, 24100], (), (24110, 24100)),  # not guessed: the first is the ZMQ port
        ([5557, 80], ("http://10.0.0.2:80",), None),
        (None, ("http://10.0.0.2:80",), None),  # a slice that lists no port: the flag's
    ],
)
def test_a_required_worker_port_the_slice_does_not_list_skips_the_slice(
    ports: list[int] | None, found: tuple[str, ...], unlisted: tuple[int, ...] | None
) -> None:
    s = sl([endpoint("10.0.0.2", "w")], ports=ports)
    assert peers(s, rules=WORKERS_ON_80) == found
    assert unlisted_port(s, WORKERS_ON_80) == unlisted
    assert unlisted_port(s, Extraction(Family.ANY, 80)) is None  # not required: no problem
    no_flag = Extraction(Family.ANY, None, exact_port=True)  # no --worker-port: the first
    first = (f"http://10.0.0.2:{ports[0]}",) if ports else ()
    assert peers(s, rules=no_flag) == first


def test_a_sibling_without_a_target_ref_is_one_sibling_by_its_address() -> None:
    a = sl([endpoint("10.0.0.2", target_ref=False)], name="a", ports=[8080])
    b = sl([endpoint("10.0.0.2", target_ref=False)], name="b", ports=[9090])
    assert peers(a, b, rules=SIBLINGS_CONTROL) == ("http://10.0.0.2:9090",)


# -- decoding -----------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_a_wrong_type_is_a_clear_error() -> None:
    raw = endpoint_slice("s", "kvrouter", [endpoint("10.0.0.2", "b")])
    raw["somethingNew"] = {"x": 1}
    assert decode_slice(raw).metadata.name == "s"
    raw["endpoints"] = "not a list"
    with pytest.raises(SliceError, match=r"not an EndpointSlice.*endpoints"):
        decode_slice(raw)
