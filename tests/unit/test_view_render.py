"""`kvrouter view`'s report (`router.tools.view.render`) from views built by hand: each figure
a difference line prints belongs to the replica its header names in that position."""

from __future__ import annotations

from router.tools import view

A, C = "http://127.0.0.1:8080", "http://127.0.0.1:8082"


def test_a_block_size_difference_prints_each_replicas_size_in_the_headers_order() -> None:
    # A indexes with block size 16; C knows none yet (0, printed `-` on its own line).
    views = [
        view.ReplicaView(A, ready=True, block_size=16, producer_ready=True, canonical=frozenset()),
        view.ReplicaView(C, ready=True, block_size=0, producer_ready=True, canonical=frozenset()),
    ]
    comparison = view.compare(views)
    assert not comparison.agree and view.exit_status(views, comparison) == 1
    lines = view.render(views, comparison)
    assert f"replica {C}: ready, block size -" in lines, lines
    at = lines.index(f"  {C} vs {A}:")
    assert lines[at + 1] == "    block size - vs 16", lines
