"""Which `--peer` URLs are siblings to ask once each: spellings of one replica, and this one."""

from __future__ import annotations

import pytest

from peer.spellings import Listener, sort_out, spelling

ON_LOOPBACK = Listener("127.0.0.1", frozenset({8081}), frozenset({"http://127.0.0.1:8081"}))
ROUTABLE = Listener("10.0.0.5", frozenset({8081}), frozenset({"http://10.0.0.5:8081"}))
# The default --host with neither --self-url nor POD_IP: no URL of its own.
WILDCARD = Listener("0.0.0.0", frozenset({8081, 9000}), frozenset(), frozenset({"box", "10.1.2.3"}))


@pytest.mark.parametrize(
    "a,b",
    [
        ("http://10.0.0.2:8080", "HTTP://10.0.0.2:8080/"),
        ("http://router-b:8080", "http://Router-B:8080"),
        ("http://router-b", "http://router-b:80"),
        ("https://router-b", "https://router-b:443"),
        ("http://[fd00::2]:8080", "http://[FD00:0:0::2]:8080"),
        # An IPv4-mapped address is IPv4 traffic to its IPv4 address, however it is written.
        ("http://10.0.0.2:8080", "http://[::ffff:10.0.0.2]:8080"),
        ("http://10.0.0.2:8080", "http://[::FFFF:a00:2]:8080"),
    ],
)
def test_spellings_of_one_socket_are_one_sibling_on_any_listener(a: str, b: str) -> None:
    assert spelling(a, fold_loopback=False) == spelling(b, fold_loopback=False)
    assert len(sort_out([a, b], ROUTABLE).peers) == 1


@pytest.mark.parametrize(
    "a,b",
    [
        ("http://10.0.0.2:8080", "http://10.0.0.2:8080/"),
        ("http://router-b:8080", "http://Router-B:8080"),
        ("http://router-b:80", "http://router-b"),
        ("http://[fd00::2]:8080", "http://[FD00:0:0::2]:8080"),
    ],
)
def test_a_sibling_written_twice_is_one_duplicate_to_warn_about(a: str, b: str) -> None:
    for listed in ([a, b], [b, a]):
        out = sort_out(listed, ROUTABLE)
        assert out.peers == (a,)
        assert out.duplicates == ((b, a),)


def test_loopback_names_on_one_port_are_one_sibling_when_this_replica_listens_on_loopback() -> None:
    listed = ["http://localhost:8080", "http://127.0.0.1:8080", "http://[::1]:8080"]
    out = sort_out(listed, ON_LOOPBACK)
    # IPv6 loopback stays apart: a replica on 127.0.0.1 and another on [::1] hold one port.
    assert out.peers == ("http://127.0.0.1:8080", "http://[::1]:8080")
    assert out.duplicates == (("http://localhost:8080", "http://127.0.0.1:8080"),)


def test_a_link_local_address_keeps_its_zone_and_two_interfaces_stay_two_siblings() -> None:
    listed = ["http://[fe80::1%25eth0]:8080", "http://[fe80::1%25eth1]:8080"]
    assert sort_out(listed, ROUTABLE).peers == tuple(listed)
    assert sort_out(["http://[FE80:0::1%25eth0]:8080"], ROUTABLE).peers == (listed[0],)


def test_loopback_names_stay_apart_when_this_replica_listens_on_a_routable_address() -> None:
    listed = ["http://localhost:8080", "http://127.0.0.1:8080"]
    assert sort_out(listed, ROUTABLE).peers == ("http://127.0.0.1:8080", "http://localhost:8080")


def test_other_loopback_addresses_and_ports_are_other_siblings() -> None:
    listed = ["http://127.0.0.1:8080", "http://127.0.0.2:8080", "http://localhost:8082"]
    assert sort_out(listed, ON_LOOPBACK).peers == (
        "http://127.0.0.1:8080",
        "http://127.0.0.2:8080",
        "http://localhost:8082",
    )


def test_the_kept_spelling_does_not_depend_on_the_lists_order() -> None:
    listed = ["http://localhost:8080/", "http://127.0.0.1:8080"]
    assert sort_out(listed, ON_LOOPBACK) == sort_out(list(reversed(listed)), ON_LOOPBACK)


def test_this_replica_is_left_out_under_any_spelling_of_its_own_url() -> None:
    listed = ["http://localhost:8081/", "http://LOCALHOST:8081", "http://127.0.0.1:8080"]
    out = sort_out(listed, ON_LOOPBACK)
    assert out.peers == ("http://127.0.0.1:8080",)
    assert out.duplicates == () and out.guessed_self == ()
    # Its port on IPv6 loopback is another listener's: it listens on 127.0.0.1 alone.
    assert sort_out(["http://[::1]:8081"], ON_LOOPBACK).peers == ("http://[::1]:8081",)


def test_on_the_wildcard_without_a_url_this_machine_on_its_ports_is_taken_for_itself() -> None:
    listed = [
        "http://127.0.0.1:8081",  # loopback, our port
        "http://127.0.0.9:8081",  # the wildcard listens on all of 127/8
        "http://box:9000",  # our host name, our control port
        "http://10.1.2.3:8081",  # what our host name resolves to
        "http://10.1.2.3:8082",  # this machine, another port: a sibling
        "http://10.1.2.4:8081",  # another machine
    ]
    out = sort_out(listed, WILDCARD)
    assert out.peers == ("http://10.1.2.3:8082", "http://10.1.2.4:8081")
    assert set(out.guessed_self) == {
        "http://127.0.0.1:8081",
        "http://127.0.0.9:8081",
        "http://box:9000",
        "http://10.1.2.3:8081",
    }


def test_a_replica_that_knows_its_url_guesses_nothing() -> None:
    known = Listener("0.0.0.0", frozenset({8081}), frozenset({"http://10.1.2.3:8081"}))
    out = sort_out(["http://box:8081", "http://10.1.2.3:8081"], known)
    assert out.peers == ("http://box:8081",)  # its URL says who it is; no guess is made
    assert out.guessed_self == ()
