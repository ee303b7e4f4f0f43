"""Run `kvrouter` under cProfile, profiling only a window chosen by signals.

Run: .venv/bin/python bench/profiled_router.py OUT.prof {cpu,wall} serve ... (`kvrouter` args)

SIGUSR1 starts profiling; SIGUSR2 stops it and writes the stats to OUT.prof, and the garbage
collector's work during the window (collections, CPU time and the longest pause, per
generation) to OUT.prof.gc.json; then `OUT.prof.done` appears, so a harness knows both files
are complete. SIGINT / SIGTERM stop the router as usual. Used by bench_proxy.py so that
start-up, imports and warm-up stay out of the profile. cProfile hooks the main thread, which
is where the router's event loop runs; its clock is that thread's CPU time (`cpu`) or
`time.perf_counter` (`wall`).
"""

from __future__ import annotations

import cProfile
import gc
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from router.cli import main


class GcWatch:
    """Per generation: collections, CPU ns, longest pause (ns), while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.started = 0
        self.gens: dict[int, list[int]] = {}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self.started = time.thread_time_ns()
            return
        spent = time.thread_time_ns() - self.started
        gen = self.gens.setdefault(info["generation"], [0, 0, 0])
        gen[0] += 1
        gen[1] += spent
        gen[2] = max(gen[2], spent)

    def report(self) -> dict[str, dict[str, int]]:
        return {
            str(g): {"collections": n, "cpu_ns": total, "max_ns": longest}
            for g, (n, total, longest) in sorted(self.gens.items())
        }


def run() -> None:
    if len(sys.argv) < 4:  # a usage error, not an IndexError
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")  # the Run: line
        sys.exit(2)
    out, clock = Path(sys.argv[1]), sys.argv[2]
    # `cpu`: the event-loop thread's CPU time. A wall-clock profile on a busy machine charges
    # preemption (e.g. right after a loopback send() wakes the receiver) to whatever function
    # was running; the CPU clock does not, but costs a syscall per profiler event.
    if clock == "cpu":
        profile = cProfile.Profile(time.thread_time_ns, 1e-9)
    elif clock == "wall":
        profile = cProfile.Profile()
    else:
        sys.exit(f"clock must be cpu or wall, not {clock!r}")
    watch = GcWatch()
    gc.callbacks.append(watch)

    def start(signum: int, frame: FrameType | None) -> None:
        watch.on = True
        profile.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        watch.on = False
        profile.dump_stats(out)
        Path(f"{out}.gc.json").write_text(json.dumps(watch.report()))
        Path(f"{out}.done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    main(sys.argv[3:])


if __name__ == "__main__":
    run()
