"""The consumer's HTTP client for siblings' `GET /internal/kv_snapshot`.

Rules of this file: it turns one request into a decoded body (`PeerBody`) or a reason there is
none, and decides nothing else; whether a body may touch the tree is `peer.vet`'s business,
which peer to ask and how fresh an export to demand is the sweep's.

What it guarantees:
- Its own aiohttp session, the only client in the process that may advertise
  `Accept-Encoding: gzip` (the proxy must not: it relays SSE streams byte for byte). It asks
  for the columnar body first and msgpack second (`Accept: application/vnd.kvrouter.columns,
  application/msgpack;q=0.5`: a sibling that only speaks format 1's JSON and msgpack answers
  msgpack), follows no redirect (a 3xx is no body) and sends the bearer token when one is
  configured.
- No gzip by default. Between replicas on one network the columnar body is copied faster
  than it is compressed: at a million nodes (36 MB) gzip costs the producer ~0.4 s and the
  consumer ~0.15 s to save a transfer of well under that on a 10 Gbit/s pod network
  (bench/bench_bootstrap.py prints both). `gzip=True` asks for it, and every encoding
  honours it.
- Bounded time: connect 10 s, a stall between two body chunks 60 s, and the whole fetch,
  decoding included, within the per-fetch budget.
- Bounded memory: the body as received and its inflated size are each capped at
  `max_body_bytes` (half that for format 1, `body_bound`), counted while streaming; a
  `Content-Length` over the cap is refused before a byte is read, and a gzip bomb is never
  inflated more than a byte past the cap.
  Such a body, and one that does not decode, is `Refused`: unlike a transport failure
  (`Unreachable`), asking again would only bring it again.
- gzip is undone only when `Content-Encoding` is exactly `gzip` (any case); anything else
  is parsed as identity, so a mislabelled body fails to decode rather than being guessed at.
- The loop keeps running, mostly: inflating goes in steps of 1 MiB of output with a yield
  between them; a columnar body decodes in one copy per column (~20 ms at a million nodes);
  a format-1 body is split into the envelope and chunks of nodes. msgspec holds
  the GIL while it decodes, so a worker thread does not help: on a 1M-node body (2-core box
  under load, bench/bench_export.py) one `decode` stalls the loop 1.3-1.5 s on the loop and
  1.2-1.4 s in `asyncio.to_thread`; sliced, the longest stall is 0.18-0.19 s. What is left
  is the envelope pass (every node kept as raw bytes, one call: 0.16-0.24 s) and full
  collections of the cyclic GC, which must traverse the million carrier lists the body
  decodes into.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
import msgspec

from peer.wire import (
    COLUMNS,
    JSON,
    MSGPACK,
    Envelope,
    PeerBody,
    PeerSnapshot,
    WireDecodeError,
    WireNode,
    decode_columns_steps,
    envelope,
    media_type,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 24 * 1024 * 1024  # --kv-bootstrap-max-body-mb default
FORMAT1_SHARE: Final = 0.5  # of the bound, for a JSON or msgpack body (`body_bound`)
DEFAULT_PER_FETCH_S: Final = 30.0
CONNECT_TIMEOUT_S: Final = 10.0
STALL_TIMEOUT_S: Final = 60.0
MAX_AGE_LIMIT_MS: Final = 2**64 - 1
INFLATE_STEP: Final = 1 << 20  # output bytes per zlib call
DECODE_CHUNK: Final = 2048  # nodes per decode call
SLICE_S: Final = 0.002  # decoding work between two yields to the loop
SNAPSHOT_PATH: Final = "/internal/kv_snapshot"
ACCEPT: Final = f"{COLUMNS}, {MSGPACK};q=0.5"  # columns from siblings that have them


@dataclass(frozen=True, slots=True)
class Fetched:
    """A decoded body. `arrived_at` is the clock when the response headers arrived: the
    export it carries was made no later than that."""

    peer: str
    snapshot: PeerBody
    arrived_at: float
    received_bytes: int  # as sent, before inflating


@dataclass(frozen=True, slots=True)
class Unreachable:
    """No body this time: a transport error, a timeout, a non-2xx answer (`status`).
    `connection_refused`: nothing listens at the peer's address (no sibling runs there)."""

    peer: str
    reason: str
    status: int | None = None
    connection_refused: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """A body that was refused as it was read or decoded: over the bound, a gzip bomb, not
    gzip, not a snapshot. Asking again would bring the same: the sweep rejects the peer."""

    peer: str
    reason: str


FetchResult = Fetched | Unreachable | Refused


def snapshot_url(peer_url: str, max_age_ms: int | None) -> str:
    """The full export's URL; no parameter when any age will do. Ages saturate at u64."""
    base = peer_url.rstrip("/") + SNAPSHOT_PATH
    if max_age_ms is None:
        return base
    return f"{base}?max_age_ms={min(max(int(max_age_ms), 0), MAX_AGE_LIMIT_MS)}"


def cursors_url(peer_url: str) -> str:
    return peer_url.rstrip("/") + SNAPSHOT_PATH + "?cursors_only=true"


def body_bound(max_body_bytes: int, content_type: str) -> int:
    """The bound on a body of this type, as received and as inflated.

    Decoded and vetted, a columnar body takes about 6 times its size at its peak, a format-1
    body (JSON, msgpack) 9 to 18 times: its nodes become Python objects. So format 1 gets
    `FORMAT1_SHARE` of the bound, which keeps the worst case near the columnar one's
    (README, "Memory").
    """
    if media_type(content_type) == COLUMNS:
        return max_body_bytes
    return max(1, int(max_body_bytes * FORMAT1_SHARE))


class BodyError(Exception):
    """The body was refused while it was read: too large, or not valid gzip."""


class SnapshotFetcher:
    """Fetches snapshots and cursor tables from siblings. Close it when done."""

    def __init__(
        self,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        per_fetch_s: float = DEFAULT_PER_FETCH_S,
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        accept: str = ACCEPT,
        gzip: bool = False,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        self.max_body_bytes = max_body_bytes
        self.per_fetch_s = per_fetch_s
        self.clock = clock
        self._token = token
        self._connect_s = connect_timeout_s
        self._stall_s = stall_timeout_s
        self._session: aiohttp.ClientSession | None = None
        # Columns without gzip is the default and the fastest; the others are for siblings
        # on slow links and for interop tests.
        self._headers = {"Accept": accept, **({"Accept-Encoding": "gzip"} if gzip else {})}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = dict(self._headers)
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                skip_auto_headers=() if "Accept-Encoding" in headers else ("Accept-Encoding",),
                auto_decompress=False,  # inflated here, with a bound
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._connect_s, sock_read=self._stall_s
                ),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SnapshotFetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def fetch_snapshot(
        self, peer_url: str, max_age_ms: int | None, *, budget_s: float | None = None
    ) -> FetchResult:
        """The peer's full export, no older than `max_age_ms` (None: the peer's default)."""
        return await self._fetch(peer_url, snapshot_url(peer_url, max_age_ms), budget_s)

    async def fetch_cursors(self, peer_url: str, *, budget_s: float | None = None) -> FetchResult:
        """The peer's live cursor table (a body with no nodes)."""
        return await self._fetch(peer_url, cursors_url(peer_url), budget_s)

    async def _fetch(self, peer: str, url: str, budget_s: float | None) -> FetchResult:
        budget = self.per_fetch_s if budget_s is None else budget_s
        try:
            async with asyncio.timeout(budget):
                return await self._get(peer, url, budget)
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):  # aiohttp's connect or stall timeout
                return Unreachable(peer, f"timed out: {exc}")
            return Unreachable(peer, f"no answer within the {budget:g} s budget")
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            return Unreachable(peer, f"transport: {type(exc).__name__}: {exc}", None, refused)
        except (aiohttp.ClientError, OSError) as exc:
            return Unreachable(peer, f"transport: {type(exc).__name__}: {exc}")
        except (BodyError, WireDecodeError) as exc:
            return Refused(peer, str(exc))

    async def _get(self, peer: str, url: str, budget: float) -> FetchResult:
        timeout = aiohttp.ClientTimeout(
            total=budget, connect=self._connect_s, sock_read=self._stall_s
        )
        started = time.perf_counter()
        async with self._client().get(url, allow_redirects=False, timeout=timeout) as resp:
            arrived_at = self.clock()
            if not 200 <= resp.status < 300:
                resp.close()  # do not drain an error page or a redirect's body
                return Unreachable(
                    peer, f"HTTP {resp.status} {resp.reason or ''}".strip(), resp.status
                )
            try:
                body, received = await self._read_body(resp)
            except BodyError:
                resp.close()  # drop the connection instead of draining the rest
                raise
        content_type = resp.headers.get("Content-Type", JSON)
        read = time.perf_counter()
        snapshot = await decode_sliced(body, content_type)
        log.info(
            "kv snapshot from %s: %d nodes, %d B as sent (%s%s) in %.2f s, decoded in %.2f s",
            peer,
            snapshot.node_count,
            received,
            media_type(content_type),
            ", gzip" if resp.headers.get("Content-Encoding", "").strip().lower() == "gzip" else "",
            read - started,
            time.perf_counter() - read,
        )
        return Fetched(peer, snapshot, arrived_at, received)

    async def _read_body(self, resp: aiohttp.ClientResponse) -> tuple[bytearray, int]:
        limit = body_bound(self.max_body_bytes, resp.headers.get("Content-Type", JSON))
        if resp.content_length is not None and resp.content_length > limit:
            raise BodyError(f"body of {resp.content_length} bytes exceeds the {limit}-byte bound")
        encoding = resp.headers.get("Content-Encoding", "").strip().lower()
        inflater = BoundedGunzip(limit) if encoding == "gzip" else None
        body = bytearray()
        received = 0
        async for chunk in resp.content.iter_any():
            received += len(chunk)
            if received > limit:
                raise BodyError(f"body exceeds the {limit}-byte bound")
            if inflater is None:
                body += chunk
            else:
                await inflater.feed(chunk, body)
        if inflater is not None:
            inflater.finish()
        return body, received


class BoundedGunzip:
    """Streaming gunzip that refuses to inflate past `limit` bytes.

    Each zlib call produces at most `INFLATE_STEP` bytes (a few ms) and never more than one
    byte past the bound, with a yield between calls: a bomb costs neither memory nor the loop.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._z = zlib.decompressobj(31)  # gzip container only

    async def feed(self, data: bytes, out: bytearray) -> None:
        z = self._z
        while True:
            if z.eof:
                if data or z.unused_data:
                    raise BodyError("gzip body: data after the end of the stream")
                return
            step = min(INFLATE_STEP, self._limit - len(out) + 1)
            try:
                piece = z.decompress(data, step)
            except zlib.error as exc:
                raise BodyError(f"gzip body: {exc}") from None
            out += piece
            if len(out) > self._limit:
                raise BodyError(f"inflated body exceeds the {self._limit}-byte bound")
            data = z.unconsumed_tail
            if not data and len(piece) < step:
                return  # this input is used up and nothing is pending
            await asyncio.sleep(0)

    def finish(self) -> None:
        if not self._z.eof:
            raise BodyError("gzip body: truncated")
        if self._z.unused_data:
            raise BodyError("gzip body: data after the end of the stream")


# -- decoding in slices ------------------------------------------------------------------


class _Envelope(Envelope, kw_only=True):
    """`PeerSnapshot` with each node left undecoded."""

    nodes: list[msgspec.Raw]


_envelopes = {
    JSON: msgspec.json.Decoder(_Envelope),
    MSGPACK: msgspec.msgpack.Decoder(_Envelope),
}
_node_lists = {
    JSON: msgspec.json.Decoder(list[WireNode]),
    MSGPACK: msgspec.msgpack.Decoder(list[WireNode]),
}


async def decode_sliced(
    body: bytes | bytearray,
    content_type: str,
    *,
    chunk: int = DECODE_CHUNK,
    slice_s: float = SLICE_S,
) -> PeerBody:
    """`peer.wire.decode`, cut so the loop runs between slices of a couple of milliseconds.

    A columnar body is copied column by column, a few MiB at a time. Of a format-1 body the
    envelope is decoded first with every node kept as raw bytes (one call), then the nodes in
    chunks: each chunk's raw nodes are joined into one array and decoded at once.
    """
    kind = media_type(content_type)
    if kind == COLUMNS:
        steps = decode_columns_steps(body)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            await asyncio.sleep(0)
    if kind != MSGPACK:
        kind = JSON
    try:
        env = _envelopes[kind].decode(body)
        raws = env.nodes
        env.nodes = []
        nodes: list[WireNode] = []
        decoder = _node_lists[kind]
        clock = time.perf_counter
        deadline = clock() + slice_s
        for start in range(0, len(raws), chunk):
            part = raws[start : start + chunk]
            if kind == MSGPACK:
                buf = b"\xdd" + struct.pack(">I", len(part)) + b"".join(part)
            else:
                buf = b"[" + b",".join(part) + b"]"
            nodes += decoder.decode(buf)
            if clock() >= deadline:
                await asyncio.sleep(0)
                deadline = clock() + slice_s
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"not a format-1 snapshot body: {exc}") from None
    return PeerSnapshot(**envelope(env), nodes=nodes)
