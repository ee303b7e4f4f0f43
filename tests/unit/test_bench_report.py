"""The table regeneration behind `python -m bench`: hand-written prose stays, only marked
blocks change, and a broken marker changes nothing."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import pytest

from bench import plots, suite
from bench.__main__ import parse, tables_file
from bench.report import MarkerError, cell, regenerate, table, update_file
from bench.smg import Smg

DOC = """# Benchmarks

Prose written by hand.

<!-- bench:routing -->
| old | table |
<!-- /bench:routing -->

More prose, kept as it is.

<!-- bench:proxy-cpu -->
old proxy table
<!-- /bench:proxy-cpu -->
"""


def test_regenerating_replaces_only_the_named_blocks_and_keeps_the_prose() -> None:
    out = regenerate(DOC, {"routing": "| new | table |\n|---|---:|\n| a | 1 |"})
    assert "| old | table |" not in out
    assert "| new | table |\n|---|---:|\n| a | 1 |" in out
    assert "Prose written by hand." in out and "More prose, kept as it is." in out
    assert "old proxy table" in out  # not named: untouched
    assert out.index("<!-- bench:routing -->") < out.index("| new | table |")
    assert out.index("| a | 1 |") < out.index("<!-- /bench:routing -->")


def test_regenerating_twice_gives_the_same_document() -> None:
    tables = {"routing": "| x |\n|---|", "proxy-cpu": "| y |\n|---|"}
    once = regenerate(DOC, tables)
    assert regenerate(once, tables) == once


def test_a_table_without_markers_is_appended_under_a_heading_once() -> None:
    out = regenerate(DOC, {"ingest-ramp": "| r |\n|---|"})
    assert out.count("<!-- bench:ingest-ramp -->") == 1
    assert out.index("## Generated tables without a place yet") < out.index("| r |")
    assert regenerate(out, {"ingest-ramp": "| s |\n|---|"}).count("bench:ingest-ramp") == 2


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("<!-- bench:routing -->\nno end\n", "never closed"),
        ("<!-- /bench:routing -->\n", "closes nothing"),
        ("<!-- bench:a -->\n<!-- /bench:a -->\n<!-- bench:a -->\n<!-- /bench:a -->\n", "twice"),
    ],
)
def test_a_broken_marker_is_an_error_and_leaves_the_file_unchanged(
    tmp_path: Path, broken: str, message: str
) -> None:
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(broken)
    with pytest.raises(MarkerError, match=message):
        update_file(path, {"routing": "| x |"})
    assert path.read_text() == broken


def test_a_marker_name_outside_the_alphabet_is_refused() -> None:
    with pytest.raises(MarkerError, match="not a marker name"):
        regenerate(DOC, {"Routing Table": "x"})


def test_cells_show_numbers_with_separators_and_missing_values_as_a_dash() -> None:
    assert cell(1234567) == "1,234,567"
    assert cell(1234.567) == "1,234.57"
    assert cell(None) == "-" and cell(math.nan) == "-"
    assert cell("a|b") == "a\\|b"
    assert table(["a", "b"], [["x", 1.5]], digits=1) == "| a | b |\n|---|---:|\n| x | 1.5 |"
    with pytest.raises(ValueError, match="2 columns"):
        table(["a", "b"], [["only one"]])


def test_selecting_benchmarks_keeps_suite_order_and_names_unknown_ones() -> None:
    assert suite.select([]) == list(suite.NAMES)
    assert suite.select(["bootstrap,index", "routing"]) == ["index", "routing", "bootstrap"]
    with pytest.raises(ValueError, match="unknown benchmark\\(s\\) nope"):
        suite.select(["index,nope"])


def test_without_matplotlib_there_is_no_pyplot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like
    assert plots.pyplot() is None


def test_a_quick_run_leaves_benchmarks_md_alone_unless_a_file_is_named(tmp_path: Path) -> None:
    full = suite.ROOT / "BENCHMARKS.md"
    named = tmp_path / "B.md"
    assert tables_file(parse([])) == full
    assert tables_file(parse(["--quick"])) is None
    assert tables_file(parse(["--quick", "--markdown", str(named)])) == named
    assert tables_file(parse(["--markdown", str(named), "--no-markdown"])) is None


def test_the_chat_rows_table_shows_each_router_and_the_tokenize_share() -> None:
    from bench import bench_proxy as bp
    from bench.chat_proxy import (
        CACHE_OFF,
        CACHE_ON,
        FLOOR,
        ChatMeasured,
        ChatRound,
        FleetFigures,
        chat_table,
        figures_json,
    )

    def fleet(label: str, cpu_s: float) -> FleetFigures:
        f = FleetFigures(label, rounds=[ChatRound(100, 1.0, cpu_s, 0.5) for _ in range(3)])
        f.loaded = bp.LoadResult([5.0] * 300, 0, 300 * 2000)
        f.direct, f.routed = bp.LoadResult([4.0] * 10), bp.LoadResult([5.0] * 10)
        if label != FLOOR:
            f.counters = {
                "kvrouter_matched_blocks_sum": 1400.0,
                "kvrouter_matched_blocks_count": 10.0,
                "kvrouter_tokenize_cache_lookups_total:hit": 9.0,
                "kvrouter_tokenize_cache_lookups_total:miss": 1.0,
            }
        return f

    measured = ChatMeasured(
        "a model",
        [fleet(CACHE_ON, 0.1), fleet(CACHE_OFF, 0.4), fleet(FLOOR, 0.02)],
        {"cache on": [500.0], "cache off": [3000.0], "bare encode": [2500.0]},
        [2000, 3000],
        300,
        32,
        3,
    )
    text = chat_table(figures_json(measured))
    on = next(line for line in text.splitlines() if line.startswith(f"| {CACHE_ON} |"))
    assert "1,000 [1,000-1,000]" in on and "500 (50%)" in on and "| 1.00 |" in on
    off = next(line for line in text.splitlines() if line.startswith(f"| {CACHE_OFF} |"))
    assert "3,000 (75%)" in off
    floor = next(line for line in text.splitlines() if line.startswith(f"| {FLOOR} |"))
    assert "| - |" in floor
    assert "20.0% of a bare encode" in text and "segment cache hit rate 90.0%" in text


def test_proxy_ab_pairs_each_round_with_its_peer_in_the_same_round() -> None:
    from bench.proxy_ab import paired

    # A slow second round slows both targets: paired, it does not show as a difference.
    assert paired([100.0, 200.0, 150.0], [100.0, 200.0, 100.0]) == "1.00x [1.00-1.50]"
    assert paired([90.0, 10.0], [100.0, 0.0]) == "0.90x [0.90-0.90]"  # a peer at 0 is skipped
    assert paired([], []) == ""


def test_the_router_steps_timing_decodes_and_applies_every_ingest_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Its BlockStored events once carried the bytes tokenizer's bytes as token ids, which the
    # decoder rejects as an engine's would: `kvrouter bench` failed after its measurements.
    from bench import bench_proxy as bp

    steps = dict(bp.time_steps(bp.Prompts(), repeats=1, iterations=3))
    assert len(steps) == 10
    assert all(us > 0 for us in steps.values())
    assert "did not apply" not in capsys.readouterr().err


def test_a_run_whose_benchmarks_start_no_process_leaves_no_empty_log_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every run left an empty /tmp/kvbench-* behind, `--only index` (no child process) too.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    said: list[str] = []
    status = suite.run([], True, tmp_path / "results", None, Smg(tmp_path / "smg"), said.append)
    assert status == 0
    assert list(tmp.iterdir()) == []
    assert not any("logs" in line for line in said)  # no folder to point at
