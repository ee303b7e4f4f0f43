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
With prefix homes on (`router.homes`, `--prefix-homes`), the homes each replica places or
changes travel in the same batches, so the siblings send a prefix's later requests to the
same rank instead of placing it again by their own view.

Theory of operation
-------------------
- `Outbox` (plain code) collects this replica's decisions: the rank, the block keys the
  ledger changed (a hot prefix routed again within its refresh window is not re-sent, nor a
  request's own tail: `PressureLedger.record`), and
  how many of them the index already showed on the rank. At most `MAX_KEYS_PER_DECISION`
  keys of a decision are kept (the head of the prompt: a prefix's head is what a sibling
  must find booked); past `max_pending_keys` the oldest decisions are dropped and counted.
- `DecisionSharing` (the asyncio shell) wakes when the outbox is non-empty and hands its
  decisions to one lane per sibling: each lane is an outbox of its own (the same bounds) and
  a task posting it as one msgpack batch (`POST /internal/decisions`, the internal bearer
  token). While a lane's post is in flight new decisions gather into its next batch, so each
  sibling's rate of posts adapts to its own round trip, and a stalled sibling (a stopped
  process still accepts connections) holds back its own decisions for the post timeout, never
  another sibling's. A sibling that fails is counted, logged (at most once a minute per
  sibling) and skipped for a backoff (50 ms doubling to 5 s; the decisions it misses are
  counted `skipped`): its ledger then misses a few decisions, which costs placement quality,
  never correctness. A sibling that leaves the registry takes its lane, backoff and log time
  with it (a rollout replaces every pod: kept, they grew with each one).
- Homes (`SharedHome`) queue in the same outbox and count against the same bounds (a
  home's chain is at most `router.homes.MAX_CHAIN_BLOCKS` keys). A batch without homes
  encodes exactly as before homes existed (`omit_defaults`), so a replica without them
  reads it.
- `decode_batch` checks a received body against the bounds and types, all or nothing: a
  malformed batch is refused whole (400), nothing of it applied. `DecisionSharing.receive`
  adopts each decision and home whose rank this replica knows (one for a worker it has not
  registered yet is counted `unknown` and skipped); a home is set on the receiver's
  monotonic clock (its settle time starts at adoption) and keeps the sender's wall-clock
  stamp, which the replicas compare to agree on one of two homes placed at once.

What is not shared: engine loads (each replica polls them), in-flight counts (each replica's
own), the index (each subscribes to the engines). A decision's booking on the sibling ends
as the sibling's own do: confirmed by the index or expired at its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Final

import aiohttp
import msgspec

from cachetree.ranks import RankId
from cachetree.tree import run_through
from peer.origin import canonical_origin
from peer.supervise import doubling_s
from router.bounded import read_up_to
from router.homes import MAX_CHAIN_BLOCKS, Home
from router.log_tally import LogTally

log = logging.getLogger(__name__)

PATH: Final = "/internal/decisions"
CONTENT_TYPE: Final = "application/msgpack"
MAX_KEYS_PER_DECISION: Final = 8192  # a 131k-token prompt at 16 tokens per block
MAX_DECISIONS_PER_BATCH: Final = 4096
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
ADOPT_CHUNK: Final = 256  # decisions a received batch adopts between two turns of the loop
MAX_WORKER_URL_CHARS: Final = 2048
MAX_DP_RANK: Final = 1 << 16
MAX_DEPTH: Final = 1 << 20  # blocks into a prompt: far past any context window
MAX_GENERATION: Final = 1 << 31
DEFAULT_MAX_PENDING_KEYS: Final = 1 << 18  # ~2.5 MiB of decisions waiting for a slow sibling
POST_TIMEOUT_S: Final = 2.0
_LOG_EVERY_S: Final = 60.0
_ERROR_HEAD_BYTES: Final = 200  # of a refusing sibling's body, for the log
_BACKOFF_S: Final = 0.05
_MAX_BACKOFF_S: Final = 5.0
_U64: Final = 1 << 64


class SharedDecision(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    worker_url: str
    dp_rank: int
    held: int  # leading keys the index showed on the rank when it was routed
    keys: list[int]


class SharedHome(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A prefix home (`router.homes.Home`) as siblings send it."""

    worker_url: str
    dp_rank: int
    anchor: int
    depth: int
    join: int
    chain: list[int]
    length: int
    generation: int
    stamp: float  # wall clock of its placement
    confirmed: int
    tail_of: int | None

    @classmethod
    def of(cls, home: Home) -> SharedHome:
        rank = home.rank
        return cls(rank.worker_url, rank.dp_rank, home.anchor, home.depth, home.join,
                   list(home.chain), home.length, home.generation, home.stamp,
                   home.confirmed, home.tail_of)  # fmt: skip

    def home(self, set_at: float) -> Home:
        """The home, its worker as this replica's registry spells it (`adopt_steps`)."""
        rank = RankId(canonical_origin(self.worker_url), self.dp_rank)
        return Home(rank, self.anchor, self.depth, self.join, self.chain, self.generation,
                    set_at, self.stamp, self.length,
                    confirmed=self.confirmed, tail_of=self.tail_of)  # fmt: skip


class DecisionBatch(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    decisions: list[SharedDecision]
    homes: list[SharedHome] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DecisionBatch)


@dataclass(slots=True)
class SharingStats:
    sent: int = 0  # decisions in batches a sibling took (counted once per sibling)
    dropped: int = 0  # decisions dropped from the outbox, full while siblings were slow
    failed: int = 0  # posts a sibling refused or did not answer
    skipped: int = 0  # decisions not posted to a sibling backing off after failures
    received: int = 0  # decisions adopted from siblings
    homes_received: int = 0  # prefix homes adopted from siblings
    unknown: int = 0  # received decisions and homes for a rank this replica does not know
    refused: int = 0  # received batches refused as malformed


class Outbox:
    """This replica's decisions waiting to be posted (see the module docstring)."""

    def __init__(self, max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS) -> None:
        if max_pending_keys < 1:
            raise ValueError("max_pending_keys must be >= 1")
        self.max_pending_keys = max_pending_keys
        self._pending: deque[SharedDecision | SharedHome] = deque()
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
        self._bound()

    def add_home(self, home: Home) -> None:
        shared = SharedHome.of(home)
        self._pending.append(shared)
        self._keys += len(shared.chain)
        self._bound()

    def _bound(self) -> None:
        while self._keys > self.max_pending_keys or len(self._pending) > MAX_DECISIONS_PER_BATCH:
            old = self._pending.popleft()
            self._keys -= len(old.keys if isinstance(old, SharedDecision) else old.chain)
            self.dropped += 1

    def take(self) -> tuple[bytes, int] | None:
        """Every pending decision and home as one encoded batch, and how many decisions
        (None when none)."""
        if not self._pending:
            return None
        items = self.drain()
        decisions = [d for d in items if isinstance(d, SharedDecision)]
        homes = [h for h in items if isinstance(h, SharedHome)]
        return _encoder.encode(DecisionBatch(decisions, homes)), len(decisions)

    def drain(self) -> list[SharedDecision | SharedHome]:
        """Every pending decision and home, oldest first, the outbox left empty."""
        items = list(self._pending)
        self._pending.clear()
        self._keys = 0
        return items

    def take_dropped(self) -> int:
        """The decisions dropped since the last call (for a counter that only grows)."""
        dropped, self.dropped = self.dropped, 0
        return dropped

    def extend(self, items: Sequence[SharedDecision | SharedHome]) -> None:
        """Queue decisions and homes drained from another outbox (a sibling's lane), within
        this one's bounds."""
        self._pending.extend(items)
        self._keys += sum(len(i.keys if isinstance(i, SharedDecision) else i.chain) for i in items)
        self._bound()


def decode_batch(body: bytes) -> DecisionBatch:
    """A received batch, checked; ValueError naming the first problem (nothing is applied)."""
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"batch of {len(body)} bytes; at most {MAX_BODY_BYTES}")
    try:
        batch = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a decision batch: {exc}") from None
    decisions, homes = batch.decisions, batch.homes
    if len(decisions) + len(homes) > MAX_DECISIONS_PER_BATCH:
        raise ValueError(
            f"{len(decisions)} decisions and {len(homes)} homes; at most "
            f"{MAX_DECISIONS_PER_BATCH} in all"
        )
    for i, d in enumerate(decisions):
        problem = _problem(d)
        if problem is not None:
            raise ValueError(f"decisions[{i}]: {problem}")
    for i, h in enumerate(homes):
        problem = _home_problem(h)
        if problem is not None:
            raise ValueError(f"homes[{i}]: {problem}")
    return batch


def failure_backoff_s(in_a_row: int) -> float:
    """How long a sibling that failed `in_a_row` times in a row is left alone: 50 ms doubling
    up to 5 s, so a dead one costs no connection per decision (or per placement question)."""
    return doubling_s(_BACKOFF_S, _MAX_BACKOFF_S, in_a_row)


def u64_keys(keys: Sequence[int]) -> bool:
    """Whether every one of `keys` (non-empty) is an unsigned 64-bit block key."""
    return min(keys) >= 0 and max(keys) < _U64


def rank_problem(worker_url: str, dp_rank: int) -> str | None:
    """What is wrong with a rank named on the wire, or None."""
    if not 0 < len(worker_url) <= MAX_WORKER_URL_CHARS:
        return f"worker_url must be 1..{MAX_WORKER_URL_CHARS} characters"
    if not 0 <= dp_rank < MAX_DP_RANK:
        return f"dp_rank must be 0..{MAX_DP_RANK - 1}"
    return None


def _home_problem(h: SharedHome) -> str | None:
    problem = rank_problem(h.worker_url, h.dp_rank)
    if problem is not None:
        return problem
    if not 0 < len(h.chain) <= MAX_CHAIN_BLOCKS:
        return f"chain must hold 1..{MAX_CHAIN_BLOCKS} block keys"
    if not u64_keys(h.chain) or not (h.tail_of is None or 0 <= h.tail_of < _U64):
        return "block keys must be unsigned 64-bit integers"
    if h.chain[0] != h.anchor or h.join not in h.chain:
        return "anchor must be the chain's first key and join one of its keys"
    if not 0 <= h.depth <= h.confirmed <= MAX_DEPTH:
        return f"need 0 <= depth <= confirmed <= {MAX_DEPTH}"
    if not len(h.chain) <= h.length <= MAX_DEPTH:
        return f"length must be len(chain)..{MAX_DEPTH}"
    if not 0 <= h.generation < MAX_GENERATION:
        return f"generation must be 0..{MAX_GENERATION - 1}"
    if not math.isfinite(h.stamp):
        return "stamp must be a finite number"
    return None


def _problem(d: SharedDecision) -> str | None:
    problem = rank_problem(d.worker_url, d.dp_rank)
    if problem is not None:
        return problem
    if not 0 < len(d.keys) <= MAX_KEYS_PER_DECISION:
        return f"keys must hold 1..{MAX_KEYS_PER_DECISION} block keys"
    if not 0 <= d.held <= len(d.keys):
        return "held must be 0..len(keys)"
    if not u64_keys(d.keys):
        return "block keys must be unsigned 64-bit integers"
    return None


@dataclass(slots=True)
class _Lane:
    """One sibling's outbox and the task posting it (`DecisionSharing.run`)."""

    outbox: Outbox
    wake: asyncio.Event
    task: asyncio.Task[None] = field(init=False)


Adopt = Callable[[RankId, Sequence[int], int], None]
AdoptHome = Callable[[Home], None]


@dataclass
class DecisionSharing:
    """Posts this replica's decisions to its siblings and adopts theirs (module docstring).

    `peers` names the siblings (the peer registry's current set), `known` tells whether a
    rank is one this replica routes to, `adopt` is cache_aware's, `adopt_home` the prefix
    homes' (None: homes are off here, and siblings' homes are ignored)."""

    session: aiohttp.ClientSession
    peers: Callable[[], Sequence[str]]
    token: str
    adopt: Adopt
    known: Callable[[RankId], bool]
    adopt_home: AdoptHome | None = None
    outbox: Outbox = field(default_factory=Outbox)
    stats: SharingStats = field(default_factory=SharingStats)
    timeout_s: float = POST_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _warned: dict[str, LogTally] = field(default_factory=dict)  # per sibling
    _strangers: LogTally = field(default_factory=lambda: LogTally(_LOG_EVERY_S))
    _failing: dict[str, tuple[int, float]] = field(default_factory=dict)  # in a row, retry at

    def share(self, rank: RankId, keys: Sequence[int], held: int) -> None:
        """cache_aware's `share`: queue a decision for the next post."""
        self.outbox.add(rank, keys, held)
        self._wake.set()

    def share_home(self, home: Home) -> None:
        """The prefix homes' `share`: queue a home placed or changed for the next post."""
        self.outbox.add_home(home)
        self._wake.set()

    def receive(self, body: bytes) -> int:
        """Adopt a sibling's batch at once; returns how many decisions were adopted.
        ValueError (and nothing adopted) when the batch is malformed."""
        return run_through(self.adopt_steps(self.decode(body)))

    def decode(self, body: bytes) -> DecisionBatch:
        """A sibling's batch, whole; ValueError (counted `refused`) when it is malformed."""
        try:
            return decode_batch(body)
        except ValueError:
            self.stats.refused += 1
            raise

    def adopt_steps(self, batch: DecisionBatch) -> Generator[None, None, int]:
        """Adopt a decoded batch, yielding every `ADOPT_CHUNK` decisions so that the loop
        runs between them (a batch of 4,096 decisions of 100 new blocks each held it for
        130-310 ms); returns how many decisions were adopted."""
        adopted = 0
        stranger: RankId | None = None  # the last rank named that this replica does not know
        strangers = 0
        for i, d in enumerate(batch.decisions):
            if i and not i % ADOPT_CHUNK:
                yield
            # As the registry spells the worker, or the booking is made under a name no
            # stream of ours confirms: a sibling of another version sends its --worker flag
            # as written (`http://localhost:P`, `http://w:80`).
            rank = RankId(canonical_origin(d.worker_url), d.dp_rank)
            if not self.known(rank):
                stranger, strangers = rank, strangers + 1
                continue
            self.adopt(rank, d.keys, d.held)
            adopted += 1
        self.stats.received += adopted
        if self.adopt_home is not None and batch.homes:
            now = self.clock()
            for h in batch.homes:
                home = h.home(now)
                if not self.known(home.rank):
                    stranger, strangers = home.rank, strangers + 1
                    continue
                self.adopt_home(home)
                self.stats.homes_received += 1
        if stranger is not None:
            self._unknown(stranger, strangers)
        return adopted

    def _unknown(self, rank: RankId, count: int) -> None:
        """`count` decisions and homes of a batch named ranks this replica does not know,
        `rank` the last. For a moment that is a worker registered on the sibling first; for
        good, replicas given different workers: the placer places new prefixes on workers an
        asker lacks, and the asker places them alone (`unusable` placements)."""
        self.stats.unknown += count
        if said := self._strangers.count(self.clock(), count):
            log.warning(
                "decision sharing: siblings shared %d decision(s) on ranks this replica does not "
                "know since this was last said (%s the last); they are not booked here. If it "
                "lasts, give every replica the same worker list (--worker, or one "
                "--worker-selector)",
                said,
                rank,
            )

    async def run(self) -> None:
        """Hand decisions to the siblings' lanes as they come, forever (run under the
        supervisor): a lane per sibling the registry names, started when it appears and ended
        when it goes; a lane that fails ends this task, and the supervisor sees it."""
        lanes: dict[str, _Lane] = {}
        async with asyncio.TaskGroup() as group:
            while True:
                await self._wake.wait()
                self._wake.clear()
                items = self.outbox.drain()
                dropped = self.outbox.take_dropped()
                peers = set(self.peers())
                for gone in lanes.keys() - peers:
                    lanes.pop(gone).task.cancel()
                    # Its failure and log times go with it (its cancelled lane writes no more):
                    # kept, every pod a rollout replaced left its own for good.
                    self._failing.pop(gone, None)
                    self._warned.pop(gone, None)
                for peer in peers - lanes.keys():
                    lane = _Lane(Outbox(self.outbox.max_pending_keys), asyncio.Event())
                    lane.task = group.create_task(self._post_lane(peer, lane))
                    lanes[peer] = lane
                if items:
                    for lane in lanes.values():
                        lane.outbox.extend(items)
                        dropped += lane.outbox.take_dropped()
                        lane.wake.set()
                self.stats.dropped += dropped

    async def _post_lane(self, peer: str, lane: _Lane) -> None:
        """One sibling's lane: post what gathered while the last post was out, as one batch;
        while the sibling backs off after failures, its decisions are skipped (counted)."""
        while True:
            await lane.wake.wait()
            lane.wake.clear()
            batch = lane.outbox.take()
            if batch is None:
                continue
            body, count = batch
            if self._failing.get(peer, (0, 0.0))[1] > self.clock():
                self.stats.skipped += count
            elif await self._post(peer, body):
                self.stats.sent += count

    async def _post(self, peer: str, body: bytes) -> bool:
        """Post one batch; whether the sibling took it."""
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": CONTENT_TYPE}
        try:
            async with self.session.post(
                peer.rstrip("/") + PATH,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                allow_redirects=False,  # a sibling's 3xx is a failed post, never followed
            ) as resp:
                if resp.status == 204:
                    self._failing.pop(peer, None)
                    return True
                # Its first bytes, whatever they are: a sibling's body is no text to trust (a
                # binary one raised and ended the sharing task; a large one was read whole).
                head = await read_up_to(resp.content, _ERROR_HEAD_BYTES)
                text = head[:_ERROR_HEAD_BYTES].decode("utf-8", "replace")
                problem = f"status {resp.status}: {text}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self.stats.failed += 1
        now = self.clock()
        # A sibling that fails is skipped for a while (batches for it are counted `skipped`).
        in_a_row = self._failing.get(peer, (0, now))[0] + 1
        self._failing[peer] = (in_a_row, now + failure_backoff_s(in_a_row))
        if self._warned.setdefault(peer, LogTally(_LOG_EVERY_S)).count(now):
            log.warning(
                "decision sharing: sibling %s did not take a batch (%s); until it does, its "
                "placements of new prefixes may differ from this replica's. Check that it "
                "runs, is reachable, and has the same --internal-token",
                peer,
                problem,
            )
        return False
