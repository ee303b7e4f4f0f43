"""Worker URLs are origins (`peer.origin`): the table of what is accepted and how it is spelt."""

from __future__ import annotations

import ipaddress
import re

import pytest

from peer.origin import AllowList, canonical_origin, origin_problem, worker_origin_problem


@pytest.mark.parametrize(
    "url,canonical",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("https://Worker-0.EXAMPLE:8443", "https://worker-0.example:8443"),
        ("HTTP://w:1", "http://w:1"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://w", "http://w"),
        # The scheme's default port is one socket written or not: left out, as a URL parser
        # serializes an origin (`http://w:80` beside `http://w` was a second worker).
        ("http://w:80", "http://w"),
        ("HTTP://W:80/", "http://w"),
        ("https://w:443", "https://w"),
        ("https://Worker-0.EXAMPLE:443/", "https://worker-0.example"),
        ("http://[::1]:80", "http://[::1]"),
        ("http://w:443", "http://w:443"),  # another scheme's default is a port like any other
        ("https://w:80", "https://w:80"),
        # localhost is 127.0.0.1 (`peer.origin`): one engine, one worker. The rest of
        # 127/8 and IPv6 loopback are other addresses.
        ("http://localhost:8000", "http://127.0.0.1:8000"),
        ("http://LocalHost:80/", "http://127.0.0.1"),
        ("http://127.0.0.2:8000", "http://127.0.0.2:8000"),
        ("http://localhost.example:8000", "http://localhost.example:8000"),
        ("http://xn--e1afmkfd.example:8000", "http://xn--e1afmkfd.example:8000"),
        ("http://w-0.svc.cluster.local.:8000", "http://w-0.svc.cluster.local.:8000"),
        # One engine, one key: an IPv6 literal compressed, an IPv4-mapped one as its IPv4
        # address (each spelling was a worker of its own, subscribed to the same stream).
        ("http://[0:0::1]:8000", "http://[::1]:8000"),
        ("http://[FD00:0::2]:8000", "http://[fd00::2]:8000"),
        ("http://[::ffff:127.0.0.1]:8000", "http://127.0.0.1:8000"),
        ("http://[::FFFF:7f00:1]:8000", "http://127.0.0.1:8000"),
        ("http://[0:0:0:0:0:ffff:a00:1]:8000", "http://10.0.0.1:8000"),
        ("http://1.2.3.4a:8000", "http://1.2.3.4a:8000"),  # a name: its last label is no number
        ("http://" + "a" * 63 + ".example:1", "http://" + "a" * 63 + ".example:1"),
    ],
)
def test_an_origin_is_accepted_and_spelt_one_way(url: str, canonical: str) -> None:
    assert origin_problem(url) is None
    assert canonical_origin(url) == canonical


@pytest.mark.parametrize(
    "url,word",
    [
        ("http://127.0.0.1:29999/latest/meta-data/iam#", "path"),  # the SSRF
        ("http://w:1/v1", "path"),
        ("http://w:1//", "path"),
        ("http://w:1?x=1", "query"),
        ("http://w:1/?", "query"),
        ("http://w:1?", "query"),
        ("http://w:1#", "fragment"),
        ("http://w:1/#x", "fragment"),
        ("http://user:pass@w:1", "credentials"),
        ("http://user@w:1", "credentials"),
        ("ftp://w:1", "scheme"),
        ("w:1", "scheme"),
        ("http://", "no host"),
        ("http://w:99999", "out of range"),
        ("http://w:1\r\nX: y", "control"),
        ("http://w :1", "whitespace"),
        ("http://w:1\\@evil", "backslash"),
        ("http://①②⑦.0.0.1:8000", "IDNA (xn--) form"),  # NFKC-folds to 127.0.0.1
        ("http://пример.invalid:8000", "IDNA (xn--) form"),
        ("http://" + "a" * 64 + ".example:8000", "1 to 63"),  # getaddrinfo's UnicodeError
        ("http://a..b:8000", "1 to 63"),
        ("http://" + "a." * 127 + "a:8000", "at most 253"),
        ("http://w*x:8000", "not a host name"),
        ("http://127.0.0.1:0", "port 0"),
        # IPv4 spellings but the dotted quad: aiohttp refuses most (tests/component/
        # test_origin_clients.py), so each names the quad to write instead.
        ("http://127.1:8000", "write it as 127.0.0.1"),
        ("http://2130706433:8000", "write it as 127.0.0.1"),
        ("http://127.000.000.001:8000", "leading zeros: write it as 127.0.0.1"),
        ("http://0x7f.1:8000", "write it as 127.0.0.1"),
        (
            "http://010.0.0.1:8000",
            "as octal (8.0.0.1, how the C resolver reads it) or as decimal (10.0.0.1",
        ),
        ("http://10.0.0.1.:8000", "with a trailing dot: write it as 10.0.0.1"),
        ("http://256.1.1.1:8000", "is not one"),
        ("http://example.123:8000", "is not one"),
    ],
)
def test_anything_but_an_origin_is_refused_with_the_reason(url: str, word: str) -> None:
    problem = origin_problem(url)
    assert problem is not None and word in problem, problem


@pytest.mark.parametrize(
    "url",
    [
        "http://0.0.0.0:8000",
        "http://[::]:8000",
        "http://[0:0::0]:8000",
        "http://[::ffff:0.0.0.0]:8000",
    ],
)
def test_a_worker_on_the_unspecified_address_is_refused_naming_it(url: str) -> None:
    """An engine listens there; nobody connects there: the replica reached its own machine,
    one engine as many workers as spellings (and a sibling would read its own machine)."""
    assert origin_problem(url) is None  # a sibling's or a kube API's URL may still be one
    problem = worker_origin_problem(url)
    assert problem is not None and "unspecified address" in problem, problem
    assert "127.0.0.1 for this machine" in problem


def test_a_worker_origin_is_first_an_origin() -> None:
    assert worker_origin_problem("http://127.0.0.1:8000") is None
    assert worker_origin_problem("http://w:1/v1") == origin_problem("http://w:1/v1")


@pytest.mark.parametrize(
    "cidrs,host,addresses,allowed",
    [
        ([], "anything", ["169.254.169.254"], True),  # no list: no restriction
        (["10.0.0.0/8"], "w", ["10.1.2.3"], True),
        (["10.0.0.0/8"], "w", ["10.1.2.3", "127.0.0.1"], False),  # every address must be in
        (["10.0.0.0/8"], "169.254.169.254", ["169.254.169.254"], False),
        (["10.0.0.0/8", "fd00::/8"], "w", ["fd00::1"], True),
        (["10.0.0.0/8"], "w", ["::ffff:10.0.0.1"], True),  # v4-mapped is its v4 address
        (["10.0.0.0/8"], "w", ["::ffff:127.0.0.1"], False),
        (["127.0.0.1/32"], "::ffff:127.0.0.2", ["::ffff:127.0.0.2"], False),  # no way round
        (["127.0.0.1/32"], "::ffff:7f00:1", ["::ffff:127.0.0.1"], True),
        (["10.0.0.0/8"], "w", [], False),
        (["fe80::/10"], "w", ["fe80::1%eth0"], True),  # a scope id is not part of the address
        # An IPv4-mapped entry is the IPv4 network it maps, as a mapped address is its IPv4
        # one (kept in IPv6 it matched nothing: every address is checked as IPv4).
        (["::ffff:10.0.0.0/104"], "w", ["10.1.2.3"], True),
        (["::ffff:10.0.0.0/104"], "w", ["::ffff:10.1.2.3"], True),
        (["::FFFF:a00:0/104"], "w", ["10.1.2.3"], True),
        (["::ffff:10.0.0.0/104"], "w", ["11.0.0.1"], False),
        (["::ffff:127.0.0.1/128"], "::ffff:7f00:2", ["::ffff:127.0.0.2"], False),
    ],
)
def test_the_allow_list(cidrs: list[str], host: str, addresses: list[str], allowed: bool) -> None:
    refusal = AllowList.parse(cidrs).refusal(host, addresses)
    assert (refusal is None) is allowed, refusal


def test_an_allow_list_entry_that_is_not_a_network_is_named() -> None:
    with pytest.raises(ValueError, match=re.escape("'10.0.0.0/33'")):
        AllowList.parse(["10.0.0.0/8", "10.0.0.0/33"])


@pytest.mark.parametrize(
    "cidr,network",
    [
        ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
        ("::ffff:10.1.2.3/104", "10.0.0.0/8"),  # host bits dropped, as for any entry
        ("::ffff:127.0.0.1/128", "127.0.0.1/32"),
        ("::ffff:0:0/96", "0.0.0.0/0"),  # every IPv4-mapped address: every IPv4 one
        ("fd00::/8", "fd00::/8"),
        ("::/0", "::/0"),  # wider than the mapped block: IPv6 as written
    ],
)
def test_an_allow_list_entry_inside_the_ipv4_mapped_block_is_its_ipv4_network(
    cidr: str, network: str
) -> None:
    assert AllowList.parse([cidr]).networks == (ipaddress.ip_network(network),)
