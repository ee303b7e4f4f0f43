"""The relay's HTTP exchange rules as tables: framing, headers, admission, failures, cuts."""

from __future__ import annotations

import json

import httptools
import pytest

from router.dataplane.exchange import (
    FAILURES,
    MAX_HELD_EVENT_BYTES,
    STALE_WINDOW_S,
    BadAnswer,
    Framing,
    Malformed,
    RequestHead,
    ResponseHead,
    UnknownCoding,
    WholeEvents,
    admit,
    chunk,
    classify_lost,
    close_came_by,
    cut_tail,
    events_end,
    head_without_upgrade,
    lower_names,
    not_allowed,
    plan_response,
    read_request_head,
    read_response_head,
    refusal_response,
    route_of,
    uninvited,
    upstream_framing,
    upstream_request,
)
from tests.support.sse import sse_events


def head(
    method: bytes = b"POST",
    target: bytes = b"/v1/completions",
    *headers: tuple[bytes, bytes],
    http_11: bool = True,
    keep: bool = True,
) -> RequestHead:
    """A parsed head; with a Host field unless `headers` name one (RFC 9112 3.2)."""
    fields = list(headers)
    if not any(name.lower() == b"host" for name, _ in fields):
        fields.append((b"Host", b"router:8080"))
    return read_request_head(method, target, http_11, fields, keep)


def fields(raw: bytes) -> dict[bytes, bytes]:
    lines = raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    return {n.lower(): v for n, v in (line.split(b": ", 1) for line in lines)}


class _HeadReader:
    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))


def parsed_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """A response head's fields as llhttp reads them (which also checks it is well-formed)."""
    reader = _HeadReader()
    httptools.HttpResponseParser(reader).feed_data(head)
    return reader.fields


def answer(*lines: bytes, status: bytes = b"200 OK", method: bytes = b"POST") -> ResponseHead:
    """A worker's answer head made of field `lines`, read as the relay reads it."""
    raw = b"HTTP/1.1 " + status + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n"
    parsed_fields(raw)  # llhttp accepts it
    return read_response_head(int(status.split(b" ")[0]), raw, method)


# -- requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status", "problem"),
    [
        ([(b"Content-Length", b"x1")], 400, "not a number"),
        ([(b"Content-Length", b"3"), (b"Content-Length", b"4")], 400, "conflicting"),
        ([(b"Transfer-Encoding", b"gzip")], 400, "must end with chunked"),
        ([(b"Content-Length", b"3"), (b"Transfer-Encoding", b"chunked")], 400, "both"),
        ([(b"Transfer-Encoding", b"chunked, chunked")], 400, "more than once"),
        ([(b"Transfer-Encoding", b"chunked")] * 2, 400, "more than once"),
        # A coding the relay does not decode: 501 (RFC 9112 6.1), never its bytes passed on
        # to a worker as if they were the plain body.
        ([(b"Transfer-Encoding", b"gzip, chunked")], 501, "'gzip' is not supported"),
        ([(b"Transfer-Encoding", b"Deflate ,chunked")], 501, "'deflate' is not supported"),
    ],
)
def test_request_heads_whose_body_framing_the_relay_refuses(
    headers: list[tuple[bytes, bytes]], status: int, problem: str
) -> None:
    with pytest.raises(Malformed, match=problem) as refused:
        head(b"POST", b"/v1/completions", *headers)
    assert refused.value.status == status


def test_a_refused_transfer_coding_comes_with_the_head_for_its_route_and_400s_go_first() -> None:
    """The 501 is the client's doing on a head that parsed: counted under its route (it was
    `other`, beside the 413 and 400 of the same path), never in the router's own errors."""
    with pytest.raises(UnknownCoding) as refused:
        head(b"POST", b"/v1/completions?x=1", (b"Transfer-Encoding", b"gzip, chunked"))
    assert refused.value.head is not None and refused.value.head.path == b"/v1/completions"
    with pytest.raises(Malformed) as malformed:  # a malformed head is a 400, its head unread
        head(
            b"POST",
            b"/v1/completions",
            (b"Transfer-Encoding", b"gzip, chunked"),
            (b"Host", b"a"),
            (b"Host", b"b"),
        )
    assert (malformed.value.status, malformed.value.head) == (400, None)


def test_a_request_head_reads_its_framing_and_expectation() -> None:
    h = head(
        b"POST",
        b"/generate?x=1",
        (b"content-length", b"12"),
        (b"Content-Length", b"12"),  # repeated, equal: allowed
        (b"EXPECT", b"100-Continue"),
    )
    assert (h.content_length, h.chunked, h.expect, h.path) == (
        12,
        False,
        b"100-continue",
        b"/generate",
    )
    assert head(b"POST", b"/", (b"Transfer-Encoding", b" Chunked")).chunked


@pytest.mark.parametrize(
    ("hosts", "http_11", "refused"),
    [
        (0, True, True),  # RFC 9112 3.2: an HTTP/1.1 request without Host is a 400
        (2, True, True),  # and so is one with more than one
        (2, False, True),
        (1, True, False),
        (0, False, False),  # HTTP/1.0 predates Host
    ],
)
def test_a_request_needs_one_host_field_in_http_11_and_at_most_one_before(
    hosts: int, http_11: bool, refused: bool
) -> None:
    fields = [(b"Host", b"h%d" % i) for i in range(hosts)]
    if refused:
        with pytest.raises(Malformed, match="Host field"):
            read_request_head(b"POST", b"/v1/completions", http_11, fields, True)
    else:
        assert read_request_head(b"POST", b"/v1/completions", http_11, fields, True).path


def test_an_http_10_request_ignores_expect_and_closes_after_a_chunked_body() -> None:
    """RFC 9110 10.1.1: a 100-continue expectation in HTTP/1.0 is ignored (no 1xx may reach
    an HTTP/1.0 client); RFC 9112 6.1: HTTP/1.0 with Transfer-Encoding closes after it."""
    old = head(b"POST", b"/v1/completions", (b"Expect", b"100-continue"), http_11=False)
    assert old.expect is None
    assert admit(old, 10) is None  # nor an unknown one refused with a 417
    assert head(b"POST", b"/", (b"Expect", b"bogus"), http_11=False).expect is None
    chunked = head(b"POST", b"/", (b"Transfer-Encoding", b"chunked"), http_11=False)
    assert not chunked.keep_alive
    assert head(b"POST", b"/", (b"Transfer-Encoding", b"chunked")).keep_alive  # HTTP/1.1


@pytest.mark.parametrize(
    ("target", "origin"),
    [
        (b"http://router:8080/v1/completions", b"/v1/completions"),
        (b"HTTP://router/v1/chat/completions?stream=1", b"/v1/chat/completions?stream=1"),
        (b"https://router", b"/"),
        (b"http://router?x=1", b"/?x=1"),
    ],
)
def test_an_absolute_form_target_is_served_as_its_origin_form(target: bytes, origin: bytes) -> None:
    """RFC 9112 3.2.2: a server MUST accept the absolute form; the path decides the route
    and the worker gets the origin form."""
    h = head(b"POST", target)
    assert h.target == origin
    assert h.path == origin.split(b"?")[0]


@pytest.mark.parametrize("target", [b"*", b"ftp://router/v1/completions", b"router/x", b"http://"])
def test_a_target_neither_a_path_nor_an_http_url_is_refused(target: bytes) -> None:
    with pytest.raises(Malformed) as refused:
        head(b"OPTIONS", target)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "target",
    [b"/v1/completions#frag", b"/v1/completions?x=1#y", b"/workers#", b"http://r/v1/completions#x"],
)
def test_a_target_with_a_fragment_is_refused(target: bytes) -> None:
    # RFC 9112 3.2: no form of a request target has one; the control app would cut it off
    # and route `/v1/completions#frag` as the route the data plane serves.
    with pytest.raises(Malformed, match="fragment") as refused:
        head(b"POST", target)
    assert refused.value.status == 400
    assert head(b"POST", b"/v1/completions%23frag").path == b"/v1/completions%23frag"


@pytest.mark.parametrize("target", [b"worker:443", b"/v1/completions", b"http://r/x"])
def test_connect_is_refused_whatever_its_target(target: bytes) -> None:
    # llhttp stops at every CONNECT head as a protocol switch: no head of it may be served.
    with pytest.raises(Malformed, match="CONNECT is not supported"):
        head(b"CONNECT", target)


def test_a_request_asking_to_switch_protocols_is_written_again_without_its_upgrade() -> None:
    fields = [
        (b"Host", b"r"),
        (b"Connection", b"Upgrade, HTTP2-Settings"),
        (b"UPGRADE", b"h2c"),
        (b"HTTP2-Settings", b"AAMAAABkAAQCAAAAAAIAAAAA"),
        (b"Content-Length", b"2"),
    ]
    again = head_without_upgrade(b"POST", b"/v1/completions", True, fields, invited=False)
    assert again == (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nContent-Length: 2\r\n\r\n"
    )
    parser = httptools.HttpRequestParser(_HeadReader())
    parser.feed_data(again + b"{}")
    assert not parser.should_upgrade()  # llhttp reads it as a plain request now
    assert (
        head_without_upgrade(b"GET", b"/x", False, [], invited=False) == b"GET /x HTTP/1.0\r\n\r\n"
    )


@pytest.mark.parametrize(("invited", "expect_kept"), [(True, False), (False, True)])
def test_a_protocol_switch_head_written_again_asks_for_a_100_continue_only_if_still_owed(
    invited: bool, expect_kept: bool
) -> None:
    fields = [(b"Host", b"r"), (b"Upgrade", b"h2c"), (b"EXPECT", b"100-continue")]
    again = head_without_upgrade(b"POST", b"/v1/completions", True, fields, invited=invited)
    assert (b"EXPECT: 100-continue\r\n" in again) is expect_kept
    assert again.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")


@pytest.mark.parametrize(
    ("method", "target", "route"),
    [
        (b"POST", b"/v1/completions", "generation"),
        (b"POST", b"/v1/chat/completions?stream=1", "generation"),
        (b"POST", b"/generate", "generation"),
        (b"GET", b"/v1/completions", "not_allowed"),
        (b"HEAD", b"/generate", "not_allowed"),
        (b"GET", b"/healthz", "control"),
        (b"POST", b"/workers", "control"),
        (b"GET", b"/v1/models", "control"),
        (b"POST", b"/v1/completions/", "control"),  # not the route: the control app's 404
    ],
)
def test_who_answers_a_request(method: bytes, target: bytes, route: str) -> None:
    assert route_of(head(method, target)) == route


@pytest.mark.parametrize(
    ("headers", "status", "close"),
    [
        ([], None, None),
        ([(b"Content-Length", b"100")], None, None),
        ([(b"Content-Length", b"101")], 413, True),
        ([(b"Expect", b"100-continue"), (b"Content-Length", b"10")], None, None),
        ([(b"Expect", b"something-else")], 417, True),
    ],
)
def test_admission_at_the_end_of_the_head(
    headers: list[tuple[bytes, bytes]], status: int | None, close: bool | None
) -> None:
    refusal = admit(head(b"POST", b"/v1/completions", *headers), max_body_bytes=100)
    assert (refusal.status, refusal.close) == (status, close) if refusal else status is None


_BEARER = (b"Authorization", b"Bearer s3cret")


@pytest.mark.parametrize(
    ("token", "target", "headers", "status"),
    [
        ("s3cret", b"/workers", [], 401),
        ("s3cret", b"/workers", [(b"Authorization", b"Bearer wrong")], 401),
        ("s3cret", b"/workers", [(b"Authorization", b"bearer s3cret")], None),  # any case
        ("s3cret", b"/workers", [_BEARER, _BEARER], 401),  # two: refused, as the control app
        ("s3cret", b"/internal/kv_snapshot?cursors_only=true", [], 401),
        ("s3cret", b"/%77orkers", [], 401),  # matched percent-decoded, as the control app does
        ("s3cret", b"/workers%23x", [], None),  # an escaped `#` is the path's: /workers#x
        ("s3cret", b"/workers", [_BEARER], None),
        (None, b"/workers", [_BEARER], 403),  # no token configured: the route is off
        (None, b"/v1/completions", [], None),  # open routes are not its concern
        (None, b"/v1/models", [], None),
    ],
)
def test_a_guarded_route_without_its_token_is_refused_before_the_body_is_invited(
    token: str | None, target: bytes, headers: list[tuple[bytes, bytes]], status: int | None
) -> None:
    h = head(b"POST", target, (b"Expect", b"100-continue"), *headers)
    refusal = uninvited(h, token)
    assert (refusal.status, refusal.close) == (status, True) if refusal else status is None
    if refusal is not None and status == 401:
        assert refusal.extra == ((b"WWW-Authenticate", b'Bearer realm="kvrouter"'),)


def test_the_upstream_request_drops_hop_by_hop_and_relay_owned_fields() -> None:
    h = head(
        b"POST",
        b"/v1/completions?a=b",
        (b"Host", b"router:8080"),
        (b"Connection", b"keep-alive, X-Named"),
        (b"X-Named", b"1"),
        (b"Keep-Alive", b"300"),
        (b"TE", b"trailers"),
        (b"Upgrade", b"h2c"),
        (b"Proxy-Authorization", b"Basic x"),
        (b"Accept-Encoding", b"gzip"),
        (b"X-Data-Parallel-Rank", b"3"),
        (b"Origin", b"https://app.example"),  # whose page may read the answer: the router's say
        (b"Content-Length", b"2"),
        (b"Expect", b"100-continue"),
        (b"Authorization", b"Bearer k"),
        (b"X-Request-Id", b"r1"),
    )
    raw = upstream_request(h, 2, b"worker:8000", [(b"X-Data-Parallel-Rank", b"1")])
    assert raw.startswith(b"POST /v1/completions?a=b HTTP/1.1\r\n")
    assert raw.endswith(b"\r\n\r\n")
    assert fields(raw) == {
        b"host": b"worker:8000",
        b"authorization": b"Bearer k",
        b"x-request-id": b"r1",
        b"x-data-parallel-rank": b"1",
        b"content-length": b"2",
    }
    # To the control app the client's Accept-Encoding (gzip snapshots) and rank header stay.
    control = fields(upstream_request(h, 2, b"router:8080", to_worker=False))
    assert control[b"accept-encoding"] == b"gzip" and control[b"x-data-parallel-rank"] == b"3"
    assert control[b"origin"] == b"https://app.example"
    assert b"x-named" not in control and b"connection" not in control


# -- answers -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [b"600 Odd", b"999 Odd", b"099 Odd", b"000 Odd"])
def test_a_worker_status_outside_100_to_599_is_a_bad_answer_never_relayed(status: bytes) -> None:
    # llhttp reads any three digits; a client library may fail on a status it cannot class.
    with pytest.raises(BadAnswer, match="not an HTTP status"):
        answer(b"Content-Length: 0", status=status)
    assert answer(b"Content-Length: 0", status=b"599 Edge").status == 599
    assert answer(b"Content-Length: 0", status=b"100 Edge").status == 100


@pytest.mark.parametrize(
    "codings",
    [b"gzip, chunked", b"gzip", b"chunked, chunked", b"x-custom,chunked"],
)
def test_a_worker_answer_in_a_transfer_coding_never_offered_is_a_bad_answer(
    codings: bytes,
) -> None:
    # No TE goes to a worker, so chunked is the only coding it may use; anything else would
    # reach the client under a plain chunked label (gzip bytes read as the JSON answer).
    headers = [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", codings)]
    with pytest.raises(BadAnswer, match="never accepts"):
        upstream_framing(200, headers, b"POST", lower_names(headers))
    with pytest.raises(BadAnswer):
        answer(b"Content-Type: application/json", b"Transfer-Encoding: " + codings)
    twice = [(b"Transfer-Encoding", b"chunked")] * 2
    with pytest.raises(BadAnswer):
        upstream_framing(200, twice, b"POST", lower_names(twice))


@pytest.mark.parametrize(
    ("status", "headers", "method", "framing", "length"),
    [
        (200, [(b"Content-Length", b"5")], b"POST", Framing.LENGTH, 5),
        (200, [(b"Transfer-Encoding", b"chunked")], b"POST", Framing.CHUNKED, None),
        # Chunked wins over a Content-Length (RFC 9112 6.3 item 3).
        (
            200,
            [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")],
            b"POST",
            Framing.CHUNKED,
            None,
        ),
        (200, [], b"POST", Framing.CLOSE, None),
        (200, [(b"Content-Length", b"5")], b"HEAD", Framing.NONE, None),
        (204, [], b"POST", Framing.NONE, None),
        (304, [(b"Content-Length", b"5")], b"GET", Framing.NONE, None),
        (103, [], b"POST", Framing.NONE, None),
    ],
)
def test_how_an_upstream_answer_ends(
    status: int,
    headers: list[tuple[bytes, bytes]],
    method: bytes,
    framing: Framing,
    length: int | None,
) -> None:
    assert upstream_framing(status, headers, method, lower_names(headers)) == (framing, length)


@pytest.mark.parametrize(
    ("lines", "method", "framing", "length", "relayed"),
    [
        # Nothing to drop but the framing field: the field lines go as the worker wrote them.
        (
            [b"Content-Type: application/json", b"Content-Length: 7", b"X-Odd:v  "],
            b"POST",
            Framing.LENGTH,
            7,
            [b"Content-Type: application/json", b"Content-Length: 7", b"X-Odd:v  "],
        ),
        ([b"Server: s", b"content-length:  12 "], b"POST", Framing.LENGTH, 12, None),
        ([b"X-A: a"], b"POST", Framing.CLOSE, None, [b"X-A: a"]),
        ([], b"POST", Framing.CLOSE, None, []),
        # A chunked answer: the relay frames its own answer, the worker's field goes.
        (
            [b"Content-Type: text/event-stream", b"Transfer-Encoding: chunked", b"X-B: b"],
            b"POST",
            Framing.CHUNKED,
            None,
            [b"Content-Type: text/event-stream", b"X-B: b"],
        ),
        ([b"transfer-encoding:Chunked ", b"X-B: b"], b"POST", Framing.CHUNKED, None, [b"X-B: b"]),
        # A HEAD answer keeps its Content-Length: it describes the GET's body.
        ([b"Content-Length: 7", b"X-A: a"], b"HEAD", Framing.NONE, None, None),
        # Hop-by-hop fields, those the Connection field names, and forged route headers go;
        # the rest stay in order.
        (
            [
                b"X-First: 1",
                b"Connection: keep-alive, X-Hop",
                b"Keep-Alive: timeout=5",
                b"X-Hop: 1",
                b"Content-Length: 2",
                b"x-kvrouter-worker: forged",
                b"X-Last: 2",
            ],
            b"POST",
            Framing.LENGTH,
            2,
            [b"X-First: 1", b"Content-Length: 2", b"X-Last: 2"],
        ),
        (
            [b"Keep-Alive: timeout=5", b"X-Kvrouter-Dp-Rank: 9", b"TE: trailers", b"X-A: a"],
            b"POST",
            Framing.CLOSE,
            None,
            [b"X-A: a"],
        ),
        ([b"Upgrade: h2c", b"Transfer-Encoding: chunked"], b"POST", Framing.CHUNKED, None, []),
    ],
)
def test_what_of_a_workers_head_the_client_gets(
    lines: list[bytes],
    method: bytes,
    framing: Framing,
    length: int | None,
    relayed: list[bytes] | None,
) -> None:
    got = answer(*lines, method=method)
    assert (got.framing, got.length) == (framing, length)
    relayed = lines if relayed is None else relayed
    # Byte for byte, in order: the kept lines are not rebuilt.
    assert got.fields == b"\r\n" + b"".join(line + b"\r\n" for line in relayed)
    assert got.status_line == b"HTTP/1.1 200 OK"


@pytest.mark.parametrize(
    ("status", "line"),
    [
        (b"200 Fine", b"HTTP/1.1 200 OK"),  # a known status gets the standard phrase
        (b"599 Odd One", b"HTTP/1.1 599 Odd One"),
        (b"599", b"HTTP/1.1 599 "),
        (b"299 Tab\tand obs-text \xe9", b"HTTP/1.1 299 Tab\tand obs-text \xe9"),
        # A control byte (which llhttp lets by) is no reason phrase's: the client gets none.
        (b"299 Whatever\x01Phrase", b"HTTP/1.1 299 "),
        (b"299 Del\x7f", b"HTTP/1.1 299 "),
    ],
)
def test_the_status_line_to_the_client(status: bytes, line: bytes) -> None:
    assert answer(status=status).status_line == line


@pytest.mark.parametrize(
    ("lines", "sse"),
    [
        ([b"Content-Type: text/event-stream; charset=utf-8"], True),
        ([b"Connection: close", b"content-type:text/event-stream"], True),
        ([b"Content-Type: application/json"], False),
        ([b"X-Content-Type: text/event-stream"], False),
        ([], False),
    ],
)
def test_an_sse_answer_is_known_by_its_content_type(lines: list[bytes], sse: bool) -> None:
    assert answer(*lines).sse is sse


@pytest.mark.parametrize(
    ("upstream", "client_11", "keep", "framing", "keep_after", "connection", "te", "cl"),
    [
        (Framing.LENGTH, True, True, Framing.LENGTH, True, None, None, b"7"),
        (Framing.LENGTH, False, True, Framing.LENGTH, True, b"keep-alive", None, b"7"),
        (Framing.LENGTH, True, False, Framing.LENGTH, False, b"close", None, b"7"),
        (Framing.CHUNKED, True, True, Framing.CHUNKED, True, None, b"chunked", None),
        (Framing.CLOSE, True, True, Framing.CHUNKED, True, None, b"chunked", None),
        # HTTP/1.0 cannot read chunks: the body runs to the close.
        (Framing.CHUNKED, False, True, Framing.CLOSE, False, b"close", None, None),
        (Framing.CLOSE, False, True, Framing.CLOSE, False, b"close", None, None),
        # HEAD: the declared length stays, nothing follows.
        (Framing.NONE, True, True, Framing.NONE, True, None, None, b"7"),
    ],
)
def test_the_answer_to_the_client_is_framed_for_its_http_version(
    upstream: Framing,
    client_11: bool,
    keep: bool,
    framing: Framing,
    keep_after: bool,
    connection: bytes | None,
    te: bytes | None,
    cl: bytes | None,
) -> None:
    upstream_lines = [b"Content-Type: application/json", b"Content-Length: 7"]
    if upstream is Framing.CHUNKED:
        upstream_lines = [b"Transfer-Encoding: chunked"]
    elif upstream is Framing.CLOSE:
        upstream_lines = []
    worker = answer(*upstream_lines, method=b"HEAD" if upstream is Framing.NONE else b"POST")
    assert worker.framing is upstream
    plan = plan_response(worker, client_11=client_11, client_keep_alive=keep)
    got = dict((n.lower(), v) for n, v in parsed_fields(plan.head))
    assert plan.head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert (plan.framing, plan.keep_alive) == (framing, keep_after)
    assert (got.get(b"connection"), got.get(b"transfer-encoding"), got.get(b"content-length")) == (
        connection,
        te,
        cl,
    )


@pytest.mark.parametrize(
    "lines",
    [
        [b"Content-Length: 5"],  # the fast path's one noted field
        [b"Content-Length: 5", b"X-Hop: 1", b"Connection: X-Hop"],  # every field read
    ],
)
def test_a_204_s_content_length_is_not_relayed(lines: list[bytes]) -> None:
    # RFC 9110 8.6: a 204 MUST NOT carry one. A 304's states a 200's length, and stays.
    plan = plan_response(
        answer(*lines, status=b"204 No Content"), client_11=True, client_keep_alive=True
    )
    assert plan.framing is Framing.NONE
    assert b"content-length" not in fields(plan.head) and b"x-hop" not in fields(plan.head)
    kept = answer(b"Content-Length: 5", status=b"304 Not Modified", method=b"GET")
    assert (
        fields(plan_response(kept, client_11=True, client_keep_alive=True).head)[b"content-length"]
        == b"5"
    )


def test_the_answer_head_drops_hop_by_hop_and_forged_route_headers_and_adds_ours() -> None:
    worker = answer(
        b"Content-Type: text/event-stream; charset=utf-8",
        b"Connection: keep-alive, X-Hop",
        b"X-Hop: 1",
        b"Keep-Alive: timeout=5",
        b"Transfer-Encoding: chunked",
        b"X-Kvrouter-Worker: forged",
        b"X-Engine: e",
        status=b"200 Fine",
    )
    plan = plan_response(
        worker,
        client_11=True,
        client_keep_alive=True,
        route_headers=b"X-Kvrouter-Worker: http://w:1\r\nX-Kvrouter-Dp-Rank: 0\r\n",
    )
    assert plan.answer.sse
    assert parsed_fields(plan.head) == [
        (b"Content-Type", b"text/event-stream; charset=utf-8"),
        (b"X-Engine", b"e"),
        (b"X-Kvrouter-Worker", b"http://w:1"),
        (b"X-Kvrouter-Dp-Rank", b"0"),
        (b"Transfer-Encoding", b"chunked"),
    ]


def test_a_refusal_is_openai_error_json_with_its_framing() -> None:
    raw = refusal_response(not_allowed(head(b"GET")), client_11=True, keep_alive=True)
    head_part, body = raw.split(b"\r\n\r\n", 1)
    assert head_part.startswith(b"HTTP/1.1 405 Method Not Allowed")
    assert fields(raw)[b"allow"] == b"POST"
    assert int(fields(raw)[b"content-length"]) == len(body)
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    closing = refusal_response(
        admit(head(b"POST", b"/", (b"Content-Length", b"9")), 1), client_11=False, keep_alive=True
    )  # type: ignore[arg-type]
    assert fields(closing)[b"connection"] == b"close"
    # To a HEAD request: the same head (its Content-Length included), no body.
    bare = refusal_response(
        not_allowed(head(b"HEAD")), client_11=True, keep_alive=True, head_only=True
    )
    assert bare == raw[: len(head_part) + 4]


# -- failures and cuts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "fail_over", "breaker", "same_worker", "whole_worker"),
    [
        ("connect", True, True, False, True),
        ("queue", True, False, False, True),  # never sent, and the worker is busy, not broken
        ("timeout", True, True, False, True),
        ("status", True, True, False, True),
        ("lost", True, True, False, True),
        ("worker_down", True, False, False, True),  # health's verdict, not a failed request
        ("removed", True, False, False, True),  # it left the registry: no fault of its own
        ("stale", False, False, True, False),
    ],
)
def test_which_failures_fail_over_which_the_breaker_counts_and_which_skip_the_workers_ranks(
    failure: str, fail_over: bool, breaker: bool, same_worker: bool, whole_worker: bool
) -> None:
    rule = FAILURES[failure]  # type: ignore[index]
    assert (rule.fail_over, rule.breaker, rule.same_worker, rule.whole_worker) == (
        fail_over,
        breaker,
        same_worker,
        whole_worker,
    )


@pytest.mark.parametrize(
    ("reused", "answered", "after_s", "failure"),
    [
        (True, 0, 0.0, "stale"),  # the worker's idle close crossed the request
        (True, 0, STALE_WINDOW_S, "stale"),
        (True, 0, STALE_WINDOW_S + 0.01, "lost"),  # it read the request and worked on it
        (True, 0, 3.0, "lost"),
        (True, 5, 0.0, "lost"),  # it began an answer
        (False, 0, 0.0, "lost"),  # a new connection is no idle one
    ],
)
def test_a_lost_connection_is_the_safe_retry_only_within_the_idle_close_window(
    reused: bool, answered: int, after_s: float, failure: str
) -> None:
    assert classify_lost(reused, answered, 100.0, 100.0 + after_s) == failure


@pytest.mark.parametrize(
    ("free_at", "lost_at", "came_by"),
    [
        (None, 100.66, 100.66),  # no heartbeat known: when it was noticed
        (100.6, 100.66, 100.66),  # the loop beat lately: noticed as it came
        (99.97, 100.66, 100.1),  # held since the request went out: one beat after the write
        (102.9, 103.5, 103.0),  # held after the worker had worked 3 s: still late
    ],
)
def test_a_close_noticed_after_a_held_loop_came_by_a_beat_after_the_loop_was_last_free(
    free_at: float | None, lost_at: float, came_by: float
) -> None:
    assert close_came_by(100.0, lost_at, free_at, 0.1) == pytest.approx(came_by)


@pytest.mark.parametrize(
    ("framing", "sse", "expect"),
    [
        (Framing.CHUNKED, True, "chunked event"),
        (Framing.CLOSE, True, "bare event"),
        (Framing.CHUNKED, False, ""),  # the missing last chunk shows the cut
        (Framing.LENGTH, True, ""),  # the short body shows the cut
        (Framing.LENGTH, False, ""),
    ],
)
def test_what_a_cut_stream_sends_before_the_close(framing: Framing, sse: bool, expect: str) -> None:
    tail = cut_tail(framing, sse, "the worker closed the connection")
    if not expect:
        assert tail == b""
        return
    event = tail
    if expect == "chunked event":
        size, event = tail.split(b"\r\n", 1)
        assert int(size, 16) == len(event) - 2 and event.endswith(b"\r\n")
        assert not tail.endswith(b"0\r\n\r\n")
        event = event[:-2]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = json.loads(event[len(b"data: ") :])["error"]
    assert error["type"] == "upstream_error" and "closed the connection" in error["message"]


@pytest.mark.parametrize(
    ("data", "before", "end"),
    [
        (b"data: one\n\n", b"", 11),
        (b"data: one\n\ndata: tw", b"", 11),  # the second event is not ended yet
        (b"data: one\r\n\r\ndata: tw", b"", 13),
        (b"data: one\r\rdata: tw", b"", 11),
        (b"data: one\n\r\ndata", b"", 12),  # LF, then a CRLF blank line
        (b"data: one\r\n\ndata", b"", 12),  # CRLF, then an LF blank line
        (b"data: one\n\rdata", b"", 11),  # LF, then a CR blank line
        (b"data: one\r\n\r", b"", 12),  # a CR blank line, or a CRLF one cut by the read
        (b"data: one\r\ndata: two\r\n", b"", 0),  # CR LF is one line end
        (b'data: {"te', b"", 0),
        (b"", b"\n", 0),
        (b"\ndata: two", b"\n", 1),  # the blank line began in the read before
        (b"\r\ndata: two", b"\n", 2),
        (b"\rdata: two", b"\r", 1),
        (b"data: two", b"\n", 0),
        (b"\n", b"\n\r", 1),  # the LF of a blank line's CRLF whose CR ended the read before
        (b"\ndata: two", b"\r\r", 1),  # a CR line end, then a CRLF blank line
        (b"\ndata: two", b"e\r", 0),  # CR LF is one line end: no blank line
        (b"\n\rdata", b"e\r", 2),  # a CRLF line end begun before, then a CR blank line
    ],
)
def test_where_the_last_sse_event_in_a_read_ends(data: bytes, before: bytes, end: int) -> None:
    assert events_end(data, before) == end


ONE, TWO = b'data: {"n": 1}', b'data: {"n": 2}'


@pytest.mark.parametrize(
    ("reads", "ended"),
    [
        ([ONE + b"\n\n", TWO + b"\n\n"], [ONE, TWO]),
        ([ONE[:5], ONE[5:] + b"\n\n" + TWO[:3], TWO[3:] + b"\n", b"\n"], [ONE, TWO]),
        ([ONE + b"\r\n", b"\r\n", TWO + b"\r", b"\n\r\n"], [ONE, TWO]),
        ([ONE + b"\n\n" + TWO + b"\n\nda"], [ONE, TWO]),
        ([ONE + b"\n\n" + TWO[:12]], [ONE]),  # the worker died inside an event
        ([ONE + b"\n\n", b"data: ", b"x" * (MAX_HELD_EVENT_BYTES - 100)], [ONE]),  # held
    ],
)
def test_an_sse_stream_cut_anywhere_reaches_the_client_as_whole_events_then_the_error(
    reads: list[bytes], ended: list[bytes]
) -> None:
    """The client gets the events the worker ended, and the error event parses on its own: a
    half event relayed before it was parsed first (the OpenAI SDK raised a JSONDecodeError,
    never its APIError)."""
    events = WholeEvents(bytearray())
    relayed = b"".join(events.take(read) for read in reads)
    assert b"".join(reads).startswith(relayed)  # as the worker wrote them
    body = relayed + cut_tail(Framing.CLOSE, True, "reset")
    *whole, error = sse_events(body)
    assert whole == ended
    parsed = [json.loads(event.removeprefix(b"data: ")) for event in [*whole, error]]
    assert parsed[-1]["error"]["type"] == "upstream_error"


def test_an_sse_event_too_long_to_hold_is_passed_on_and_a_cut_inside_it_ends_it_first() -> None:
    """A stream with no blank line grew the router's memory by all of it, sent nowhere."""
    events = WholeEvents(bytearray())
    reads = [ONE + b"\n\n", b"data: ", b"x" * MAX_HELD_EVENT_BYTES]
    relayed = b"".join(events.take(read) for read in reads)
    assert relayed == b"".join(reads) and not events.held and events.inside_event
    body = relayed + cut_tail(Framing.CLOSE, True, "reset", events.inside_event)
    error = json.loads(sse_events(body)[-1].removeprefix(b"data: "))["error"]
    assert error["type"] == "upstream_error"
    assert events.take(b"x\r\n\r\n" + TWO[:3]) == b"x\r\n\r\n" and not events.inside_event


BIG = b"data: " + b"x" * MAX_HELD_EVENT_BYTES  # passed on as it comes


@pytest.mark.parametrize(
    ("reads", "passed"),
    [
        # CRLF blank lines (sse-starlette's), a read ending between the CR and the LF.
        ([ONE + b"\r\n\r", b"\n", TWO + b"\r\n\r\n"], [ONE + b"\r\n\r", b"\n", TWO + b"\r\n\r\n"]),
        ([ONE + b"\r\n\r", b"\n" + TWO[:3]], [ONE + b"\r\n\r", b"\n"]),
        ([ONE + b"\r\r", b"\n"], [ONE + b"\r\r", b"\n"]),  # CR, then a CRLF blank line
        ([ONE + b"\r", b"\n", b"\r\n"], [b"", b"", ONE + b"\r\n\r\n"]),  # CRLF line end
        # An event too long to hold, whose blank line begins in a read of its own.
        ([BIG + b"\n", b"\n"], [BIG + b"\n", b"\n"]),
        ([BIG + b"\r\n", b"\r\n"], [BIG + b"\r\n", b"\r\n"]),
        ([BIG + b"\r", b"\r", b"\n"], [BIG + b"\r", b"\r", b"\n"]),
        # ... and the rest of it, passed on as it comes too, not held a MiB again.
        ([BIG, b"y" * 64, b"z\n\n" + TWO[:3]], [BIG, b"y" * 64, b"z\n\n"]),
    ],
)
def test_a_read_ending_an_sse_event_passes_it_on_whole_when_its_start_went_out_before(
    reads: list[bytes], passed: list[bytes]
) -> None:
    """The byte an event's end begins with may have gone to the client already, held nowhere:
    the LF of its blank line's CRLF waited for the next event's end (2 s in a probe, which
    httpx's iter_lines, holding a CR for the byte after it, saw the event that late), and so
    did the end of an event passed on as it came."""
    events = WholeEvents(bytearray())
    assert [events.take(read) for read in reads] == passed
    assert b"".join(passed) + events.rest() == b"".join(reads) and not events.inside_event


def test_sse_reads_ending_an_event_pass_through_and_a_split_one_is_relayed_once_ended() -> None:
    events = WholeEvents(bytearray())
    read = ONE + b"\n\n" + TWO + b"\n\n"
    assert events.take(read) is read  # the common read: not copied
    assert events.take(ONE[:7]) == b"" and events.take(ONE[7:] + b"\n") == b""
    assert events.take(b"\n" + TWO[:3]) == ONE + b"\n\n"
    assert events.rest() == TWO[:3]  # a worker that ends its answer mid-line: passed on
    assert events.rest() == b""


def test_a_connection_field_naming_content_length_leaves_the_answer_its_framing() -> None:
    """No sender may name Content-Length in Connection (RFC 9110 7.6.1); dropped, the client
    got an answer with no framing on a kept-alive connection, the next answer's bytes read as
    this one's body."""
    worker = answer(b"Content-Length: 7", b"Connection: Content-Length, X-Hop", b"X-Hop: 1")
    assert (worker.framing, worker.length) == (Framing.LENGTH, 7)
    plan = plan_response(worker, client_11=True, client_keep_alive=True)
    assert parsed_fields(plan.head) == [(b"Content-Length", b"7")]
    assert plan.keep_alive


def test_a_chunk_frames_its_length_in_hex() -> None:
    assert chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
