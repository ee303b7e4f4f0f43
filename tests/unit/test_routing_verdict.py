"""The routing-quality verdict: judged on median ratios, and honest about overlapping runs."""

from __future__ import annotations

from typing import Any

from bench.routing_quality import verdict


def row(router: str, policy: str, ratios: list[float]) -> dict[str, Any]:
    ordered = sorted(ratios)
    return {
        "router": router,
        "policy": policy,
        "ratio": ordered[len(ordered) // 2],
        "ratios": ratios,
    }


def result(*rows: dict[str, Any]) -> dict[str, Any]:
    return {"bound": {"ratio": 0.762}, "rows": list(rows)}


def test_a_median_above_every_row_is_met_and_an_overlapping_row_is_named() -> None:
    out = verdict(
        result(
            row("kvrouter", "cache_aware", [0.751, 0.757, 0.759]),
            row("kvrouter", "round_robin", [0.275, 0.279, 0.291]),
            row("smg", "cache_aware", [0.716, 0.748, 0.757]),
        )
    )
    assert out == (
        "Target: cache_aware holds 0.757 (median of 3 runs) against the bound's 0.762: 0.7% "
        "below it (target within 5%: met); above every other row: met, though the runs of smg "
        "cache_aware overlap its range."
    )


def test_a_row_with_a_median_as_high_is_named_as_beating_cache_aware() -> None:
    out = verdict(
        result(
            row("kvrouter", "cache_aware", [0.70, 0.72, 0.73]),
            row("smg", "cache_aware", [0.72, 0.74, 0.75]),
        )
    )
    assert out.endswith("above every other row: NOT met (smg cache_aware as high or higher).")
    assert "0.720 (median of 3 runs) against the bound's 0.762: 5.5% below it" in out
    assert "(target within 5%: NOT met)" in out
