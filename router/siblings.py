"""Decision sharing: sibling replicas tell each other where they routed which blocks.

Each replica's `cache_aware` keeps a ledger (`router.pressure`) of recent demand and of
bookings: blocks routed to a rank whose store events have not arrived yet. Behind a
round-robin front, each replica sees only its share of the traffic, and the index, the one
truth the replicas share, learns of a placement only once the engine admits the request. Two
replicas that get the first requests of a new prefix at about the same time then place it
on two ranks, and each sees only its own share of what the ranks must keep (measured in
`bench/pressure_sim.py`: a shared ledger brings two replicas from 0.95-0.98x the ideal
partition to one replica's 0.99-1.00x; see BENCHMARKS.md). So each replica posts its
decisions to its siblings, and adopts theirs into its own ledger as if it had routed them.

Theory of operation
-------------------
- `Outbox` (plain code) collects this replica's decisions: the rank, the block keys the
  ledger changed (a hot prefix routed again within its refresh window is not re-sent), and
  how many of them the index already showed on the rank. At most `MAX_KEYS_PER_DECISION`
  keys of a decision are kept (the head of the prompt: a prefix's head is what a sibling
  must find booked); past `max_pending_keys` the oldest decisions are dropped and counted.
- `DecisionSharing` (the asyncio shell) wakes when the outbox is non-empty and posts one
  msgpack batch to every sibling at once (`POST /internal/decisions`, the internal bearer
  token). While a post is in flight new decisions gather into the next batch, so the rate of
  posts adapts to the round trip. A sibling that fails is counted, logged (at most once a
  minute per sibling) and skipped for a backoff (50 ms doubling to 5 s; the decisions it
  misses are counted `skipped`): its ledger then misses a few decisions, which costs
  placement quality, never correctness.
- `decode_batch` checks a received body against the bounds and types, all or nothing: a
  malformed batch is refused whole (400), nothing of it applied. `DecisionSharing.receive`
  adopts each decision whose rank this replica knows (a decision for a worker it has not
  registered yet is counted `unknown` and skipped).

What is not shared: engine loads (each replica polls them), in-flight counts (each replica's
own), the index (each subscribes to the engines). A decision's booking on the sibling ends
as the sibling's own do: confirmed by the index or expired at its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import aiohttp
import msgspec

from cachetree.ranks import RankId

log = logging.getLogger(__name__)

PATH: Final = "/internal/decisions"
CONTENT_TYPE: Final = "application/msgpack"
MAX_KEYS_PER_DECISION: Final = 8192  # a 131k-token prompt at 16 tokens per block
MAX_DECISIONS_PER_BATCH: Final = 4096
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
MAX_WORKER_URL_CHARS: Final = 2048
MAX_DP_RANK: Final = 1 << 16
DEFAULT_MAX_PENDING_KEYS: Final = 1 << 18  # ~2.5 MiB of decisions waiting for a slow sibling
POST_TIMEOUT_S: Final = 2.0
_LOG_EVERY_S: Final = 60.0
_BACKOFF_S: Final = 0.05
_MAX_BACKOFF_S: Final = 5.0
_U64: Final = 1 << 64


class SharedDecision(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    worker_url: str
    dp_rank: int
    held: int  # leading keys the index showed on the rank when it was routed
    keys: list[int]


class DecisionBatch(msgspec.Struct, forbid_unknown_fields=True):
    decisions: list[SharedDecision]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DecisionBatch)


@dataclass(slots=True)
class SharingStats:
    sent: int = 0  # decisions in batches a sibling took (counted once per sibling)
    dropped: int = 0  # decisions dropped from the outbox, full while siblings were slow
    failed: int = 0  # posts a sibling refused or did not answer
    skipped: int = 0  # decisions not posted to a sibling backing off after failures
    received: int = 0  # decisions adopted from siblings
    unknown: int = 0  # received decisions for a rank this replica does not know
    refused: int = 0  # received batches refused as malformed


class Outbox:
    """This replica's decisions waiting to be posted (see the module docstring)."""

    def __init__(self, max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS) -> None:
        if max_pending_keys < 1:
            raise ValueError("max_pending_keys must be >= 1")
        self.max_pending_keys = max_pending_keys
        self._pending: deque[SharedDecision] = deque()
        self._keys = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending_keys(self) -> int:
        return self._keys

    def add(self, rank: RankId, keys: Sequence[int], held: int) -> None:
        kept = list(keys[:MAX_KEYS_PER_DECISION])
        if not kept:
            return
        self._pending.append(
            SharedDecision(rank.worker_url, rank.dp_rank, min(held, len(kept)), kept)
        )
        self._keys += len(kept)
        while self._keys > self.max_pending_keys or len(self._pending) > MAX_DECISIONS_PER_BATCH:
            old = self._pending.popleft()
            self._keys -= len(old.keys)
            self.dropped += 1

    def take(self) -> tuple[bytes, int] | None:
        """Every pending decision as one encoded batch, and how many (None when none)."""
        if not self._pending:
            return None
        count = len(self._pending)
        body = _encoder.encode(DecisionBatch(list(self._pending)))
        self._pending.clear()
        self._keys = 0
        return body, count


def decode_batch(body: bytes) -> list[SharedDecision]:
    """A received batch, checked; ValueError naming the first problem (nothing is applied)."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"batch of {len(body)} bytes; at most {MAX_BODY_BYTES}")
    try:
        batch = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a decision batch: {exc}") from None
    decisions = batch.decisions
    if len(decisions) > MAX_DECISIONS_PER_BATCH:
        raise ValueError(f"{len(decisions)} decisions; at most {MAX_DECISIONS_PER_BATCH}")
    for i, d in enumerate(decisions):
        problem = _problem(d)
        if problem is not None:
            raise ValueError(f"decisions[{i}]: {problem}")
    return decisions


def _problem(d: SharedDecision) -> str | None:
    if not 0 < len(d.worker_url) <= MAX_WORKER_URL_CHARS:
        return f"worker_url must be 1..{MAX_WORKER_URL_CHARS} characters"
    if not 0 <= d.dp_rank < MAX_DP_RANK:
        return f"dp_rank must be 0..{MAX_DP_RANK - 1}"
    if not 0 < len(d.keys) <= MAX_KEYS_PER_DECISION:
        return f"keys must hold 1..{MAX_KEYS_PER_DECISION} block keys"
    if not 0 <= d.held <= len(d.keys):
        return "held must be 0..len(keys)"
    if min(d.keys) < 0 or max(d.keys) >= _U64:
        return "block keys must be unsigned 64-bit integers"
    return None


Adopt = Callable[[RankId, Sequence[int], int], None]


@dataclass
class DecisionSharing:
    """Posts this replica's decisions to its siblings and adopts theirs (module docstring).

    `peers` names the siblings (the peer registry's current set), `known` tells whether a
    rank is one this replica routes to, `adopt` is cache_aware's."""

    session: aiohttp.ClientSession
    peers: Callable[[], Sequence[str]]
    token: str
    adopt: Adopt
    known: Callable[[RankId], bool]
    outbox: Outbox = field(default_factory=Outbox)
    stats: SharingStats = field(default_factory=SharingStats)
    timeout_s: float = POST_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _logged_at: dict[str, float] = field(default_factory=dict)
    _failing: dict[str, tuple[int, float]] = field(default_factory=dict)  # in a row, retry at

    def share(self, rank: RankId, keys: Sequence[int], held: int) -> None:
        """cache_aware's `share`: queue a decision for the next post."""
        self.outbox.add(rank, keys, held)
        self.stats.dropped = self.outbox.dropped
        self._wake.set()

    def receive(self, body: bytes) -> int:
        """Adopt a sibling's batch; returns how many decisions were adopted. ValueError (and
        nothing adopted) when the batch is malformed."""
        try:
            decisions = decode_batch(body)
        except ValueError:
            self.stats.refused += 1
            raise
        adopted = 0
        for d in decisions:
            rank = RankId(d.worker_url, d.dp_rank)
            if not self.known(rank):
                self.stats.unknown += 1
                continue
            self.adopt(rank, d.keys, d.held)
            adopted += 1
        self.stats.received += adopted
        return adopted

    async def run(self) -> None:
        """Post batches as decisions come, forever (run under the supervisor)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self.outbox.take()
            peers = list(self.peers())
            if batch is None or not peers:
                continue
            body, count = batch
            now = self.clock()
            ready = [p for p in peers if self._failing.get(p, (0, now))[1] <= now]
            self.stats.skipped += count * (len(peers) - len(ready))
            taken = await asyncio.gather(*(self._post(peer, body) for peer in ready))
            self.stats.sent += count * sum(taken)

    async def _post(self, peer: str, body: bytes) -> bool:
        """Post one batch; whether the sibling took it."""
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": CONTENT_TYPE}
        try:
            async with self.session.post(
                peer.rstrip("/") + PATH,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                if resp.status == 204:
                    self._failing.pop(peer, None)
                    return True
                problem = f"status {resp.status}: {(await resp.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self.stats.failed += 1
        now = self.clock()
        # A sibling that fails is skipped for a while (batches for it are counted `skipped`),
        # doubling from 50 ms up to 5 s, so a dead one costs no connection per decision.
        in_a_row = self._failing.get(peer, (0, now))[0] + 1
        self._failing[peer] = (
            in_a_row,
            now + min(_BACKOFF_S * 2 ** (in_a_row - 1), _MAX_BACKOFF_S),
        )
        if now - self._logged_at.get(peer, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged_at[peer] = now
            log.warning(
                "decision sharing: sibling %s did not take a batch (%s); until it does, its "
                "placements of new prefixes may differ from this replica's. Check that it "
                "runs, is reachable, and has the same --internal-token",
                peer,
                problem,
            )
        return False
