import asyncio

from cachetree.ranks import RankId
from peer.probe import (
    ADVANCED,
    MAX_UNKNOWN_PROBES,
    NO_ADVANCE,
    UNKNOWN,
    ProbeTarget,
    judge,
    probe_once,
)

R = RankId("http://w", 0)
T = ProbeTarget(R, watermark=5, epoch=1)


def test_a_cursor_above_the_watermark_means_a_batch_was_missed() -> None:
    assert judge(T, [{R: 5}, {R: 6}]) == ADVANCED


def test_a_cursor_equal_to_the_watermark_witnesses_the_splice() -> None:
    assert judge(T, [{R: 5}, {R: 3}]) == NO_ADVANCE


def test_cursors_below_or_absent_are_no_witness() -> None:
    assert judge(T, [{R: 4}, {}]) == UNKNOWN
    assert judge(T, []) == UNKNOWN


async def test_probe_reads_each_peer_once_and_stops_when_all_targets_advanced() -> None:
    asked: list[str] = []

    async def fetch(peer: str):
        asked.append(peer)
        return {"a": None, "b": {R: 9}, "c": {R: 5}}[peer]

    verdicts = await probe_once([T], ["a", "b", "c"], fetch, budget_s=1)
    assert verdicts == {T: ADVANCED}
    assert asked == ["a", "b"]


async def test_a_peer_that_hangs_past_the_budget_is_no_witness() -> None:
    async def fetch(peer: str):
        if peer == "slow":
            await asyncio.sleep(10)
        return {R: 5}

    verdicts = await probe_once([T], ["fast", "slow"], fetch, budget_s=0.05)
    assert verdicts == {T: NO_ADVANCE}


def test_the_unknown_probe_limit_has_one_definition_the_graft_rules_read() -> None:
    """router.graft and peer.probe each defined MAX_UNKNOWN_PROBES = 3: changing the probe's
    left the pump settling proofs at the other count."""
    import re
    from pathlib import Path

    import router.graft

    repo = Path(__file__).resolve().parents[2]
    defined = [
        path.relative_to(repo).as_posix()
        for package in ("cachetree", "peer", "router")
        for path in sorted((repo / package).rglob("*.py"))
        if re.search(r"^MAX_UNKNOWN_PROBES\b.*=", path.read_text(), re.MULTILINE)
    ]
    assert defined == ["peer/probe.py"]
    assert router.graft.MAX_UNKNOWN_PROBES is MAX_UNKNOWN_PROBES
