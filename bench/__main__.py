"""`python -m bench` (or `kvrouter bench`): run the benchmarks side by side.

    python -m bench                       # everything, full scale (~11 minutes here)
    python -m bench --quick               # everything, small scale (under 2 minutes)
    python -m bench --only index,routing  # a subset (repeatable, comma-separated)

Figures go to bench/results/<name>.json, plots to bench/results/*.png (with the `bench` extra),
and the tables to BENCHMARKS.md between their `<!-- bench:NAME -->` markers. smg rows need smg
from PyPI, installed on first use into bench/results/smg-venv; `--no-smg` leaves them out.
Run from the repository root (the benchmarks start `fake-kv-worker` and `kvrouter` processes
from this environment).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Final

from bench import suite
from bench.smg import from_environment

PROG: Final = "kvrouter bench"  # the name operators run it by (`python -m bench` is the same)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks: " + ", ".join(suite.NAMES),
    )
    parser.add_argument("--quick", action="store_true", help="small scale, under 2 minutes")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="run only these benchmarks"
    )
    parser.add_argument("--no-smg", action="store_true", help="leave out the smg rows")
    parser.add_argument(
        "--results", type=Path, default=suite.ROOT / "bench" / "results", help="JSON and PNG here"
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="regenerate the tables in this file (default: BENCHMARKS.md, except with --quick)",
    )
    parser.add_argument(
        "--no-markdown", action="store_true", help="print the tables, leave BENCHMARKS.md alone"
    )
    return parser.parse_args(argv)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the runs' `finally` blocks stop the processes they started


def main(argv: list[str] | None = None) -> int:
    # SIGTERM ends a run as Ctrl-C does: killed outright, it left its fleet running.
    signal.signal(signal.SIGTERM, _interrupted)
    args = parse(argv)
    try:
        names = suite.select(args.only)
    except ValueError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    try:
        args.results.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # before any run starts a fleet or makes its work directory
        sys.stderr.write(f"{PROG}: error: --results {args.results}: {exc.strerror or exc}\n")
        return 2
    smg = from_environment()
    if args.no_smg:
        smg.skip("left out with --no-smg")
    return suite.run(names, args.quick, args.results, tables_file(args), smg)


def tables_file(args: argparse.Namespace) -> Path | None:
    """Where the run's tables go: None prints them only.

    Quick figures are a smoke test at a smaller scale: they never replace the full run's
    tables in BENCHMARKS.md unless a file is named with --markdown.
    """
    if args.no_markdown:
        return None
    if args.markdown is not None:
        return args.markdown
    return None if args.quick else suite.ROOT / "BENCHMARKS.md"


if __name__ == "__main__":
    raise SystemExit(main())
