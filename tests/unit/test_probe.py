import asyncio

from cachetree.ranks import RankId
from peer.probe import ADVANCED, NO_ADVANCE, UNKNOWN, ProbeTarget, judge, probe_once

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
