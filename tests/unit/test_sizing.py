"""The router Deployment's memory limit and its index cap agree with the measured sizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.index import DEFAULT_INDEX_MAX_BLOCKS, max_blocks_for

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def quantity(text: str) -> int:
    for suffix, factor in UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def router_container() -> dict:
    deployment = yaml.safe_load((ROOT / "manifests/router/deployment.yaml").read_text())
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "kvrouter"
    ]
    return container


def test_the_router_deployment_caps_its_index_at_what_its_memory_limit_holds() -> None:
    container = router_container()
    limit = quantity(container["resources"]["limits"]["memory"])
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    cap = int(env["KVROUTER_KV_INDEX_MAX_BLOCKS"])
    assert cap <= max_blocks_for(limit)
    assert cap >= max_blocks_for(limit) * 0.8  # and does not leave most of the limit unused


@pytest.mark.parametrize(
    ("limit", "at_least", "at_most"),
    [
        ("512Mi", 100_000, 120_000),  # the pressure ledger's ~290 MiB at its default bound
        ("1536Mi", 4_350_000, 4_450_000),
        ("1792Mi", 5_450_000, 5_500_000),
        ("8Gi", 32_000_000, 32_500_000),
    ],
)
def test_the_readme_sizing_rows_follow_from_the_rule(
    limit: str, at_least: int, at_most: int
) -> None:
    assert at_least <= max_blocks_for(quantity(limit)) <= at_most


def test_the_default_cap_needs_less_than_one_and_a_half_gib() -> None:
    assert max_blocks_for(3 << 29) >= DEFAULT_INDEX_MAX_BLOCKS


def test_a_smaller_pressure_ledger_leaves_its_share_to_the_index() -> None:
    assert max_blocks_for(512 << 20, ledger_pairs=100_000) == 1_188_622
