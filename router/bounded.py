"""Reading an HTTP answer from another server (a worker, a sibling) within a size bound."""

from __future__ import annotations

import aiohttp


async def read_up_to(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body, or its first `limit` + 1 bytes when it is longer (enough to refuse it):
    `read(n)` returns what has arrived so far, which is not all of an answer that came in two
    segments. What is read is the decoded body, so a compressed one is bounded as it inflates
    (0.5 MB of gzip inflating to 512 MB was read whole)."""
    body = bytearray()
    while len(body) <= limit:
        chunk = await content.read(limit + 1 - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)
