"""LoRA adapter names through a sibling's snapshot: the producer exports the names its index
learned (`adapters`), vetting reads them back (or refuses a list our export never writes), and
a graft teaches them to the joining replica, so its requests naming an adapter are keyed in the
adapter's namespace before any new store names it."""

from __future__ import annotations

import msgspec
import pytest

from cachetree.keys import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_NAMES, block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from peer.vet import VetError, VettedSnapshot
from peer.wire import COLUMNS, JSON, MSGPACK, decode
from router.events import BlockStored, EventBatch
from router.graft import LocalGraft
from router.index import IndexRules
from router.subscriber import LiveBatch
from router.worker_snapshot import SnapshotBlock, SnapshotRank, WorkerSnapshot
from tests.unit.test_cold_ranks import export_of
from tests.unit.test_graft import Rig

BS = 4
R = RankId("http://w", 0)
TOKENS = list(range(1, 1 + 2 * BS))


def sibling(*namespaces: str | None) -> IndexRules:
    """A warm sibling that saw R store TOKENS once under each namespace, from seq 0."""
    rules = IndexRules(BlockTree(BS))
    rules.add_ranks([R])
    for seq, namespace in enumerate(namespaces):
        hashes = [10 * seq + 1, 10 * seq + 2]
        event = BlockStored(hashes, None, TOKENS, BS, DEVICE, "GPU", namespace)
        rules.handle(LiveBatch(R, seq, EventBatch(0.0, [event], 0)))
    return rules


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, COLUMNS])
async def test_the_export_lists_the_learned_adapters_in_every_encoding(content_type: str) -> None:
    rules = sibling("sql", "chat\x00salt", "\x00salt", None)
    body = decode(await export_of(rules, content_type), content_type)
    assert body.adapters == ["chat", "sql"]
    vetted = VettedSnapshot.from_wire(body, {R}, BS)
    assert vetted.adapters == {"chat", "sql"}
    assert vetted.retain_workers([R]).adapters == {"chat", "sql"}


async def test_an_export_with_no_adapter_omits_the_field_and_an_old_body_names_none() -> None:
    raw = msgspec.json.decode(await export_of(sibling(None), JSON))
    assert "adapters" not in raw
    assert VettedSnapshot.from_wire(decode(msgspec.json.encode(raw)), {R}, BS).adapters == set()


@pytest.mark.parametrize(
    "adapters,reason",
    [
        ([""], "malformed_adapter"),
        (["sql\x00salt"], "malformed_adapter"),
        (["a" * (MAX_ADAPTER_NAME_CHARS + 1)], "malformed_adapter"),
        ([f"a{i}" for i in range(MAX_ADAPTER_NAMES + 1)], "too_many_adapters"),
    ],
)
async def test_an_adapter_list_our_export_never_writes_refuses_the_body(
    adapters: list[str], reason: str
) -> None:
    raw = msgspec.json.decode(await export_of(sibling("sql"), JSON))
    raw["adapters"] = adapters
    with pytest.raises(VetError) as caught:
        VettedSnapshot.from_wire(decode(msgspec.json.encode(raw)), {R}, BS)
    assert (caught.value.reason, caught.value.outcome) == (reason, "rejected")


async def test_a_joiner_learns_the_siblings_adapters_from_its_graft() -> None:
    body = decode(await export_of(sibling("sql"), COLUMNS), COLUMNS)
    rig = Rig()
    assert rig.rules.apply_snapshot(rig.obligations, VettedSnapshot.from_wire(body, {R}, BS))
    assert rig.index.adapters == {"sql"}
    # The grafted blocks are where a request naming the adapter looks for them.
    keys = block_keys(TOKENS, BS, namespace_seed("sql"))
    assert rig.index.tree.prefix_depths(keys).any_tier == {R: 2}


def test_a_graft_from_a_workers_snapshot_learns_its_adapters() -> None:
    blocks = [
        SnapshotBlock(1, None, TOKENS[:BS], lora_name="sql"),
        SnapshotBlock(2, 1, TOKENS[BS:]),
    ]
    graft = LocalGraft.from_worker_snapshot(
        R.worker_url, WorkerSnapshot([SnapshotRank(0, 3, blocks)], BS), BS
    )
    rig = Rig()
    assert rig.rules.apply_snapshot(rig.obligations, graft) == [R]
    assert rig.index.adapters == {"sql"}


def test_a_graft_that_covers_nothing_teaches_nothing() -> None:
    blocks = [SnapshotBlock(1, None, TOKENS[:BS], lora_name="sql")]
    graft = LocalGraft.from_worker_snapshot(
        "http://other", WorkerSnapshot([SnapshotRank(0, 3, blocks)], BS), BS
    )
    rig = Rig()
    assert rig.rules.apply_snapshot(rig.obligations, graft) == []
    assert rig.index.adapters == set()
