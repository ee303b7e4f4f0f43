"""Run a measurement once per size, each in a fresh interpreter, and print its row.

Resident memory and CPU of a million-object build are only comparable when nothing of a
previous size is left in the process: each size runs as `python -m MODULE --child SIZE`,
which prints the measurement as one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def per_size_main(
    module: str,
    doc: str,
    default_sizes: str,
    measure: Callable[[int], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
) -> None:
    """The command line of such a benchmark: `--sizes`, `--pure` (no compiled accelerator)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sizes", default=default_sizes)
    parser.add_argument("--pure", action="store_true", help="without the compiled accelerator")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    env = dict(os.environ)
    if args.pure:
        env["KVROUTER_NO_EXTENSIONS"] = "1"
    for size in map(int, args.sizes.split(",")):
        out = subprocess.run(
            [sys.executable, "-m", module, "--child", str(size)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            cwd=ROOT,
        ).stdout
        print(describe(json.loads(out)), flush=True)


def rss_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


def full_gc_pass_ms() -> float:
    """What a full pass of the cyclic collector costs now (the best of 3), in ms: how long a
    replica's loop would stall on one with what this process holds alive."""
    pauses = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - start)
    return min(pauses) * 1e3
