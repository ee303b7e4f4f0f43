"""`bench/bench_vet.py` run as a user runs it, at a small size: every case completes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_vet_bench_runs_its_unknown_rank_cases_and_prunes_only_that_ranks_carriers() -> None:
    """Its "one rank of four unknown" cases named a dp rank that a known worker does not
    have, which vetting refuses (`unknown_rank`): the bench died there with a VetError."""
    argv = [sys.executable, "bench/bench_vet.py", "--sizes", "2000"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2,000 nodes, 2,504 carriers" in done.stdout
    # 250 chains of 8 blocks; the unknown rank alone carries one chain in four (62 of them).
    assert "-> 1,504 carried + 0 structure nodes" in done.stdout
    assert "vet columns, one rank of four unknown" in done.stdout
