"""Hypothesis against the data plane's server side over real sockets.

A replica (with one fake worker) runs on its own event loop in a thread; each example opens a
plain blocking socket, sends bytes in the pieces hypothesis chose (random bytes, a valid
request split at random points, mangled heads, random chunk boundaries of a chunked body),
then reads until the replica closes or answers. Whatever the input, the replica never answers
5xx, never hangs past its (short) read timeouts, and keeps serving `/healthz` afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process

pytestmark = pytest.mark.timeout(240)

STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
BODY = b'{"prompt": "fuzz the parser", "max_tokens": 1}'
# Connection: close, so that each example ends at the answer, not at the keep-alive timeout.
VALID = (
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
CHUNKED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
TIMEOUT_S = 0.2  # the replica's read timeouts: an incomplete input ends this soon


@contextlib.contextmanager
def replica_in_a_thread() -> Iterator[tuple[str, int]]:
    ready: list[tuple[str, int]] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def run() -> None:
        async with (
            fake_worker_in_process() as fw,
            router_in_process(
                workers=[fw.url],
                client_header_timeout_s=TIMEOUT_S,
                client_body_timeout_s=TIMEOUT_S,
                keepalive_timeout_s=TIMEOUT_S,
                max_head_bytes=8192,
                max_request_bytes=4096,
            ) as rt,
        ):
            host, port = rt.url.removeprefix("http://").rsplit(":", 1)
            ready.append((host, int(port)))
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True)
    thread.start()
    try:
        assert started.wait(30), "the replica did not start"
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    with replica_in_a_thread() as addr:
        yield addr


def exchange(address: tuple[str, int], pieces: list[bytes]) -> bytes:
    """Send the pieces, then read until the replica closes (bounded by its timeouts)."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):  # the replica may close mid-send: fine
            for piece in pieces:
                sock.sendall(piece)
        sock.settimeout(5)  # far past the replica's own timeouts: it closes long before
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(65536):
                received += data
        return received


def assert_sane(received: bytes) -> None:
    statuses = [int(s) for s in STATUS.findall(received)]
    # A 501 only for a transfer coding the relay does not decode (RFC 9112 6.1), then a close.
    coding = b"is not supported; send the body chunked only" in received
    assert all(s < 500 or s == 503 or (s == 501 and coding) for s in statuses), received[:300]
    assert 503 not in statuses or b"no healthy worker" not in received  # the worker is up


def healthy(address: tuple[str, int]) -> None:
    received = exchange(address, [b"GET /healthz HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"])
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if data[a:b]]


FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=5))
def test_random_bytes_get_a_4xx_or_a_close(address: tuple[str, int], pieces: list[bytes]) -> None:
    assert_sane(exchange(address, pieces))


@FUZZ
@given(st.lists(st.integers(0, 400), max_size=8))
def test_a_valid_request_split_anywhere_is_answered_200(
    address: tuple[str, int], cuts: list[int]
) -> None:
    received = exchange(address, [*split(VALID, cuts), b""])
    assert STATUS.match(received) and STATUS.match(received).group(1) == b"200", received[:300]  # type: ignore[union-attr]


@FUZZ
@given(
    st.integers(0, len(VALID) - 1),
    st.sampled_from([b"\x00", b"\r", b"\n", b" ", b":", b"\xff", b"\r\n\r\n", b"\t"]),
    st.lists(st.integers(0, 400), max_size=4),
)
def test_a_mangled_head_gets_a_4xx_or_a_close(
    address: tuple[str, int], at: int, junk: bytes, cuts: list[int]
) -> None:
    mangled = VALID[:at] + junk + VALID[at:]
    assert_sane(exchange(address, split(mangled, cuts)))


@FUZZ
@given(st.lists(st.integers(1, len(BODY)), max_size=6), st.lists(st.integers(0, 200), max_size=6))
def test_a_chunked_body_at_any_boundaries_is_answered_200(
    address: tuple[str, int], sizes: list[int], cuts: list[int]
) -> None:
    chunks, rest = [], BODY
    for size in sizes:
        if rest:
            chunks.append(rest[:size])
            rest = rest[size:]
    if rest:
        chunks.append(rest)
    encoded = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    received = exchange(address, [CHUNKED_HEAD, *split(encoded, cuts)])
    assert received.startswith(b"HTTP/1.1 200 "), received[:300]


def test_the_replica_still_serves_after_the_fuzzing(address: tuple[str, int]) -> None:
    healthy(address)
