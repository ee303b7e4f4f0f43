"""The benchmark suite: every benchmark in turn, its figures as JSON, plots and BENCHMARKS.md.

Each benchmark module exposes `run(ctx) -> dict` (its figures, JSON-able), `tables(result) ->
{marker name: markdown}` and `plot(result, plt, out_dir) -> [png paths]`. This file runs them,
writes `bench/results/<name>.json` (the figures plus how and where they were taken), draws the
plots when matplotlib is there, and regenerates the tables between their markers in
BENCHMARKS.md. A benchmark that fails is reported, and the others still run; the exit status
says whether any failed.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench import plots, report
from bench.smg import Smg

ROOT: Final = Path(__file__).resolve().parents[1]
# In the order they run: the cheap in-process ones first, so a broken setup shows early.
NAMES: Final = ("index", "ingest", "routing", "pressure", "proxy", "bootstrap", "scale")
MODULES: Final = {
    "index": "bench.index_figures",
    "ingest": "bench.ingest_zmq",
    "routing": "bench.routing_quality",
    "pressure": "bench.pressure",
    "proxy": "bench.proxy_compare",
    "bootstrap": "bench.bootstrap_compare",
    "scale": "bench.scale",
}


@dataclass
class Context:
    """What every benchmark gets: the scale, where to write, and how to report progress."""

    quick: bool
    results: Path
    smg: Smg
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvbench-")))
    started: float = field(default_factory=time.monotonic)

    def progress(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"[{elapsed:6.1f}s] {message}\n")
        sys.stderr.flush()


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
        "load_average": [round(x, 2) for x in load],
    }


def select(only: Sequence[str]) -> list[str]:
    """The benchmarks to run, in suite order; a ValueError names an unknown one."""
    wanted = [name for item in only for name in item.split(",") if name]
    unknown = sorted(set(wanted) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    return [name for name in NAMES if not wanted or name in wanted]


@dataclass
class Outcome:
    name: str
    seconds: float
    json_path: Path | None = None
    pngs: list[Path] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    error: str | None = None


def run_one(name: str, ctx: Context, markdown: Path | None, plt: Any) -> Outcome:
    module = importlib.import_module(MODULES[name])
    started = time.monotonic()
    ctx.progress(f"== {name}: {module.__doc__.splitlines()[0]}")
    try:
        result = module.run(ctx)
    except Exception as exc:  # one broken benchmark must not hide the others' figures
        traceback.print_exc()
        return Outcome(name, time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - started
    document = {
        "benchmark": name,
        "quick": ctx.quick,
        "command": shlex.join(sys.orig_argv),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(seconds, 1),
        "machine": machine(),
        "result": result,
    }
    out = Outcome(name, seconds)
    out.json_path = ctx.results / f"{name}.json"
    out.json_path.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
    tables: dict[str, str] = module.tables(result)
    if markdown is not None:
        out.tables = report.update_file(markdown, tables)
    for text in tables.values():
        print(text + "\n", flush=True)
    if plt is not None:
        out.pngs = module.plot(result, plt, ctx.results)
    return out


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def run(
    names: Sequence[str],
    quick: bool,
    results: Path,
    markdown: Path | None,
    smg: Smg,
    say: Callable[[str], None] = print,
) -> int:
    """Run `names`; 0 when every one produced figures, 1 otherwise."""
    results.mkdir(parents=True, exist_ok=True)
    ctx = Context(quick=quick, results=results, smg=smg)
    plt = plots.pyplot()
    if plt is None:
        ctx.progress(
            "matplotlib is not installed, so no PNG plots this time (pip install -e '.[bench]'); "
            "JSON and tables are written anyway"
        )
    outcomes = [run_one(name, ctx, markdown, plt) for name in names]
    say("\nsummary")
    for o in outcomes:
        if o.error is not None:
            say(f"  {o.name:<10} FAILED after {o.seconds:.0f} s: {o.error}")
            continue
        made = [str(o.json_path)] + [str(p) for p in o.pngs]
        tables = f"; tables {', '.join(o.tables)} in {markdown}" if o.tables else ""
        say(f"  {o.name:<10} {o.seconds:5.0f} s: {', '.join(made)}{tables}")
    say(f"  total {time.monotonic() - ctx.started:.0f} s{' (--quick)' if quick else ''}")
    if any(ctx.workdir.iterdir()):
        say(f"  the child processes' logs: {ctx.workdir}")
    else:  # no benchmark run started a child process (`--only index`): nothing to keep
        ctx.workdir.rmdir()
    return 1 if any(o.error for o in outcomes) else 0
