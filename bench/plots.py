"""PNG plots, drawn only where matplotlib is installed (`pip install -e .[bench]`).

Without it the suite still writes every JSON file and table, and says once how to get plots.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: ModuleType, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


Line = tuple[list[Any], list[float], str, str]  # xs, ys, matplotlib style, label


def panel(ax: Any, title: str, xlabel: str, ylabel: str, lines: list[Line]) -> None:
    """One subplot of labelled lines."""
    for xs, ys, style, label in lines:
        ax.plot(xs, ys, style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()


def bars(
    plt: ModuleType, path: Path, title: str, labels: list[str], values: list[float], unit: str
) -> Path:
    """One horizontal bar per label, its value printed at the bar's end."""
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 1.5))
    ax.barh(labels, values, color="#4477aa")
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:,.3g}", va="center")
    return save(plt, fig, path)
