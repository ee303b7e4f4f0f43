"""Which workloads, runs and rows `python -m bench --only pressure` plays: all of them by
default, or as `BENCH_PRESSURE_WORKLOADS`, `BENCH_PRESSURE_RUNS` and `BENCH_PRESSURE_ROWS`
narrow them (bench/pressure.py `selected`, `selected_rows`)."""

from __future__ import annotations

import pytest

from bench.pressure import (
    FULL,
    MAX_RUNS,
    MAX_UNSEEN,
    QUICK,
    ROWS,
    judged,
    selected,
    selected_rows,
    verdict,
)
from bench.pressure_sim import tailed_shapes, unseen_shapes


def test_without_the_environment_the_full_and_quick_sets_run_as_before() -> None:
    full, runs = selected(False, {})
    assert [w.name for w in full] == list(FULL) and runs == 3
    quick, runs = selected(True, {})
    assert [w.name for w in quick] == list(QUICK) and runs == 1
    assert selected_rows({}) == list(ROWS)


def test_the_environment_names_workloads_in_its_order_holdouts_included_and_the_runs() -> None:
    env = {
        "BENCH_PRESSURE_WORKLOADS": " 6w-30p-c16-3rep, 4w-20p-cyclic-3rep ",
        "BENCH_PRESSURE_RUNS": "7",
    }
    chosen, runs = selected(False, env)
    assert [w.name for w in chosen] == ["6w-30p-c16-3rep", "4w-20p-cyclic-3rep"]
    assert chosen[0].replicas == 3 and chosen[0].concurrency == 16  # the holdout's shape
    assert runs == 7
    # --quick's one run gives way to an explicit count too
    assert selected(True, {"BENCH_PRESSURE_RUNS": "2"})[1] == 2


def test_unseen_shapes_are_drawn_by_count_and_seed_after_the_named_workloads() -> None:
    chosen, _ = selected(False, {"BENCH_PRESSURE_UNSEEN": "3:7"})
    assert chosen == unseen_shapes(3, 7)
    chosen, _ = selected(False, {"BENCH_PRESSURE_UNSEEN": "2"})
    assert chosen == unseen_shapes(2, 2026)
    env = {"BENCH_PRESSURE_WORKLOADS": "6w-30p-c16-3rep", "BENCH_PRESSURE_UNSEEN": "2:5"}
    chosen, _ = selected(False, env)
    assert [w.name for w in chosen] == ["6w-30p-c16-3rep", *(w.name for w in unseen_shapes(2, 5))]


def test_tailed_shapes_are_drawn_after_the_unseen_ones() -> None:
    env = {"BENCH_PRESSURE_UNSEEN": "2:5", "BENCH_PRESSURE_TAILED": "3:7"}
    chosen, _ = selected(False, env)
    assert chosen == unseen_shapes(2, 5) + tailed_shapes(3, 7)
    chosen, _ = selected(False, {"BENCH_PRESSURE_TAILED": "2"})
    assert chosen == tailed_shapes(2, 2026)


def test_a_drawn_shape_named_runs_alone_of_its_draw() -> None:
    drawn = [w.name for w in unseen_shapes(3, 7)]
    env = {"BENCH_PRESSURE_WORKLOADS": drawn[1], "BENCH_PRESSURE_UNSEEN": "3:7"}
    chosen, _ = selected(False, env)
    assert [w.name for w in chosen] == [drawn[1]]
    env["BENCH_PRESSURE_WORKLOADS"] = f"3w-9p-cyclic,{drawn[2]}"
    chosen, _ = selected(False, env)
    assert [w.name for w in chosen] == ["3w-9p-cyclic", drawn[2]]


def test_rows_keep_the_table_order_whatever_order_they_are_named_in() -> None:
    env = {"BENCH_PRESSURE_ROWS": "kvrouter cache_aware,ideal partition"}
    assert selected_rows(env) == [("ideal", "partition"), ("kvrouter", "cache_aware")]


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"BENCH_PRESSURE_WORKLOADS": "3w-9p-cyclic,nope"}, "BENCH_PRESSURE_WORKLOADS: nope;"),
        ({"BENCH_PRESSURE_WORKLOADS": "3w-9p-cyclic,3w-9p-cyclic"}, "a name twice"),
        ({"BENCH_PRESSURE_RUNS": "0"}, "BENCH_PRESSURE_RUNS: '0'"),
        ({"BENCH_PRESSURE_RUNS": str(MAX_RUNS + 1)}, f"1-{MAX_RUNS}"),
        ({"BENCH_PRESSURE_RUNS": "-2"}, "whole number"),
        ({"BENCH_PRESSURE_RUNS": "2.5"}, "whole number"),
        ({"BENCH_PRESSURE_UNSEEN": "0"}, "BENCH_PRESSURE_UNSEEN: '0'"),
        ({"BENCH_PRESSURE_UNSEEN": str(MAX_UNSEEN + 1)}, f"1-{MAX_UNSEEN}"),
        ({"BENCH_PRESSURE_UNSEEN": "3:x"}, "N or N:SEED"),
        ({"BENCH_PRESSURE_UNSEEN": "many"}, "whole number"),
        ({"BENCH_PRESSURE_TAILED": "0"}, "BENCH_PRESSURE_TAILED: '0'"),
        ({"BENCH_PRESSURE_TAILED": "2:y"}, "N or N:SEED"),
    ],
)
def test_a_malformed_selection_is_refused_naming_the_problem(
    env: dict[str, str], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")) as err:
        selected(False, env)
    assert "choose" in str(err.value) or "whole number" in str(err.value)


def test_an_unknown_row_is_refused_with_the_labels_to_choose_from() -> None:
    with pytest.raises(ValueError, match="BENCH_PRESSURE_ROWS: kvrouter magic; choose among"):
        selected_rows({"BENCH_PRESSURE_ROWS": "ideal partition,kvrouter magic"})


def result_of(name: str, ideal: float | None, ours: float | None, smg: float | None) -> dict:
    rows = [
        ("ideal", "partition", ideal),
        ("kvrouter", "cache_aware", ours),
        ("smg", "cache_aware", smg),
    ]
    return {
        "workload": {"name": name},
        "rows": [{"router": r, "policy": p, "ratio": x} for r, p, x in rows],
    }


def test_a_workload_is_judged_against_the_ideal_unless_the_ideal_cached_nothing() -> None:
    assert judged(result_of("w", 0.5, 0.49, 0.4)) == (pytest.approx(0.98), True, True)
    assert judged(result_of("w", 0.5, 0.48, 0.49)) == (pytest.approx(0.96), False, False)
    assert judged(result_of("w", 0.0, 0.01, 0.0)) == (None, None, None)  # tails ate the caches
    assert judged(result_of("w", 0.5, None, 0.4)) == (None, None, None)
    text = verdict([result_of("a", 0.5, 0.49, 0.4), result_of("b", 0.0, 0.01, 0.0)])
    assert "every workload: met" in text and "cached nothing): b." in text
