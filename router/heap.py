"""Giving memory the process freed back to the operating system.

CPython frees a large buffer (an export's columns, ~33 B a block) to the C allocator, and
glibc's allocator keeps freed heap pages resident unless asked: after a replica served a
6M-block export and dropped it at its max_age, ~280 MB stayed in its RSS (bench/scale.py).
`trim` asks glibc to return them (`malloc_trim(0)`, ~1-15 ms on a 2 GB heap). Elsewhere
(musl, macOS) it does nothing.

`trim` only returns what is free when it runs, and a buffer can be freed later than the
export that made it expires (a response still being written, a frame in a cycle the
collector has not reached). glibc also raises its mmap threshold each time a mapped block is
freed, up to 32 MiB, and the index's tables free large mapped blocks whenever they grow: past
that, buffers below 32 MiB (most of an export's columns, every intermediate size of an array
growing) come from the heap, where freeing them returns nothing. `configure` pins the
threshold at `MMAP_THRESHOLD` (which also stops the dynamic adjustment): a buffer of 1 MiB or
more is then its own mapping, handed back to the OS the moment it is freed, whenever that is.
Costs a mmap/munmap pair per such buffer, a few microseconds; the event loop makes few.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def configure() -> bool:
    """Serve every allocation of `MMAP_THRESHOLD` bytes or more from its own mapping (glibc;
    elsewhere nothing). True if the allocator took the setting."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> bool:
    """Return freed heap pages to the OS; True if the allocator could do it."""
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
