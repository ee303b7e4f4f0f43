"""The door's rules: which first bytes are a probe it answers itself, and what it answers."""

from __future__ import annotations

import pytest

from router.dataplane.door import (
    LOOP_STALL_S,
    WAIT,
    ProbeRequest,
    Published,
    published_answer,
    read_probe,
)

PATHS = {b"/healthz": None, b"/readyz": None}


def probe(data: bytes) -> ProbeRequest | str | None:
    return read_probe(data, PATHS, max_fields=10, max_head_bytes=1024)


@pytest.mark.parametrize(
    ("data", "seen"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: k\r\n\r\n", ProbeRequest(b"/healthz", False, True, True)),
        (
            b"GET /readyz?verbose=1 HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n",
            ProbeRequest(b"/readyz", False, True, False),
        ),
        (b"HEAD /readyz HTTP/1.0\r\n\r\n", ProbeRequest(b"/readyz", True, False, False)),
        (
            b"GET /healthz HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n",
            ProbeRequest(b"/healthz", False, False, True),
        ),
        (
            b"GET /healthz HTTP/1.1\r\nHost: 10.0.0.7:8080\r\nUser-Agent: kube-probe/1.30\r\n\r\n",
            ProbeRequest(b"/healthz", False, True, True),
        ),
    ],
)
def test_plain_probes_are_the_doors(data: bytes, seen: ProbeRequest) -> None:
    assert probe(data) == seen


@pytest.mark.parametrize(
    "data",
    [
        b"G",
        b"GET",
        b"GET ",
        b"HEAD /re",
        b"GET /healthz",
        b"GET /healthz?x=",
        b"GET /healthz HTTP/1.",
        b"GET /healthz HTTP/1.1\r\nHost: k\r\n",
    ],
)
def test_the_beginning_of_a_probe_is_waited_for(data: bytes) -> None:
    assert probe(data) == WAIT


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"POST /v1/completions HTTP/1.1\r\n", "a generation request"),
        (b"POS", "cannot become GET or HEAD"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", "another path"),
        (b"GET /healthzz HTTP/1.1\r\n\r\n", "a longer path"),
        (b"GET /workers", "cannot become a probe path"),
        (b"POST /healthz HTTP/1.1\r\n\r\n", "another method"),
        (b"GET /healthz HTTP/2.0\r\n\r\n", "another version"),
        (b"GET /healthz HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", "a body"),
        (b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", "a chunked body"),
        (b"GET /healthz HTTP/1.1\r\nUpgrade: h2c\r\n\r\n", "a protocol change"),
        (b"GET /healthz HTTP/1.1\r\nExpect: 100-continue\r\n\r\n", "an expectation"),
        (b"GET /healthz HTTP/1.1\r\nno colon\r\n\r\n", "a malformed field"),
        (b"GET /healthz HTTP/1.1\r\n\r\nGET /readyz HTTP/1.1\r\n\r\n", "pipelined behind it"),
        (b"GET /healthz HTTP/1.1\r\n" + b"X: 1\r\n" * 11 + b"\r\n", "over the field count"),
        (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 1100 + b"\r\n\r\n", "over the head size"),
        (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 1100, "an unfinished head past the size"),
        (b"GET  /healthz HTTP/1.1\r\n\r\n", "two spaces"),
        (b"GET /healthz HTTP/1.1\r\nUser-Agent: x\r\n\r\n", "HTTP/1.1 without Host: a 400"),
        (b"GET /healthz HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", "two Hosts: a 400"),
        (b"\x16\x03\x01\x02\x00", "TLS"),
    ],
)
def test_anything_else_goes_to_the_loop_untouched(data: bytes, why: str) -> None:
    assert probe(data) is None, why


@pytest.mark.parametrize(
    ("field", "why"),
    [
        (b"Content-Length : 5", "whitespace before the colon"),
        (b"X-A\t: b", "a tab before the colon"),
        (b"X-A: a\r\n Transfer-Encoding: chunked", "an obs-fold line"),
        (b" Content-Length: 5", "whitespace at a line's start"),
        (b"X-A: a\nContent-Length: 5", "a bare LF"),
        (b"X-A: a\rContent-Length: 5", "a bare CR"),
        (b"X-A: a\x01b", "a control byte in a value"),
        (b"X-A: a\x7fb", "DEL in a value"),
        (b"X(A): b", "a separator in a name"),
        (b": b", "no name"),
    ],
)
def test_a_head_the_loops_parser_refuses_goes_to_the_loop(field: bytes, why: str) -> None:
    """llhttp refuses each of these heads (a 400 and a close); the door answered them, and
    the bytes after them were parsed as the next request."""
    assert probe(b"GET /healthz HTTP/1.1\r\nHost: r\r\n" + field + b"\r\n\r\n") is None, why


@pytest.mark.parametrize("target", [b"/healthz?a\x01b", b"/healthz?a\xe9", b"/healthz?\x7f"])
def test_a_target_the_loops_parser_refuses_goes_to_the_loop(target: bytes) -> None:
    assert probe(b"GET " + target + b" HTTP/1.1\r\nHost: r\r\n\r\n") is None


def test_a_value_of_visible_bytes_tabs_and_obs_text_is_still_a_probe() -> None:
    seen = probe(b"GET /healthz HTTP/1.1\r\nHost: r\r\nX-A:\tv a\xe9 \t\r\n\r\n")
    assert seen == ProbeRequest(b"/healthz", False, True, True)


def test_the_heartbeats_answer_holds_until_the_loop_stalls() -> None:
    published = Published(100.0, {b"/readyz": (503, {"ready": False, "reason": "draining"})})
    assert published_answer(published, b"/readyz", 100.0 + LOOP_STALL_S) == (
        503,
        {"ready": False, "reason": "draining"},
    )
    live = Published(100.0, {b"/healthz": (200, {"status": "ok"})})
    assert published_answer(live, b"/healthz", 101.0) == (200, {"status": "ok"})
    status, body = published_answer(live, b"/healthz", 100.0 + LOOP_STALL_S + 0.5)
    assert status == 503 and body["reason"] == "the event loop has not run for 2.5s"
