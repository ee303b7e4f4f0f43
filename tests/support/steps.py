"""Jobs in steps (generators that yield between slices of work), run through by tests."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


def counted_steps(steps: Generator[None, None, T]) -> tuple[int, T]:
    """Run a job in steps to its end: how many times it yielded, and what it returned."""
    turns = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return turns, done.value
        turns += 1
