"""Where a worker's ranks are subscribed (`router.workers.parse_server_info`) and which
endpoints are refused before anything subscribes (`endpoint_problem`): the table."""

from __future__ import annotations

from typing import Any

import pytest

from router.workers import DiscoveryDefaults, endpoint_problem, engines_dp_size, parse_server_info

WORKER = "http://10.0.0.7:8000"


def kv_events(**fields: Any) -> dict[str, Any]:
    return {"kv_events": {"endpoint_port_base": 5557, "block_size": 16, "dp_size": 1, **fields}}


@pytest.mark.parametrize(
    "endpoint_host,subscribed_at",
    [
        ("*", "10.0.0.7"),  # SGLang's `tcp://*:5557`: the worker's own host
        ("", "10.0.0.7"),
        ("0.0.0.0", "10.0.0.7"),
        ("::", "10.0.0.7"),
        ("[::]", "10.0.0.7"),
        ("::ffff:0.0.0.0", "10.0.0.7"),  # the IPv4 wildcard, mapped
        ("10.0.0.7", "10.0.0.7"),
        ("::ffff:10.0.0.7", "10.0.0.7"),  # its own host, however it is spelt
        ("[::FFFF:a00:7]", "10.0.0.7"),
        ("[FD00:0::7]", "fd00::7"),
        ("Worker-7.Pods.Local", "worker-7.pods.local"),
    ],
)
def test_the_endpoint_host_is_spelt_as_a_worker_hosts_and_a_wildcard_is_the_workers_own(
    endpoint_host: str, subscribed_at: str
) -> None:
    info = parse_server_info(kv_events(endpoint_host=endpoint_host), WORKER, DiscoveryDefaults())
    assert info.host == subscribed_at
    assert endpoint_problem(info) is None


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"endpoint_port_base": 70000}, "ports 70000..70000, not all in 1..65535"),
        ({"endpoint_port_base": -5}, "ports -5..-5"),
        ({"endpoint_port_base": 0}, "ports 0..0"),
        ({"endpoint_port_base": 65535, "dp_size": 3}, "ports 65535..65537"),
        ({"endpoint_port_base": 70000, "dp_size": 1024}, "ports 70000..71023"),
        ({"replay_endpoint_port_base": 70000}, "replay endpoint port base 70000"),
        ({"replay_endpoint_port_base": -1}, "replay endpoint port base -1"),
        ({"replay_endpoint_port_base": 65535, "dp_size": 2}, "ports 65535..65536"),
        ({"endpoint_host": "127.1"}, "write it as 127.0.0.1"),  # the resolver's spelling
        ({"endpoint_host": "evil host"}, "is not a host name"),
        ({"endpoint_host": "①②⑦.0.0.1"}, "IDNA"),
        ({"endpoint_host": 2130706433}, "IPv4 address"),
        # Reached only through a named interface, which the worker's zone names on its own
        # machine (or not at all): the subscribers' connects failed, retried for good.
        ({"endpoint_host": "fe80::1%eth0"}, "host fe80::1 (zone eth0) is reached only through"),
        ({"endpoint_host": "[FE80::1%25eth0]"}, "host fe80::1 (zone eth0)"),
        ({"endpoint_host": "fe80::1"}, "host fe80::1 is reached only through a named network"),
        ({"endpoint_host": "fd00::7%eth0"}, "host fd00::7 (zone eth0)"),
    ],
)
def test_an_endpoint_no_rank_can_be_subscribed_at_is_a_problem_naming_it(
    fields: dict[str, Any], words: str
) -> None:
    info = parse_server_info(kv_events(**fields), WORKER, DiscoveryDefaults())
    problem = endpoint_problem(info)
    assert problem is not None and words in problem, problem


def test_every_ranks_port_is_in_range_up_to_the_last() -> None:
    info = parse_server_info(
        kv_events(endpoint_port_base=64512, dp_size=1024, replay_endpoint_port_base=63488),
        WORKER,
        DiscoveryDefaults(),
    )
    assert endpoint_problem(info) is None


def test_no_replay_base_or_zero_is_no_replay() -> None:
    for fields in ({}, {"replay_endpoint_port_base": 0}, {"replay_endpoint_port_base": None}):
        info = parse_server_info(kv_events(**fields), WORKER, DiscoveryDefaults())
        assert info.replay_port_base is None and endpoint_problem(info) is None


def test_the_flags_ports_are_checked_against_a_server_info_dp_size() -> None:
    """The flags are checked with --dp-size at startup; a /server_info without a port base
    but with its own dp size puts the flags' base under that many ranks."""
    body = {"kv_events": {"endpoint_host": "*", "dp_size": 8}}
    info = parse_server_info(body, WORKER, DiscoveryDefaults(port_base=65530))
    problem = endpoint_problem(info)
    assert problem is not None and "ports 65530..65537" in problem, problem


@pytest.mark.parametrize(
    ("ranks", "dp_size"),
    [
        ([0], 1),
        ([1, 0, 2], 3),
        ([], None),  # no load gauge: --dp-size
        ([1], None),  # one engine core of another's ranks (an external load balancer)
        ([0, 2], None),
    ],
)
def test_a_workers_dp_size_is_the_ranks_its_metrics_label_when_they_are_0_to_n(
    ranks: list[int], dp_size: int | None
) -> None:
    assert engines_dp_size(ranks) == dp_size
