"""Giving memory the process freed back to the operating system.

CPython frees a large buffer (an export's columns, ~33 B a block) to the C allocator, and
glibc's allocator keeps freed heap pages resident unless asked: after a replica served a
6M-block export and dropped it at its max_age, ~280 MB stayed in its RSS (bench/scale.py).
`trim` asks glibc to return them (`malloc_trim(0)`, ~1-15 ms on a 2 GB heap). Elsewhere
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Return freed heap pages to the OS; True if the allocator could do it."""
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
