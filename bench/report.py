"""Markdown tables, and regenerating them in place in BENCHMARKS.md.

Rules of this file: pure text in, text out; no I/O except `update_file`. A generated block sits
between two marker comments, `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, each alone on its
line. Regenerating replaces only what lies between a pair, so the prose around it (written by
hand) stays. A marker pair that is missing is appended at the end of the document under a
heading, so a new table shows up once and can then be moved by hand; a pair that is broken (an
opening without its closing, or twice the same name) is an error that changes nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

Cell = str | int | float | None
_MARKER = re.compile(r"^<!-- (/?)bench:([a-z0-9_-]+) -->$")


class MarkerError(ValueError):
    """BENCHMARKS.md has a marker pair that cannot be regenerated safely."""


def cell(value: Cell, digits: int = 2) -> str:
    """A table cell: numbers with thousands separators, `-` for missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return value.replace("|", "\\|").replace("\n", " ")


def table(
    header: Sequence[str], rows: Sequence[Sequence[Cell]], digits: int = 2, note: str = ""
) -> str:
    """A GitHub table; columns after the first are right-aligned (they hold figures)."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(cell(v, digits) for v in row) + " |")
    if note:
        lines += ["", note]
    return "\n".join(lines)


def _blocks(lines: Sequence[str]) -> dict[str, tuple[int, int]]:
    """name -> (line of the opening marker, line of the closing marker)."""
    opened: dict[str, int] = {}
    found: dict[str, tuple[int, int]] = {}
    for i, line in enumerate(lines):
        m = _MARKER.match(line.strip())
        if m is None:
            continue
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            if name in opened or name in found:
                raise MarkerError(f"bench:{name} is opened twice (line {i + 1})")
            opened[name] = i
        elif name not in opened:
            raise MarkerError(f"/bench:{name} on line {i + 1} closes nothing")
        else:
            found[name] = (opened.pop(name), i)
    if opened:
        name, at = next(iter(opened.items()))
        raise MarkerError(
            f"bench:{name} (line {at + 1}) is never closed with <!-- /bench:{name} -->"
        )
    return found


def regenerate(document: str, tables: Mapping[str, str]) -> str:
    """`document` with the block of every name in `tables` replaced by its text."""
    for name in tables:
        if not re.fullmatch(r"[a-z0-9_-]+", name):
            raise MarkerError(f"{name!r} is not a marker name (lowercase letters, digits, - and _)")
    lines = document.splitlines()
    blocks = _blocks(lines)
    # Replace from the bottom up so earlier line numbers stay valid.
    for name, (start, end) in sorted(blocks.items(), key=lambda kv: kv[1][0], reverse=True):
        if name in tables:
            lines[start + 1 : end] = tables[name].strip("\n").splitlines()
    missing = [name for name in tables if name not in blocks]
    if missing:
        lines += ["", "## Generated tables without a place yet", ""]
        for name in missing:
            lines += [f"<!-- bench:{name} -->", *tables[name].strip("\n").splitlines()]
            lines += [f"<!-- /bench:{name} -->", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def update_file(path: Path, tables: Mapping[str, str]) -> list[str]:
    """Regenerate `tables` in the file at `path`; returns the names that were placed."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(regenerate(text, tables))
    return sorted(tables)
