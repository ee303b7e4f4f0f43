"""Imports flow one way (ARCHITECTURE.md, "Layout and layering"): `cachetree` <- `peer` <-
`router`, and `fake_kv_worker`, an engine's independent mirror, imports neither `router` nor
`peer`. Read from the source (every import statement, at any depth), so a lazy import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the packages of this project it must not import
FORBIDDEN = {
    "cachetree": {"peer", "router", "fake_kv_worker"},
    "peer": {"router", "fake_kv_worker"},
    "fake_kv_worker": {"router", "peer"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every absolute import in `path`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_lower_layer_imports_nothing_from_the_layers_above_it(package: str) -> None:
    crossings = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {file: names for file, names in crossings.items() if names} == {}
