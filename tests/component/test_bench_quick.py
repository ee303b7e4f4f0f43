"""`python -m bench --quick` end to end, as a user runs it: a real process writing JSON, tables
in a Markdown file between markers (its prose kept) and, where matplotlib is installed, PNGs.

Only the `index` benchmark runs here (about ten seconds); the others start fleets of processes
and take a minute each, so they are exercised by running `python -m bench --quick` by hand.
Figures are checked to be numbers, never against a speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


@pytest.mark.timeout(180)
def test_quick_index_run_writes_figures_tables_and_keeps_the_prose(tmp_path: Path) -> None:
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text(
        "# Benchmarks\n\nHand-written.\n\n<!-- bench:index-apply -->\nstale\n"
        "<!-- /bench:index-apply -->\n\nAfter.\n"
    )
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "bench", "--quick", "--only", "index", "--no-smg"]
    argv += ["--results", str(results), "--markdown", str(markdown)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]

    document = json.loads((results / "index.json").read_text())
    assert document["benchmark"] == "index" and document["quick"] is True
    result = document["result"]
    assert {a["mix"] for a in result["apply"]} == {"store only", "store + evict"}
    assert all(a["blocks_per_s"] > 0 for a in result["apply"])
    assert [(d["prompt_tokens"], d["ranks"]) for d in result["prefix_depths"]] == [
        (2000, 16),
        (2000, 64),
    ]
    assert [s["blocks"] for s in result["snapshot"]] == [100_000]
    figures = _numbers(result)
    assert figures and all(math.isfinite(x) for x in figures)

    text = markdown.read_text()
    assert "Hand-written." in text and "After." in text and "stale" not in text
    block = text.split("<!-- bench:index-apply -->")[1].split("<!-- /bench:index-apply -->")[0]
    assert "decode + key + apply, store only" in block
    assert "<!-- bench:index-depths -->" in text and "<!-- bench:index-snapshot -->" in text
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (results / "index.png").exists() == has_matplotlib
    if not has_matplotlib:
        assert "matplotlib is not installed" in done.stderr


def test_kvrouter_bench_runs_python_m_bench_and_passes_its_flags_on() -> None:
    kvrouter = Path(sys.executable).parent / "kvrouter"
    done = subprocess.run(
        [str(kvrouter), "bench", "--only", "nope"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.startswith(
        "kvrouter bench: error: unknown benchmark(s) nope; "
        "known: index, ingest, routing, pressure, proxy, bootstrap"
    )
    # Its usage names the command that was run, not `python -m bench`.
    done = subprocess.run(
        [str(kvrouter), "bench", "--nope"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kvrouter bench ")
    assert "kvrouter bench: error: unrecognized arguments: --nope" in done.stderr


def test_a_results_directory_that_cannot_be_made_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench.__main__ import main

    assert main(["--quick", "--results", "/proc/kvrouter-nope/results"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrouter bench: error: --results /proc/kvrouter-nope/results:"), err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pure", [False, True])
def test_tree_memory_measures_each_size_in_its_own_process(pure: bool) -> None:
    argv = [sys.executable, "-m", "bench.tree_memory", "--sizes", "4000,8000"]
    done = subprocess.run(
        argv + (["--pure"] if pure else []), cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    # one row per size, each from a child that built exactly that many blocks on the asked layout
    assert [r.split()[1] for r in rows] == ["4,000", "8,000"]
    assert {r.split()[0] for r in rows} == ({"pure"} if pure else {"compiled"})
    assert "5,000 pairs" in rows[0] and "10,000 pairs" in rows[1]  # 1.25 pairs a block
    assert all("B/block" in r for r in rows)


@pytest.mark.parametrize(
    ("shapes", "names"),
    [
        ([], ["distinct", "shared prefix"]),  # the default pair
        (
            ["--shape", "conversations", "--shape", "system prompts"],
            ["conversations", "system prompts"],
        ),
    ],
)
def test_bench_ledger_prints_the_cost_of_each_prompt_shape(
    shapes: list[str], names: list[str]
) -> None:
    argv = [sys.executable, "bench/bench_ledger.py", "--requests", "700", "--repeats", "1"]
    done = subprocess.run(argv + shapes, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    assert [r.split(":")[0].strip() for r in rows] == names
    costs = [re.search(r"settle \+ record\s+([\d.]+) us per request", r) for r in rows]
    assert all(m is not None and float(m.group(1)) > 0 for m in costs), rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pure", "cold"), [(False, False), (True, True)])
def test_index_runs_times_each_run_on_an_index_of_the_asked_size(pure: bool, cold: bool) -> None:
    argv = [sys.executable, "-m", "bench.index_runs", "--blocks", "20000", "--rounds", "1"]
    argv += ["--pure"] if pure else []
    argv += ["--cold"] if cold else []
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    # 317 chains of 63 blocks: the index was built to the size asked, on the layout asked
    layout = "pure" if pure else "compiled"
    assert f"index of 19,971 blocks, {layout}" in done.stdout
    assert ("refilling the CPU caches" in done.stdout) == cold
    rows = {r.split("|")[1].strip(): r.split("|")[2] for r in done.stdout.splitlines() if "|" in r}
    steps = ("store 63", "remove 63", "prefix_depths 125", "ledger record 125")
    for step in (*steps, "ledger record 125, ranks in turn"):
        assert float(rows[step].split()[0]) > 0, done.stdout


@pytest.mark.timeout(120)
def test_ledger_memory_measures_a_ledger_of_the_asked_size_in_its_own_process() -> None:
    argv = [sys.executable, "-m", "bench.ledger_memory", "--sizes", "5000,10000"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    # two rows per size, each from a child whose ledger tracks exactly that many pairs, then
    # books as many blocks (the bookings' own bound)
    demand, booked = rows[0::2], rows[1::2]
    assert [r.split()[1] for r in demand] == ["5,000", "10,000"]
    assert all("B/pair" in r and "full GC pass" in r for r in demand)
    assert [r.split()[1:3] for r in booked] == [["5,000", "booked"], ["10,000", "booked"]]
    assert all("B/pair" in r and "after they expired" in r for r in booked)


@pytest.mark.timeout(120)
async def test_bench_bootstrap_measures_a_new_replica_that_accepted_the_whole_warm_view(
    tmp_path: Path,
) -> None:
    """At 10,000 blocks a rank of the fill carries 5,008: fake workers of the default 4,096
    blocks had the new replica reject the snapshot as over capacity, and the bench printed
    its cold start (share 0%) as the bootstrap's figures."""
    from bench import bench_bootstrap

    args = argparse.Namespace(profile_dir=None, log_dir=None, quick=False)
    r = await bench_bootstrap.run_size(10_000, args, tmp_path)
    assert r.snapshot_outcomes == {"accepted": 1}, r.lines
    assert (r.pairs, r.share, r.not_bootstrapped()) == (12_504, 1.0, None)


def test_bench_bootstrap_names_a_size_whose_new_replica_did_not_accept_the_snapshot() -> None:
    from bench.bench_bootstrap import Result

    rejected = Result(10_000, snapshot_outcomes={"rejected": 1}).not_bootstrapped()
    assert rejected is not None and "10,000 blocks" in rejected and "rejected 1" in rejected
    assert Result(10_000).not_bootstrapped() is not None  # never fetched: no outcome at all
    retried = Result(10_000, snapshot_outcomes={"accepted": 1, "unreachable": 2})
    assert retried.not_bootstrapped() is not None


@pytest.mark.timeout(120)
def test_relay_instructions_child_answers_the_proxy_workloads_requests(tmp_path: Path) -> None:
    """The child that callgrind counts, without callgrind: two fake workers, a replica and the
    load on the proxy benchmark's bodies read from a file (`--workload proxy`); it exits 0 only
    when every request was answered 200, and leaves without a teardown."""
    from bench import relay_instructions

    requests = 40
    bodies = tmp_path / "bodies"
    wanted = relay_instructions.WARMUP + requests + 32
    bodies.write_bytes(relay_instructions.SEPARATOR.join(relay_instructions.proxy_requests(wanted)))
    argv = [sys.executable, str(ROOT / "bench" / "relay_instructions.py"), "--child"]
    argv += ["cache_aware", "--requests", str(requests), "--bodies", str(bodies)]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stub", "cache_blocks"), [(None, 200_000), ("book", 200_000), (None, 600)]
)
def test_request_stages_child_prints_each_stage_of_a_request(
    stub: str | None, cache_blocks: int
) -> None:
    """One run of `bench/request_stages.py`'s child: five figures, us a request, the stages
    (route, ingest, the rest) adding up to the loop thread's time; with small caches the
    index holds no more than they do (the workers evicted, and the replica ingested it)."""
    from bench import request_stages

    code, held = request_stages.run(ROOT, 60, stub, cache_blocks)
    assert len(code) == len(request_stages.FIGURES) and all(f > 0 for f in code)
    loop_thread, route, ingest, rest, _ = code
    assert math.isclose(route + ingest + rest, loop_thread, abs_tol=0.2)
    # 260 prompts of 125 blocks below 8 shared system prompts of 62 over two workers
    assert held <= 2 * cache_blocks if cache_blocks < 1_000 else held > 10_000


@pytest.mark.timeout(120)
def test_request_stages_child_serves_another_policy() -> None:
    """`--policy round_robin`: a replica that keeps no index, so it ingests nothing."""
    from bench import request_stages

    figures, held = request_stages.run(ROOT, 60, None, 200_000, "round_robin")
    loop_thread, route, ingest, rest, hot = figures
    assert ingest == 0 and held == 0 and min(loop_thread, route, rest, hot) > 0
    assert math.isclose(route + rest, loop_thread, abs_tol=0.2)


def _descendants(pid: int) -> set[int]:
    """Every process whose parent chain leads to `pid` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.timeout(120)
def test_sigterm_to_kvrouter_bench_stops_the_fleet_it_started() -> None:
    """`kvrouter bench` waited on `python -m bench` in a child process: SIGTERM killed the
    wrapper and left the run, and the fake workers and replicas it had started, running."""
    kvrouter = Path(sys.executable).parent / "kvrouter"
    argv = [str(kvrouter), "bench", "--quick", "--only", "proxy", "--no-smg", "--no-markdown"]
    run = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        started: set[int] = set()
        for _ in range(600):  # until the run has started processes of its own (60 s at most)
            started = _descendants(run.pid)
            if started or run.poll() is not None:
                break
            time.sleep(0.1)
        assert started, "the benchmark started no process"
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        deadline = time.monotonic() + 20  # a quick proxy run lasts minutes
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)]
    finally:
        if run.poll() is None:
            run.kill()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.timeout(120)
def test_ctrl_c_to_request_stages_stops_its_child_and_the_fake_workers() -> None:
    """Ctrl-C to `python -m bench.request_stages`: `subprocess.run` killed its `--child`, whose
    `finally` that stops the two fake workers never ran, and they kept running."""
    argv = [sys.executable, "-m", "bench.request_stages", "--rounds", "1", "--requests", "3000"]
    run = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Ctrl-C's SIGINT as a terminal has it, even where this test was started with it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        started: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and run.poll() is None:
            started = _descendants(run.pid)
            if sum("fake-kv-worker" in _cmdline(p) for p in started) == 2:
                break
            time.sleep(0.1)
        assert sum("fake-kv-worker" in _cmdline(p) for p in started) == 2, "no workers started"
        run.send_signal(signal.SIGINT)
        run.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [(p, _cmdline(p)) for p in started if _alive(p)]
    finally:
        if run.poll() is None:
            run.kill()
        for p in started:
            if _alive(p):
                os.kill(p, signal.SIGTERM)  # a failed run's strays


@pytest.mark.timeout(60)
def test_a_baseline_git_does_not_know_ends_the_run_at_once_with_gits_message(
    tmp_path: Path,
) -> None:
    """`--baseline nosuchrev` ran the benchmark's own side first (ingest_churn: its workloads,
    ~15 s), then died with a CalledProcessError traceback that kept git's message to itself."""
    from bench.bench_proxy import checkout

    argv = [sys.executable, "-m", "bench.ingest_churn", "--baseline", "nosuchrev"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "'nosuchrev' is not a commit of" in done.stderr
    assert "Needed a single revision" in done.stderr  # git's own words
    assert done.stdout == ""  # no workload was made
    with pytest.raises(SystemExit) as exited:
        checkout("nosuchrev", tmp_path / "old")
    assert exited.value.code == 2 and not (tmp_path / "old").exists()


@pytest.mark.timeout(60)
def test_bench_ingest_help_prints_its_usage_without_running() -> None:
    """`bench_ingest.py --help` ran the benchmark (it read no arguments)."""
    argv = [sys.executable, str(ROOT / "bench" / "bench_ingest.py"), "--help"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr
    assert "blocks/s" not in done.stdout  # the figures' unit: nothing was measured


@pytest.mark.timeout(60)
def test_profiled_router_without_arguments_says_how_to_run_it() -> None:
    """It was an IndexError traceback."""
    argv = [sys.executable, str(ROOT / "bench" / "profiled_router.py")]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("Run: ") and "OUT.prof {cpu,wall}" in done.stderr
