"""`router.heap`: freed big buffers go back to the OS, whenever they are freed (glibc)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from router import heap

# In a fresh process: a 30 MiB buffer freed (glibc then raises its mmap threshold to 30 MiB,
# as after the index's tables grow), then a 20 MiB buffer made, touched and freed, with no
# trim: how many MiB of RSS it leaves behind.
CHILD = """
import sys
from router import heap
if sys.argv[1] == "configured":
    assert heap.configure()
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
big = bytearray(30 << 20)
del big
before = rss()
buf = b"x" * (20 << 20)
del buf
print(rss() - before)
"""


def left_behind_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
    reason="the mmap threshold is glibc's",
)
def test_a_big_buffer_freed_without_a_trim_leaves_nothing_once_configured() -> None:
    assert left_behind_mib("default") > 15  # what happened to exports freed after the trim
    assert left_behind_mib("configured") < 2


def test_heap_calls_answer_on_this_platform() -> None:
    assert heap.trim() in (True, False)
    assert heap.configure() in (True, False)
