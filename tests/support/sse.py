"""Reading a server-sent-events body as a client does: the first event, then the `data:` lines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from fake_kv_worker.protocol import filler_text


def sse_data(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


def sse_events(body: bytes) -> list[bytes]:
    """An SSE body's events as the OpenAI SDK splits them (its `SSEDecoder`: lines joined
    until they end with a blank line's CR CR, LF LF or CRLF CRLF); a last one not ended is
    not an event."""
    events, pending = [], b""
    for line in body.splitlines(keepends=True):
        pending += line
        if pending.endswith((b"\r\r", b"\n\n", b"\r\n\r\n")):
            events.append(pending.strip())
            pending = b""
    return events


async def first_event(resp: aiohttp.ClientResponse, within_s: float = 10.0) -> bytes:
    """Read up to the end of the first SSE event; returns the bytes read."""
    read = b""
    while not read.endswith(b"\n\n"):
        line = await asyncio.wait_for(resp.content.readline(), within_s)
        assert line, "the stream ended before its first event"
        read += line
    return read


def assert_complete_completion(raw: bytes, max_tokens: int) -> None:
    """A fake worker's whole `/v1/completions` stream: every token, the finish reason, [DONE]."""
    events = sse_data(raw)
    assert events[-1] == b"[DONE]", events[-3:]
    chunks: list[Any] = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == max_tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == filler_text(max_tokens)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
