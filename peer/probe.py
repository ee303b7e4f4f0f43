"""The splice probe: asking siblings whether a graft nobody witnessed missed a batch.

Theory of operation
-------------------
A graft whose rank had nothing held (an idle engine) has no live batch to prove that the
stream continues at the snapshot's watermark. The first live batch normally settles it. If
none comes, the proof ages; every 30 s a due proof is checked against the siblings' cursor
tables (`cursors_only=true`, cheap, never cached): sequence numbers belong to the publisher,
so any sibling that saw the rank is a witness, cold or not.

  - a sibling's cursor above the watermark -> `advanced`: a batch was published that we
    never saw, the graft may miss a removal; the pump demotes the rank (gap resolution)
  - a cursor equal to it (and none above)  -> `no_advance`: the splice holds, `warm`
  - below it, or the rank absent everywhere -> `unknown`; after three unknowns the graft is
    kept as `warm_unwitnessed` (silence alone never discards a graft). A cursor below the
    watermark is a lagging sibling or one whose publisher reset; the reset's new batches
    reach this replica too, and the pump resolves them within seconds (`router.graft`)

`judge` is the pure verdict; `probe_once` fetches each sibling's table once, in shuffled
order, within a budget, and stops early once every target is `advanced`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from cachetree.ranks import RankId

PROOF_TIMEOUT_S = 30.0
TICK_S = 5.0
MAX_UNKNOWN_PROBES = 3

ADVANCED, NO_ADVANCE, UNKNOWN = "advanced", "no_advance", "unknown"


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    rank: RankId
    watermark: int
    epoch: int


def judge(target: ProbeTarget, tables: Iterable[Mapping[RankId, int]]) -> str:
    verdict = UNKNOWN
    for table in tables:
        cursor = table.get(target.rank)
        if cursor is None or cursor < target.watermark:
            continue
        if cursor > target.watermark:
            return ADVANCED
        verdict = NO_ADVANCE
    return verdict


async def probe_once(
    targets: Sequence[ProbeTarget],
    peers: Sequence[str],
    fetch_cursors: Callable[[str], Awaitable[Mapping[RankId, int] | None]],
    budget_s: float = PROOF_TIMEOUT_S - TICK_S,
) -> dict[ProbeTarget, str]:
    """One round over the (already shuffled) peers; a peer not reached in time is no witness."""
    tables: list[Mapping[RankId, int]] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(budget_s):
            for peer in peers:
                table = await fetch_cursors(peer)
                if table is not None:
                    tables.append(table)
                if all(judge(t, tables) == ADVANCED for t in targets):
                    break
    return {t: judge(t, tables) for t in targets}
