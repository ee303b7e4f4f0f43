"""The HTTP exchange rules of the relay: plain functions over parsed heads, no sockets.

Everything the data plane decides about the bytes of an exchange lives here, so it can be read
and tested as tables (tests/unit/test_exchange_rules.py); `server.py` and `upstream.py` only
parse, call these and move bytes.

Theory of operation
-------------------
A client request is parsed by httptools into a `RequestHead` (plus a body, which the relay
always reads whole: routing needs the prompt). `admit` decides at the end of the head whether
the request may be read at all (a declared body over the limit is a 413, an unknown
expectation a 417; both close the connection, because the body is left unread), and
`uninvited` whether a request asking before it sends its body (`Expect: 100-continue`) to a
route guarded by the bearer token is refused instead of invited (it lacks the token). `route_of`
says who answers: the data plane (a POST to a generation route), the data plane with a 405
(another method on one), or the control app (every other path).

The request goes upstream as `upstream_request`: the client's headers minus hop-by-hop ones
(RFC 9110 7.6.1, including those the client's `Connection` header names), minus what the
relay sets itself (Host, Content-Length, Expect; to a worker also Accept-Encoding: the relay
never advertises gzip, so SSE reaches the client as the engine wrote it; X-Data-Parallel-Rank:
the rank is the router's choice, not the client's; and Origin: which pages may read an answer
is the router's to say, `cors`), with a Content-Length for the whole body.

The upstream answer's head is read from its bytes (`read_response_head`): its own framing
(`upstream_framing`, RFC 9112 6.3: none for a HEAD, 1xx, 204 or 304; chunked; a
Content-Length; else the body runs until the worker closes), and the field lines the client
gets, spliced as the worker wrote them (hop-by-hop ones and forged route headers cut out).
The answer to the client (`plan_response`) keeps a Content-Length as it is, and re-frames
the other two:
chunked for an HTTP/1.1 client, close-delimited for an HTTP/1.0 one (which cannot read chunks),
so a streamed answer to HTTP/1.0 ends with the connection. Interim 1xx answers are dropped:
the relay sends the whole body upstream at once and never asks for `100 Continue` (it answers
a client's `Expect: 100-continue` itself), and the final answer follows on the same
connection.

Failures (`FAILURES`): before the first byte reached the client, a failure of a worker (no
connection, no head in time, a 5xx head, the connection lost, health declaring it down) is
counted by its breaker (not health's verdict: the breaker is for failed requests) and the next
rank of another worker is tried (the worker's other ranks are behind the same host, port and
engine front: `FailureRule.whole_worker`); a 5xx head from the last rank to try is relayed as
it is instead (its status, `Retry-After` and body are the engine's to give). A 5xx other than
502, 503 and 504 (`WORKER_UNAVAILABLE`) may be the request's own doing (an engine that fails
on an input answers 500), so its worker's breaker hears of it only when the request's outcome
says it was the worker's (`relay.WorkerRelay`): another worker answered it, or none was left
to ask; a second worker answering it such a 5xx too makes the request the cause, and that
answer is relayed, counted by neither breaker. A request that waited its bound for one of a
worker's pooled connections, all busy, goes to another worker's rank too, uncounted by the
breaker (the worker is busy, not broken), and is a 503 with a `Retry-After` when none is left.
A reused idle connection found dead before it answered anything, within `STALE_WINDOW_S` of
the request's write, is the one safe retry (the worker never saw the request: it closed an
idle connection), on a fresh connection to the same worker, and counts nowhere; found dead
later, the worker had read the request and worked on it, and the connection is lost as any
other. After the first byte nothing is retried: a stream cut by its worker must not look
complete (`cut_tail`): the client connection is closed without the terminating chunk, after an
OpenAI-style `data: {"error": ...}` event when the answer is SSE, so every client library
reports the failure.
An SSE answer is relayed in whole events for that (`WholeEvents`): the event the worker broke
off in never reaches the client, which would parse it before the error event.
(A close-delimited answer to an HTTP/1.0 client cannot show a cut except through that SSE
event: its end is the close.)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from http import HTTPStatus
from operator import itemgetter
from typing import Final, Literal
from urllib.parse import unquote

import msgspec

from router import auth

GENERATION_ROUTES: Final = frozenset({b"/v1/completions", b"/v1/chat/completions", b"/generate"})

# RFC 9110 7.6.1 hop-by-hop fields, plus Proxy-Connection (still sent by old clients).
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request fields the relay sets itself.
_SET_BY_RELAY: Final = frozenset({b"host", b"content-length", b"expect"})
_TO_CONTROL_DROPPED: Final = HOP_BY_HOP | _SET_BY_RELAY
# To a worker, also: no gzip (SSE as the engine wrote it), the rank is the router's, and so
# is the answer to a page's origin (`cors`: an engine's own would join or replace it).
_TO_WORKER_DROPPED: Final = _TO_CONTROL_DROPPED | {
    b"accept-encoding",
    b"x-data-parallel-rank",
    b"origin",
}
ROUTE_HEADERS: Final = (b"x-kvrouter-worker", b"x-kvrouter-dp-rank")
# A worker's own CORS answer (an engine, or a proxy before it, that writes one whatever the
# request's Origin: `Access-Control-Allow-Origin: *`) would let any page read the answers, and
# next to the router's own (`--cors-allow-origin`) make two, which browsers refuse: only the
# router's policy speaks for the routes it relays.
_CORS_FIELDS: Final = {
    b"access-control-allow-origin",
    b"access-control-allow-credentials",
    b"access-control-allow-methods",
    b"access-control-allow-headers",
    b"access-control-expose-headers",
    b"access-control-max-age",
}
_RESPONSE_DROPPED: Final = HOP_BY_HOP | set(ROUTE_HEADERS) | _CORS_FIELDS
# A 204 MUST NOT carry a Content-Length (RFC 9110 8.6): a worker's is not passed on. (A 304's
# states the length a 200 would have had, which it may.)
_NO_CONTENT_DROPPED: Final = _RESPONSE_DROPPED | {b"content-length"}
# The fields of an answer head the relay reads or drops: a head is scanned for these names
# only (in one pass of a compiled pattern over it, lower-cased), and every other field line
# goes to the client as the worker wrote it.
_NOTED_FIELDS: Final = re.compile(
    rb"\r\n("
    + b"|".join(re.escape(name) for name in sorted(_RESPONSE_DROPPED | {b"content-length"}))
    + rb"):"
)
# Every field line of a head llhttp accepted: it allows no obs-fold, no whitespace before
# the colon and no bare CR or LF, drops the value's leading whitespace and keeps its trailing.
_FIELD_LINE: Final = re.compile(rb"\r\n([^:\r\n]+):[ \t]*([^\r]*)")

# RFC 9112 4: reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ).
_REASON_PHRASE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_STATUS_STARTS: Final = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}".encode("latin-1") for s in HTTPStatus
}
_STATUS_LINES: Final = {status: start + b"\r\n" for status, start in _STATUS_STARTS.items()}


class Framing(enum.Enum):
    """How a message's body ends."""

    NONE = "none"  # no body (HEAD, 1xx, 204, 304)
    LENGTH = "length"  # Content-Length bytes
    CHUNKED = "chunked"  # chunked transfer coding, ends with the zero-length chunk
    CLOSE = "close"  # the sender closes the connection


# Python 3.11 reads an enum member through a descriptor written in Python (`enum.property`),
# about 0.15 us a read, and a request reads `Framing` members half a dozen times. The members
# are put in the class's own dictionary, as Python 3.12 keeps them: a read is a plain lookup.
for _member in Framing:
    type.__setattr__(Framing, _member.name, _member)
del _member


@dataclass(slots=True)
class RequestHead:
    method: bytes
    target: bytes  # the request target as sent: path and query
    http_11: bool  # HTTP/1.1 (else 1.0)
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool  # the parser's verdict: version, Connection header
    content_length: int | None
    chunked: bool
    expect: bytes | None  # the Expect field, lower-cased
    names: list[bytes]  # the field names, lower-cased, in `headers` order
    hop_by_hop: frozenset[bytes]  # fields its Connection header names
    path: bytes  # the target without its query

    def header(self, name: bytes) -> bytes | None:
        """The first value of a field (`name` lower-case)."""
        for low, (_, value) in zip(self.names, self.headers, strict=True):
            if low == name:
                return value
        return None


class Malformed(ValueError):
    """A request head the relay refuses with a 400 (the message says why)."""

    status = 400
    head: RequestHead | None = None  # the head, when all but the refused part of it parsed


class UnknownCoding(Malformed):
    """A request body in a transfer coding the relay does not decode (gzip, deflate, ...):
    501, as RFC 9112 6.1 says, rather than its bytes passed on unlabelled. Raised once the
    rest of the head parsed, with it: the refusal is counted under the request's route."""

    status = 501

    def __init__(self, message: str, head: RequestHead) -> None:
        super().__init__(message)
        self.head = head


class BadAnswer(ValueError):
    """A worker's answer head the relay cannot pass on (the message says why): a lost answer,
    as a connection closed before its head is."""


def transfer_codings(value: bytes) -> list[bytes]:
    """A Transfer-Encoding field's codings, lower-cased, in order (RFC 9112 6.1)."""
    return [c.strip().lower() for c in value.split(b",")]


def lower_names(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    return list(map(bytes.lower, map(itemgetter(0), headers)))  # in C: no comprehension's frame


def read_request_head(
    method: bytes, target: bytes, http_11: bool, headers: list[tuple[bytes, bytes]], keep: bool
) -> RequestHead:
    """Collect the framing fields of a parsed head; raise `Malformed` for what llhttp let by.

    Beyond llhttp's checks (RFC 9112): an HTTP/1.1 request has exactly one Host field, and an
    HTTP/1.0 one at most one (3.2); an absolute-form target is served as its origin form
    (3.2.2: a server MUST accept it), the asterisk form is refused (no resource here answers
    for the server as a whole), and so is CONNECT, whatever its target (no tunnels); an HTTP/1.0
    request's `Expect` is ignored (RFC 9110 10.1.1), and one framed by Transfer-Encoding
    closes the connection after it (6.1: its framing may be faulty); a target with a fragment
    is refused (3.2: no form of it has one; llhttp lets `#` by, and the control app would
    route `/v1/completions#x` as `/v1/completions`)."""
    length: int | None = None
    chunked = False
    unknown_coding: bytes | None = None
    expect: bytes | None = None
    hosts = 0
    names = lower_names(headers)
    for low, (_, value) in zip(names, headers, strict=True):
        if low == b"content-length":
            if not value.strip().isdigit():
                raise Malformed("Content-Length is not a number")
            n = int(value)
            if length is not None and n != length:
                raise Malformed("conflicting Content-Length fields")
            length = n
        elif low == b"host":
            hosts += 1
        elif low == b"transfer-encoding":
            codings = transfer_codings(value)
            if codings[-1] != b"chunked":
                raise Malformed("a request's Transfer-Encoding must end with chunked")
            if chunked or b"chunked" in codings[:-1]:
                raise Malformed("chunked applied more than once")  # RFC 9112 7
            if len(codings) > 1:
                unknown_coding = codings[0]
            chunked = True
        elif low == b"expect" and http_11:
            expect = value.strip().lower()
    if chunked and length is not None:
        raise Malformed("both Content-Length and Transfer-Encoding")  # RFC 9112 6.1: smuggling
    if hosts > 1 or (http_11 and not hosts):
        raise Malformed(
            "more than one Host field" if hosts > 1 else "an HTTP/1.1 request needs a Host field"
        )
    if chunked and not http_11:
        keep = False
    if method == b"CONNECT":
        # Whatever its target: llhttp stops at every CONNECT head as a protocol switch.
        raise Malformed("CONNECT is not supported: the router is no tunnelling proxy")
    if b"#" in target:
        raise Malformed("a request target has no fragment (#)")
    if target[:1] != b"/":
        target = _origin_form(target)
    named = _connection_tokens(names, headers) if b"connection" in names else frozenset()
    path = target.split(b"?", 1)[0]
    head = RequestHead(
        method, target, http_11, headers, keep, length, chunked, expect, names, named, path
    )
    if unknown_coding is not None:
        coding = unknown_coding.decode("latin-1")
        raise UnknownCoding(
            f"transfer coding {coding!r} is not supported; send the body chunked only", head
        )
    return head


def _origin_form(target: bytes) -> bytes:
    """An absolute-form target's path and query (`/` when it has none)."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https") or not rest:
        if target == b"*":
            raise Malformed("the asterisk-form request target is not served")
        raise Malformed("the request target is neither a path nor an absolute URL")
    cut = min((i for i in map(rest.find, (b"/", b"?")) if i >= 0), default=len(rest))
    path = rest[cut:]
    return path if path[:1] == b"/" else b"/" + path


def head_without_upgrade(
    method: bytes,
    target: bytes,
    http_11: bool,
    headers: list[tuple[bytes, bytes]],
    *,
    invited: bool,
) -> bytes:
    """A request head asking to switch protocols (`Upgrade: h2c`, what `curl --http2` sends
    over plain HTTP; a WebSocket handshake), written again without its Upgrade field: the
    relay switches to nothing and serves the request as it is, as RFC 9110 7.8 lets a
    server (nginx does the same). llhttp stops at such a head before its body, so the server
    parses this head afresh, followed by the bytes the client sent after the original one.
    The Connection field stays (the token it names is hop-by-hop and dropped upstream).
    `invited`: the client was sent its `100 Continue` already, and the head goes without its
    Expect field too, which would have it sent again (a client got two); one still owed keeps
    it. (CONNECT, which llhttp also stops at, never gets here: `read_request_head` refuses it.)"""
    dropped = (b"upgrade", b"expect") if invited else (b"upgrade",)
    lines = [b"%s %s HTTP/%s\r\n" % (method, target, b"1.1" if http_11 else b"1.0")]
    lines += [b"%s: %s\r\n" % field for field in headers if field[0].lower() not in dropped]
    lines.append(b"\r\n")
    return b"".join(lines)


Route = Literal["generation", "not_allowed", "control"]


def route_of(head: RequestHead) -> Route:
    if head.path in GENERATION_ROUTES:
        return "generation" if head.method == b"POST" else "not_allowed"
    return "control"


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer the data plane gives itself."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    close: bool = False  # the connection closes after it (the body was left unread)
    extra: tuple[tuple[bytes, bytes], ...] = ()


# With every 503 of the router's own: what it refuses for is a moment's state (no pooled
# connection free, no worker healthy, this replica's connections at their maximum, its drain),
# which a retry a second later may well not meet, on this replica or, through the load
# balancer, another. A client that honours it (the openai SDK does) waits that second instead
# of its own backoff; a longer value would hold it back from a worker back at its next health
# check (every 2 s by default). The router cannot tell which of these is over sooner, so all
# say the same.
RETRY_SOON: Final = ((b"Retry-After", b"1"),)


def admit(head: RequestHead, max_body_bytes: int) -> Refusal | None:
    """Whether the body may be read at all, decided at the end of the head."""
    if head.expect is not None and head.expect != b"100-continue":
        return Refusal(417, "only 'Expect: 100-continue' is supported", close=True)
    if head.content_length is not None and head.content_length > max_body_bytes:
        return body_too_large(max_body_bytes)
    return None


def control_path(head: RequestHead) -> str:
    """The request's path as the control app matches it: percent-decoded (`head.path` is as
    the client sent it; a target with a fragment never gets here, `read_request_head`)."""
    return unquote(head.path.decode("latin-1"))


def uninvited(head: RequestHead, token: str | None) -> Refusal | None:
    """For a request asking before it sends its body (`Expect: 100-continue`): the refusal of a
    route guarded by the bearer token (`router.auth`) when the request does not present it
    (`token`: the configured one), answered instead of the 100 and without reading the body
    (so the connection closes), where the control app would refuse it once the body (up to
    `--max-request-bytes`) was uploaded. None: it may send its body."""
    if not auth.guarded(control_path(head)):
        return None
    presented = [
        value.decode("utf-8", "surrogateescape")  # as aiohttp reads a field value
        for low, (_, value) in zip(head.names, head.headers, strict=True)
        if low == b"authorization"
    ]
    denial = auth.check(token, presented)
    if denial is None:
        return None
    challenge = ((b"WWW-Authenticate", auth.CHALLENGE.encode()),) if denial.challenge else ()
    return Refusal(
        denial.status, denial.message, type="authentication_error", close=True, extra=challenge
    )


def body_too_large(max_body_bytes: int) -> Refusal:
    return Refusal(
        413, f"request body over the limit of {max_body_bytes} bytes", close=True, param="body"
    )


def not_allowed(head: RequestHead) -> Refusal:
    return Refusal(
        405,
        f"{head.path.decode('latin-1')} accepts POST only",
        extra=((b"Allow", b"POST"),),
    )


CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


def upstream_request(
    head: RequestHead,
    body_length: int,
    host: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    to_worker: bool = True,
) -> bytes:
    """The request head sent upstream (HTTP/1.1, keep-alive), without the body.

    To a worker (`to_worker`) or to the control app, which keeps Accept-Encoding (a peer
    snapshot may come gzipped) and sees the client's Host.
    """
    dropped = _TO_WORKER_DROPPED if to_worker else _TO_CONTROL_DROPPED
    named = head.hop_by_hop
    parts = [head.method, b" ", head.target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for low, (name, value) in zip(head.names, head.headers, strict=True):
        if low not in dropped and low not in named:
            parts += (name, b": ", value, b"\r\n")
    for name, value in extra or ():
        parts += (name, b": ", value, b"\r\n")
    parts += (b"Content-Length: ", b"%d" % body_length, b"\r\n\r\n")
    return b"".join(parts)


def _connection_tokens(names: list[bytes], headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Fields a `Connection` header names as hop-by-hop (RFC 9110 7.6.1), but Content-Length:
    it is for every recipient (no sender may name it), and the relay keeps a worker's to frame
    the answer it relays byte for byte (dropped, the client could not tell where it ends)."""
    tokens: set[bytes] = set()
    for low, (_, value) in zip(names, headers, strict=True):
        if low == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    tokens.discard(b"content-length")
    return frozenset(tokens)


def upstream_framing(
    status: int,
    headers: list[tuple[bytes, bytes]],
    request_method: bytes,
    names: list[bytes],
) -> tuple[Framing, int | None]:
    """How the worker's answer body ends (RFC 9112 6.3), and its length when declared.
    `names`: the header names lower-cased (`lower_names`).

    Raises `BadAnswer` for a transfer coding other than chunked: the relay never offers one
    (no `TE` goes to a worker), and passing its bytes on would hand the client, say, gzip
    under a plain `chunked` label."""
    if request_method == b"HEAD" or status < 200 or status in (204, 304):
        return Framing.NONE, None
    length: int | None = None
    chunked = False
    for low, (_, value) in zip(names, headers, strict=True):
        if low == b"transfer-encoding":
            codings = transfer_codings(value)
            if codings != [b"chunked"] or chunked:
                coding = value.strip().decode("latin-1")
                raise BadAnswer(
                    f"the worker's answer has Transfer-Encoding {coding!r}, a coding the relay "
                    "never accepts (chunked only)"
                )
            chunked = True
        elif low == b"content-length" and value.strip().isdigit():
            length = int(value)
    if chunked:
        return Framing.CHUNKED, None  # wins over a Content-Length (RFC 9112 6.3 item 3)
    if length is not None:
        return Framing.LENGTH, length
    return Framing.CLOSE, None


# Made per answer, so not frozen: a frozen dataclass sets each field through
# `object.__setattr__` (about 3x the cost of a plain one to make).
@dataclass(slots=True)
class ResponseHead:
    """A worker's final answer head, read from its bytes (`read_response_head`)."""

    status: int
    raw: bytes  # as the worker sent it, from the status line to the blank line
    framing: Framing
    length: int | None  # the declared Content-Length
    status_line: bytes  # the client's, without its CRLF (the relay speaks HTTP/1.1)
    fields: bytes  # the field lines the client gets: each after a CRLF, and one CRLF after all

    @property
    def sse(self) -> bool:
        """text/event-stream (relayed event by event, and a cut sends an error event). Read
        once for a streamed answer, so an answer with a length is not searched for it."""
        return any(
            name.lower() == b"content-type" and value.startswith(b"text/event-stream")
            for name, value in _FIELD_LINE.findall(self.raw)
        )


_CHUNKED_FIELD: Final = b"\r\ntransfer-encoding:"
_LENGTH_FIELD: Final = b"\r\ncontent-length:"


def read_response_head(status: int, raw: bytes, request_method: bytes) -> ResponseHead:
    """The final head `raw` (as llhttp accepted it, blank line included) of the answer to a
    `request_method` request: its framing, and what of it the client gets.

    The client gets the worker's field lines as they are, minus the hop-by-hop ones (and
    those a `Connection` field names, RFC 9110 7.6.1) and forged route headers; the relay
    adds the framing and route fields of its own answer (`plan_response`). A Content-Length
    stays as it is (but a 204's, which it must not have): the body is relayed byte for byte.
    Most answers carry no field to drop but their framing one, and their head is not split
    into fields at all. A status below 100 or past 599 is no status (RFC 9110 15: three
    digits, 1xx to 5xx): `BadAnswer`, as a malformed head (one below 100 taken for an
    interim 1xx left its request waiting for a head until the head timeout)."""
    if not 100 <= status <= 599:
        raise BadAnswer(f"status {status} is not an HTTP status (100-599)")
    low = raw.lower()
    noted = _NOTED_FIELDS.findall(low)
    line_end = raw.index(b"\r\n")
    start = _STATUS_STARTS.get(status)
    if start is None:
        # The reason phrase is informational (RFC 9112 4): a known status gets the standard
        # one, another keeps the worker's, unless it holds a byte no phrase may (llhttp lets
        # control bytes by): then the client gets none.
        words = raw[:line_end].split(b" ", 2)
        reason = words[2] if len(words) > 2 else b""
        if _REASON_PHRASE.fullmatch(reason) is None:
            reason = b""
        start = b"HTTP/1.1 %d %b" % (status, reason)
    if not noted or (noted == [b"content-length"] and status != 204):
        framing_fields = []
        if noted:
            at = low.index(_LENGTH_FIELD) + len(_LENGTH_FIELD)
            framing_fields = [(b"content-length", raw[at : low.index(b"\r", at)])]
        framing, length = upstream_framing(status, framing_fields, request_method, noted)
        return ResponseHead(status, raw, framing, length, start, raw[line_end:-2])
    if noted == [b"transfer-encoding"]:
        at = low.index(_CHUNKED_FIELD)
        end = low.index(b"\r", at + 2)
        if low[at + len(_CHUNKED_FIELD) : end].strip() == b"chunked":
            framing_fields = [(b"transfer-encoding", b"chunked")]
            framing, _ = upstream_framing(status, framing_fields, request_method, noted)
            fields = raw[line_end:at] + raw[end:-2]
            return ResponseHead(status, raw, framing, None, start, fields)
    # Anything else to drop: every field is read (a Connection field names more).
    lines = list(_FIELD_LINE.finditer(raw))
    headers = [(m.group(1), m.group(2)) for m in lines]
    names = lower_names(headers)
    dropped = _NO_CONTENT_DROPPED if status == 204 else _RESPONSE_DROPPED
    if b"connection" in names:
        dropped = dropped | _connection_tokens(names, headers)
    framing, length = upstream_framing(status, headers, request_method, names)
    kept = []
    at = line_end
    for name, line in zip(names, lines, strict=True):
        if name in dropped:
            kept.append(raw[at : line.start()])
            at = line.end()
    kept.append(raw[at:-2])
    return ResponseHead(status, raw, framing, length, start, b"".join(kept))


@dataclass(slots=True)  # made per answer: not frozen (see `ResponseHead`)
class ResponsePlan:
    head: bytes
    framing: Framing  # of the answer to the client
    keep_alive: bool  # the client connection stays open after it
    answer: ResponseHead  # the worker's


def plan_response(
    answer: ResponseHead,
    *,
    client_11: bool,
    client_keep_alive: bool,
    route_headers: bytes = b"",
) -> ResponsePlan:
    """The head and framing of the answer to the client, from the worker's final answer
    (`route_headers`: field lines, each ending with a CRLF)."""
    upstream = answer.framing
    if upstream is Framing.LENGTH or upstream is Framing.NONE:
        framing = upstream
    else:
        framing = Framing.CHUNKED if client_11 else Framing.CLOSE
    keep_alive = client_keep_alive and framing is not Framing.CLOSE
    parts = [answer.status_line, answer.fields, route_headers]
    if framing is Framing.CHUNKED:
        parts.append(b"Transfer-Encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    elif not client_11:
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return ResponsePlan(b"".join(parts), framing, keep_alive, answer)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK: Final = b"0\r\n\r\n"


def refusal_response(
    refusal: Refusal, *, client_11: bool, keep_alive: bool, head_only: bool = False
) -> bytes:
    """One of the data plane's own answers: the OpenAI error JSON (its head alone for a
    HEAD request)."""
    body = {"error": {"message": refusal.message, "type": refusal.type, "param": refusal.param}}
    return json_response(
        refusal.status,
        body,
        client_11=client_11,
        keep_alive=keep_alive and not refusal.close,
        head_only=head_only,
        extra=refusal.extra,
    )


def no_content_response(
    fields: tuple[tuple[bytes, bytes], ...], *, client_11: bool, keep_alive: bool
) -> bytes:
    """A 204 with `fields`: no body, and no Content-Length (RFC 9110 8.6)."""
    parts = [_STATUS_LINES[204]]
    for name, value in fields:
        parts += (name, b": ", value, b"\r\n")
    parts += (_connection_line(client_11, keep_alive), b"\r\n")
    return b"".join(parts)


def _connection_line(client_11: bool, keep_alive: bool) -> bytes:
    """The Connection field one of the data plane's own answers needs (none: HTTP/1.1's
    default, keep-alive)."""
    if not keep_alive:
        return b"Connection: close\r\n"
    return b"" if client_11 else b"Connection: keep-alive\r\n"


def json_response(
    status: int,
    body: object,
    *,
    client_11: bool,
    keep_alive: bool,
    head_only: bool = False,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> bytes:
    """A complete answer with a JSON body (only its head for a HEAD request)."""
    payload = msgspec.json.encode(body)
    parts = [
        _STATUS_LINES.get(status) or b"HTTP/1.1 %d Error\r\n" % status,
        b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n" % len(payload),
    ]
    for name, value in extra:
        parts += (name, b": ", value, b"\r\n")
    parts += (_connection_line(client_11, keep_alive), b"\r\n")
    if not head_only:
        parts.append(payload)
    return b"".join(parts)


# -- failures ----------------------------------------------------------------------------

Failure = Literal[
    "connect", "queue", "timeout", "status", "lost", "worker_down", "removed", "stale"
]


@dataclass(frozen=True, slots=True)
class FailureRule:
    fail_over: bool  # try the next rank (before the first byte only)
    breaker: bool  # counts as a failure of the worker
    same_worker: bool  # retried on the same worker, once, not as a failover
    # The failure is the worker's, not its rank's: the request skips the worker's other ranks.
    # Its ranks share one host and port, one pool and one API server in front of the engine,
    # so a refused or timed-out connect, a head not in time, a 5xx, a lost connection or a
    # health verdict would meet them all; trying them in turn spent every attempt of the
    # request (`--max-attempts`) on one broken worker while another was healthy.
    whole_worker: bool


FAILURES: Final[dict[Failure, FailureRule]] = {
    # Refused, or no connection in time.
    "connect": FailureRule(fail_over=True, breaker=True, same_worker=False, whole_worker=True),
    # Waited its bound for one of the worker's pooled connections, all busy: never sent, so
    # safe to try elsewhere, and no fault of the worker (busy with this replica's streams);
    # its other ranks share that pool, and would only queue the request again.
    "queue": FailureRule(fail_over=True, breaker=False, same_worker=False, whole_worker=True),
    # No head in time.
    "timeout": FailureRule(fail_over=True, breaker=True, same_worker=False, whole_worker=True),
    # A 5xx head (one that may be the request's doing is held: `relay.WorkerRelay`).
    "status": FailureRule(fail_over=True, breaker=True, same_worker=False, whole_worker=True),
    # The connection closed before a head.
    "lost": FailureRule(fail_over=True, breaker=True, same_worker=False, whole_worker=True),
    # Health declared the worker down while the request waited for its head: the breaker is
    # for failed requests, and health has its own verdict (the worker is out of routing).
    "worker_down": FailureRule(fail_over=True, breaker=False, same_worker=False, whole_worker=True),
    # The worker left the registry (`DELETE /workers`, discovery) while the request waited for
    # a connection to it: no fault of the worker.
    "removed": FailureRule(fail_over=True, breaker=False, same_worker=False, whole_worker=True),
    # A reused idle connection found dead: retried once, on a fresh one to the same worker.
    "stale": FailureRule(fail_over=False, breaker=False, same_worker=True, whole_worker=False),
}


# 5xx statuses that speak of the worker's state whatever the request: an engine shedding load
# or not ready (503), a gateway in front of it that found it broken or slow (502, 504). Any
# other 5xx (500 above all: "an unexpected condition that prevented it from fulfilling the
# request", RFC 9110 15.6.1) may come of the request itself, and a second worker's word on the
# same request tells which it was.
WORKER_UNAVAILABLE: Final = frozenset({502, 503, 504})


# How soon after its request went out a reused connection's close may be the worker's close of
# it as an idle one, crossing the request on the wire: that close reaches the router within
# about a round trip (under a millisecond on a LAN), plus the loop's own lag. A worker that
# read the request and worked on it before its connection died (an engine dying mid-generation
# of a non-streamed completion, whose head comes at its end) takes far longer, and sending the
# request to it again would run it twice.
STALE_WINDOW_S: Final = 0.25


def close_came_by(
    sent_at: float, lost_at: float, free_at: float | None = None, beat_s: float = 0.0
) -> float:
    """The latest a connection's close can be said to have come, by the loop's clock: when it
    was noticed (`lost_at`), or earlier when the loop was held meanwhile. A loop that beats
    every `beat_s` while it is free, last on time at `free_at` (None: unknown), and noticed the
    close more than a beat after that, was held by a callback (a large event batch's decode):
    the close may have come as soon as a beat after the loop was last seen free (it was free
    when it wrote the request too)."""
    if free_at is None:
        return lost_at
    return min(lost_at, max(free_at, sent_at) + beat_s)


def classify_lost(reused: bool, answered_bytes: int, sent_at: float, came_by: float) -> Failure:
    """A connection lost before any head (its close came by loop time `came_by`:
    `close_came_by`, its request written at `sent_at`): the safe retry when it can only be an
    idle close that crossed the request, else a failure of the worker."""
    if reused and answered_bytes == 0 and came_by - sent_at <= STALE_WINDOW_S:
        return "stale"
    return "lost"


def cut_tail(
    framing: Framing,
    sse: bool,
    message: str,
    inside_event: bool = False,
    error_type: str = "upstream_error",
) -> bytes:
    """What the client gets before its connection is closed when a stream is cut (by its
    worker, or by the replica's shutdown at the drain's end): for an SSE answer, an error
    event saying `message`. The relay sent whole events only (`WholeEvents`), so the error
    event starts one of its own, and a client parses it as it parses any other; but for an
    event too long to hold, part of which went out (`inside_event`): it is ended first, else
    the error would join its last line."""
    if not sse or framing not in (Framing.CHUNKED, Framing.CLOSE):
        return b""  # a short Content-Length body, or a missing last chunk, shows the cut
    event = b"data: %b\n\n" % msgspec.json.encode(
        {"error": {"message": message, "type": error_type}}
    )
    if inside_event:
        event = b"\n\n" + event  # after a CR, its LF makes one CRLF: one more LF ends it
    return chunk(event) if framing is Framing.CHUNKED else event


# The ends of an SSE event (a line end, then the blank line's: CRLF or LF) a read most often
# ends with. Each ends with an LF, which is all a read after it needs of it (`events_end`):
# a CR-only stream's end (a CR blank line) comes by `events_end`, as rare as such streams.
_EVENT_ENDS: Final = (b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\r\n\n")
_AFTER_AN_EVENT_END: Final = b"\n"
# Every event end holds one of these: two line ends in a row, the second the blank line's
# (CR LF alone is one line end).
_BLANK_LINE_STARTS: Final = (b"\n\n", b"\r\r", b"\n\r")


def events_end(data: bytes, before: bytes = b"") -> int:
    """How many bytes of `data` the SSE events ending in it take: up to the end of the last
    blank line in it (WHATWG SSE: lines end with CRLF, LF or CR; a blank line ends an event),
    0 when none ends there. `before`: the stream's last two bytes before `data` (fewer at its
    start), where that blank line's line end may begin, or where a blank line ended with a CR
    whose LF begins `data`."""
    at = max(map(data.rfind, _BLANK_LINE_STARTS))
    if at < 0:
        if data[:1] == b"\n" and before[-1:] == b"\r" and before[-2:-1] in (b"\r", b"\n"):
            # The CR ended a blank line, and the event with it (a client that dispatches on
            # the CR has it); this LF makes that line end a CRLF and goes at once: held until
            # the next event ended, a reader that waits for the byte after a CR (httpx's
            # iter_lines) got the event only with the next.
            return 1
        if before[-1:] + data[:1] not in _BLANK_LINE_STARTS:
            return 0
        at = -1  # the first byte of `data` ends the blank line
    end = at + 2
    if data[end - 1 : end] == b"\r" and data[end : end + 1] == b"\n":
        end += 1  # the blank line ends with a CRLF, not a CR: its LF goes with it
    return end


# The most of one SSE event held back (`WholeEvents`): an engine's event is a token or a few,
# a few kB with logprobs; a stream with no blank line must not grow the router's memory. It is
# also what a client that does not read costs past its write buffer's mark (64 KiB) and the
# read that went over it: an event held whole is written whole. At 1 MiB, events of ~1 MB (a
# vLLM `echo` of a long prompt) cost ~1 MB a client that did not read them (300: +267 MB).
MAX_HELD_EVENT_BYTES: Final = 64 * 1024


@dataclass(slots=True)
class WholeEvents:
    """An SSE answer's bytes as the relay passes them on: whole events only, the event a read
    ends inside held until the read that ends it. A stream its worker cuts then leaves the
    client no half event that a client would parse on its own (the OpenAI SDK raised a
    JSONDecodeError on it, not its APIError) before the relay's error event (`cut_tail`); the
    held bytes are dropped. Most reads end at an event's end, and pass through uncopied. An
    event past `MAX_HELD_EVENT_BYTES` is passed on as it comes (`inside_event` until one ends)."""

    held: bytearray
    inside_event: bool = False  # part of an event went out, and its end did not yet
    # The stream's last bytes read, held or sent, as many as `events_end` reads of its `before`
    # (two, or the LF of an event's end): an event's end may begin in them, its bytes already
    # sent (an event passed on as it came, a blank line's CR whose LF comes next), and no
    # held byte says so.
    tail: bytes = b""

    def take(self, data: bytes) -> bytes:
        """What of the held bytes and `data` goes to the client now (b"": nothing yet)."""
        held = self.held
        if not held and data.endswith(_EVENT_ENDS):
            self.inside_event = False
            self.tail = _AFTER_AN_EVENT_END
            return data
        before = self.tail
        self.tail = data[-2:] if len(data) > 1 else (before + data)[-2:]
        end = events_end(data, before)
        if not end:
            if self.inside_event:
                return data  # part of this event went out: held, the rest would gain nothing
            held += data
            if len(held) <= MAX_HELD_EVENT_BYTES:
                return b""
            self.inside_event = True
            return self.rest()
        whole = bytes(held) + data[:end] if held else data[:end]
        held[:] = data[end:]
        self.inside_event = False
        return whole

    def rest(self) -> bytes:
        """The bytes held at the answer's end (a worker may end it without a blank line)."""
        rest = bytes(self.held)
        self.held.clear()
        return rest
