"""`kvrouter view`'s report (`router.tools.view.render`) from views built by hand: each figure
a difference line prints belongs to the replica its header names in that position."""

from __future__ import annotations

from cachetree.ranks import RankId
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


def test_adapter_names_only_one_replica_learned_are_a_difference_naming_them() -> None:
    views = [
        view.ReplicaView(A, block_size=16, canonical=frozenset(), adapters=frozenset({"chat"})),
        view.ReplicaView(C, block_size=16, canonical=frozenset(), adapters=frozenset({"sql"})),
    ]
    comparison = view.compare(views)
    assert not comparison.agree and view.exit_status(views, comparison) == 1
    lines = view.render(views, comparison)
    at = lines.index(f"  {C} vs {A}:")
    assert lines[at + 1] == f"    adapter names differ: only in {C}: 'sql'; only in {A}: 'chat'"
    many = frozenset(f"a{i}" for i in range(8))
    views[1].adapters = views[0].adapters | many
    lines = view.render(views, view.compare(views, cursors_only=True))
    assert f"only in {C}: 'a0', 'a1', 'a2', 'a3', 'a4' (and 3 more)" in lines[-1], lines


def test_the_cursor_tables_agreement_counts_the_ranks_listed_with_no_cursor_yet() -> None:
    """A rank registered with no batch yet has no cursor: two such were listed per replica
    under "agree (2 replicas, 0 ranks)"."""
    ranks = {RankId("http://w:1", 0), RankId("http://w:1", 1)}
    views = [view.ReplicaView(url, block_size=16, ranks=set(ranks)) for url in (A, C)]
    comparison = view.compare(views, cursors_only=True)
    assert comparison.agree
    lines = view.render(views, comparison)
    assert lines[-1] == "cursor tables: agree (2 replicas, 2 ranks)", lines
