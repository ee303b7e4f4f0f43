"""Placement authority: one replica places every new prefix for its siblings.

Decision sharing (`router.siblings`) tells siblings where each replica routed what, a few ms
late (p50 2-3 ms, p99 20-30 ms under load). Nearly all the routing quality that lag costs
comes from placements of NEW prefixes: replicas that have not heard of each other's
placements put new prefixes on the rank every view shows lightest (herding), or place a
prefix a sibling has just placed elsewhere (a blind copy); the lag of the other decisions
costs nothing measurable (BENCHMARKS.md, "Siblings' news lag"). So new prefixes are placed
by one replica, the placer, which sees every placement because it makes them all.

Theory of operation
-------------------
- Who places: the lowest of the sorted base URLs of this replica and the siblings it
  currently posts to (`placer_of`). Every replica computes it from what it already has, so
  there is no election. While membership changes, two replicas may each see a different
  lowest URL (a new replica seen by some, a gone one still listed by others): each of the
  two placers then decides for those that ask it, and shares as usual, so for that window
  routing is as good as with no placer at all, never worse. A replica asked while it does
  not think itself the placer answers all the same (no forwarding, so no loops). A replica
  that does not know its own URL (`--self-url`, or a concrete `--host`, or `POD_IP`) cannot
  tell whether it is the lowest, and never asks.
- What is new (`Placement.question`, `new_prefix`): a prompt of at least one full block whose
  every candidate rank holds it equally deep in this replica's view, the index's device depth
  extended by this replica's bookings (no holder, or a preamble every rank holds); or one
  that goes on past its deepest match for at least as many blocks again, the first of them
  routed nowhere lately (`PressureLedger.routed`, the siblings' decisions included): a new
  prefix below a preamble some ranks hold. Asked only on equal depths, the second request of
  a new prefix below a preamble, arriving at a replica that had not heard of the first one's
  placement yet, was placed there alone, a copy on another rank (`bench/pressure_sim.py`,
  u2031.3, 8 prefixes below a 4-block preamble at c=16 over 3 replicas: 4.6 such copies a
  run, 0.69x the ideal partition; asked, 0.95x; live, where clients start a few ms apart,
  main's placements came first and both tie: BENCHMARKS.md, round 10). A repeat's new
  tail is shorter than what it repeats, so a repeat does not ask. The common case, a prompt
  some rank holds deeper than half its length, is told apart from the index's depth runs,
  before anything else is read.
- Asking: the question carries the prompt's token count, block size and block keys (at most
  `MAX_KEYS`, its head), and the model the request names when not every rank serves it
  (`router.model_servers`: the placer decides among the ranks serving it, the asker's
  candidates are those alone); the placer decides with its own ledger, loads and in-flight
  (`CacheAware.decide`, which books the rank in its ledger and shares it with every sibling,
  the asker included) and answers the rank. The asker waits at most `--placement-timeout-ms`,
  then routes to the answered rank if it is still one of its healthy candidates, booked in
  its own ledger like its own decision but not shared again (`CacheAware.place`); otherwise
  (timeout, error, an answer naming a rank it does not route to) it decides alone as without
  a placer. At most `max_asking` questions are in flight: past that a new prefix is decided
  here (`busy`). A placer that failed is not asked for a backoff (50 ms doubling to 5 s), so
  a dead one costs no wait per request.
- Stalls are not the placer's failures. A wait that ends more than `STALL_S` later than it
  was due (this replica's process was not scheduled, or one callback held its loop) goes on
  for as long again as it was late (`Deadline`), up to `MAX_WAIT_FACTOR` times the timeout
  in all: an answer that came meanwhile sits unread, and the timer fires in the same pass
  that would read it. And the questions in flight when a failure is counted fail together
  with it (`Placement.finished`): they are that one failure, not one more each for the
  backoff. Measured live (BENCHMARKS.md, "Stalls and the placer"): at a burst of new
  prefixes on a loaded host, five to seven questions of one asker timed out together (once
  with the placer's answers sent 30-47 ms before their deadline, while the asker, the placer
  and the client all stood still for 75 ms), the backoff grew to 0.8-3.2 s, and the asker
  placed every new prefix of the run alone: copies and an uneven fleet, in the lowest runs of
  the multi-replica shapes.
- Nor are the placer's stalls. A question unanswered at its timeout waits on, to the same
  `MAX_WAIT_FACTOR` timeouts, while no failure is counted in the row (`Placement.patient`:
  the placer answered the latest question that ended, so silent now it is stalled, not
  gone). Giving up, each question of a burst places its prefix here, blind to the others
  placed meanwhile: in the simulator with the round trip and the placer stalling 60-120 ms
  (`bench/pressure_sim.py`, `RoundTrip`), two askers each placed the same new prefixes on
  different ranks and several on one, u2033.8 0.83x the ideal partition in its worst seed
  (BENCHMARKS.md, "Patience with a stalled placer"). The first failure ends the patience
  of every question still in flight, so a placer gone costs one wait of 4 timeouts, then
  the backoff.
- Both wire types are msgpack arrays decoded all or nothing: a malformed question is refused
  whole (400) and nothing is booked; a malformed answer counts as an error.

Counted (`kvrouter_placements_total{outcome}`): `asked` (questions sent), `answered` (routed
to the placer's rank), `late` (answers read past the timeout, the wait lengthened by a
stall of this replica or held for a stalled placer: each would have been a `timeout`),
`unusable` (answered with a rank that is not a healthy candidate here), `timeout`, `error`,
`busy` (over the bound or backing off), `local` (a new prefix this replica placed itself
as the placer), and `placed` (questions this replica answered).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Final, TypeVar

import aiohttp
import msgspec

from cachetree.keys import MAX_BLOCK_SIZE
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from peer.origin import canonical_origin, http_origin
from peer.spellings import spelling
from router.bounded import read_up_to
from router.log_tally import LogTally
from router.model_servers import ModelAsk
from router.policy import CacheAware, Candidate, Decision, Prompt
from router.siblings import (
    MAX_KEYS_PER_DECISION,
    MAX_WORKER_URL_CHARS,
    failure_backoff_s,
    rank_problem,
    u64_keys,
)

if TYPE_CHECKING:
    from router.dataplane.exchange import Refusal

log = logging.getLogger(__name__)

PATH: Final = "/internal/place"
CONTENT_TYPE: Final = "application/msgpack"
MAX_KEYS: Final = MAX_KEYS_PER_DECISION  # a question carries at most this head of a prompt
MAX_TOKENS: Final = 1 << 24
MAX_BODY_BYTES: Final = 16 + 9 * MAX_KEYS  # the largest well-formed question, and no more
MAX_ANSWER_BYTES: Final = 16 + 3 * MAX_WORKER_URL_CHARS
DEFAULT_TIMEOUT_MS: Final = 50
MAX_TIMEOUT_MS: Final = 1000
DEFAULT_MAX_ASKING: Final = 64
MAX_WAIT_FACTOR: Final = 4  # stalls lengthen a question's wait to at most this many timeouts
STALL_S: Final = 0.002  # a timer this much later than due is a stall of this replica
OUTCOMES: Final = (
    "asked", "answered", "late", "unusable", "timeout", "error", "busy", "local", "placed",
)  # fmt: skip
_LOG_EVERY_S: Final = 60.0
_ERROR_HEAD_BYTES: Final = 200  # of a refusal's body, in the warning


class PlacerRefused(Exception):
    """The placer answered a question with an error status."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"status {status}: {text}")
        self.status = status


class PlaceQuestion(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tokens: int
    block_size: int
    keys: list[int]
    # The model the prompt asks for, when not every rank serves it (`router.model_servers`):
    # the placer decides among those serving it. Left out otherwise, so the common question
    # is the three items a placer of an earlier version reads (`encode_question`).
    model: str | None = None


class PlaceAnswer(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    worker_url: str
    dp_rank: int


T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()
_question_decoder = msgspec.msgpack.Decoder(PlaceQuestion)
_answer_decoder = msgspec.msgpack.Decoder(PlaceAnswer)


def _decode(decoder: msgspec.msgpack.Decoder[T], body: bytes, limit: int, what: str) -> T:
    if len(body) > limit:
        raise ValueError(f"{what} of {len(body)} bytes; at most {limit}")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a placement {what}: {exc}") from None


def encode_question(prompt: Prompt, model: str | None = None) -> bytes:
    """The question about `prompt` (its head, for a prompt past the bounds) asking `model`."""
    keys = list(prompt.keys[:MAX_KEYS])
    question = (min(prompt.tokens, MAX_TOKENS), prompt.block_size, keys)
    # Not a `PlaceQuestion`: msgspec writes an array-like struct's defaults too.
    return _encoder.encode(question if model is None else (*question, model))


def decode_question(body: bytes) -> PlaceQuestion:
    """A received question, checked; ValueError naming the first problem."""
    q = _decode(_question_decoder, body, MAX_BODY_BYTES, "question")
    if not 1 <= q.block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be 1..{MAX_BLOCK_SIZE}")
    if not 0 < len(q.keys) <= MAX_KEYS:
        raise ValueError(f"keys must hold 1..{MAX_KEYS} block keys")
    if not u64_keys(q.keys):
        raise ValueError("block keys must be unsigned 64-bit integers")
    if not len(q.keys) * q.block_size <= q.tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be len(keys) * block_size..{MAX_TOKENS}")
    return q


def refusal_advice(status: int, text: str) -> str:
    """What to check when the placer refused a question with `status`, its body's head in
    `text`. A question it could not read is most often one of another version's (an earlier
    placer reads three items, a question naming a model has four), not a flag to set."""
    if status in (401, 403):
        return "Check that both replicas have the same --internal-token"
    if status == 400 and "block_size" in text:
        return "Check its --block-size against this replica's"
    if status == 404:
        return "Its placement is off: the reason above says what it lacks"
    if status == 503:
        return "It has no healthy worker: give every replica the same worker list"
    if 400 <= status < 500:
        return (
            "A sibling of another version? Finish the rollout: replicas of one version read "
            "each other's questions"
        )
    return "Its log says why"


def encode_answer(rank: RankId) -> bytes:
    return _encoder.encode(PlaceAnswer(rank.worker_url, rank.dp_rank))


def decode_answer(body: bytes) -> RankId:
    """The placer's rank; ValueError when the answer is malformed."""
    a = _decode(_answer_decoder, body, MAX_ANSWER_BYTES, "answer")
    problem = rank_problem(a.worker_url, a.dp_rank)
    if problem is not None:
        raise ValueError(f"answer names no valid rank: {problem}")
    # As this replica's registry spells the worker: a placer of another version names it as
    # its --worker flag was written (`http://localhost:P`, `http://w:80`).
    return RankId(canonical_origin(a.worker_url), a.dp_rank)


def placer_of(own: str | None, peers: Sequence[str]) -> str | None:
    """The sibling to ask (the lowest URL of self and `peers`), or None when this replica is
    the placer, has no siblings, or does not know its own URL. URLs are compared as one
    replica is spelled once (`placer_key`): every replica must elect the same placer however
    its own URL and its list spell them (compared as written, two or three took themselves
    for it)."""
    if own is None or not peers:
        return None
    lowest = min(peers, key=placer_key)
    return lowest if placer_key(lowest) < placer_key(own) else None


@lru_cache(maxsize=4096)
def placer_key(url: str) -> tuple[str, str, int]:
    """A replica's URL as the placer election orders it: `peer.spellings.spelling`, loopback
    names as one (siblings listed by loopback URLs are on one machine)."""
    return spelling(url, fold_loopback=True)


def own_url(self_url: str | None, host: str, port: int, pod_ip: str | None) -> str | None:
    """This replica's URL as its siblings list it: `--self-url`, else the concrete `--host`
    it listens on, else the pod's IP (an EndpointSlice lists pods by IP); None when unknown."""
    if self_url:
        return self_url.rstrip("/")
    if host and host not in ("0.0.0.0", "::"):
        address = host
    elif pod_ip:
        address = pod_ip
    else:
        return None
    return http_origin(address, port)


def election_url(
    self_url: str | None, host: str, ports: Sequence[int], pod_ip: str | None, listed: Sequence[str]
) -> str | None:
    """This replica's URL for the placer election: on the one of its `ports` (`--port`, then
    `--control-port`) a shared `--peer` list names it on, else on the first. Elected on its
    main port while a shared list named every replica by its control port, each replica on one
    host took itself for the placer (the host decides between machines, the port on one). A
    list naming only the others cannot say which port it uses: the main port, or `--self-url`."""
    urls = [url for port in ports if (url := own_url(self_url, host, port, pod_ip))]
    named = {placer_key(url) for url in listed}
    return next((url for url in urls if placer_key(url) in named), urls[0] if urls else None)


def new_prefix(
    ranks: Sequence[RankId],
    keys: Sequence[int],
    device: dict[RankId, int],
    booked: dict[RankId, int],
    routed: Callable[[int], bool],
) -> bool:
    """`keys` are a new prefix in this replica's view: every rank holds them equally deep,
    bookings extending the index's depths; or they go on past the deepest match for at least
    as many blocks again, the first of them routed nowhere lately (module docstring)."""
    depths = [max(device.get(r, 0), booked.get(r, 0)) for r in ranks]
    deepest = max(depths)
    if min(depths) == deepest:
        return True
    return 2 * deepest <= len(keys) and not routed(keys[deepest])


@dataclass(slots=True)
class AskFirst:
    """`RequestRouter.route`'s answer for a new prefix: ask `placer`, then route. The data
    plane runs `wait` and, once it calls back, `RequestRouter.placed`; `cancel` when the
    client left while waiting (nothing is booked here then)."""

    placer: str
    prompt: Prompt
    asker: PlacementAsker
    resume: Callable[[AskFirst], Decision | Refusal]  # the router's decision on the answer
    model: ModelAsk | None = None  # what the request asks for: decided among its servers
    narrowed: bool = False  # not every rank serves it: the question names it
    rank: RankId | None = None  # the placer's answer, once it came
    _task: asyncio.Task[None] | None = None

    def wait(self, then: Callable[[AskFirst], None]) -> None:
        """Ask, then call `then` (on the loop; never when cancelled)."""
        self._task = asyncio.get_running_loop().create_task(self._ask(then))

    async def _ask(self, then: Callable[[AskFirst], None]) -> None:
        model = self.model[0] if self.narrowed and self.model is not None else None
        self.rank = await self.asker.ask(self.placer, encode_question(self.prompt, model))
        try:
            then(self)
        except Exception:  # the data plane's callback: its own bug, never silent
            log.exception("placement: routing a request after the placer's answer failed")

    def decision(self) -> Decision | Refusal:
        """The routing decision now that the answer came (or did not): books it."""
        return self.resume(self)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclass(slots=True)
class Deadline:
    """How long an asker still waits for the placer's answer (plain code, its clock the
    caller's): `timeout_s` from `started`. A wait that ended more than `STALL_S` later than
    it was due was a stall of this replica (its process not scheduled, or one callback
    holding the loop), not a slow placer: an answer may have come meanwhile, unread, and the
    timer fires in the same pass that would read it. So the wait goes on for as long again
    as it was late; at most `max_wait_s` from `started` in all."""

    timeout_s: float
    max_wait_s: float
    started: float
    _end: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.timeout_s <= self.max_wait_s:
            raise ValueError("need 0 <= timeout_s <= max_wait_s")
        self._end = self.started + self.timeout_s

    def left(self, now: float) -> float:
        """Seconds still to wait at `now`; 0 when the deadline passed."""
        return max(0.0, min(self._end, self.started + self.max_wait_s) - now)

    def woke(self, due: float, now: float) -> None:
        """A wait that was due to end at `due` ended at `now`."""
        late = now - due
        if late > STALL_S:
            self._end = max(self._end, now + late)

    def hold(self) -> None:
        """Wait on to `max_wait_s` from `started` (`Placement.patient`)."""
        self._end = self.started + self.max_wait_s


@dataclass
class Placement:
    """The asker's rules (plain code): whether a prompt is a new prefix to ask about, whom to
    ask, the bound on questions in flight and the backoff from a failing placer."""

    policy: CacheAware
    own: str | None
    peers: Callable[[], Sequence[str]]
    max_asking: int = DEFAULT_MAX_ASKING
    clock: Callable[[], float] = time.monotonic
    known: Callable[[RankId], bool] = lambda _rank: True  # a registered worker's rank
    counts: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(OUTCOMES, 0)))
    asking: int = 0
    _unusable: LogTally = field(default_factory=lambda: LogTally(_LOG_EVERY_S))
    _failing: tuple[int, float] = (0, 0.0)  # failures in a row, not asked again until
    _failed_at: float = -math.inf  # when the latest failure was counted in the row

    def __post_init__(self) -> None:
        if self.max_asking < 1:
            raise ValueError("max_asking must be >= 1")

    def question(self, candidates: Sequence[Candidate], prompt: Prompt) -> str | None:
        """The placer to ask about `prompt` now, or None to decide here as usual."""
        depths = prompt.depths
        if depths is None or not prompt.keys or len(candidates) < 2:
            return None
        runs = depths.depth_runs(device=True)
        keys = prompt.keys
        # From the runs first: ranks at two depths (or a holder set smaller than the
        # candidates), one of them deeper than half the prompt, hold more than a preamble.
        if (len(runs) > 1 or (runs and runs[0][0].bit_count() < len(candidates))) and 2 * max(
            depth for _, depth in runs
        ) > len(keys):
            return None
        device = depths.device if runs else {}
        ledger = self.policy.ledger
        booked = ledger.booked_depths(keys, device)
        if not new_prefix([c.rank for c in candidates], keys, device, booked, ledger.routed):
            return None
        placer = placer_of(self.own, self.peers())
        if placer is None:
            self.counts["local"] += 1
            return None
        if self.asking >= self.max_asking or self._failing[1] > self.clock():
            self.counts["busy"] += 1
            return None
        self.asking += 1
        self.counts["asked"] += 1
        return placer

    def patient(self) -> bool:
        """Whether a question unanswered at its timeout waits on, to `MAX_WAIT_FACTOR`
        timeouts from when it was asked: while no failure is counted in the row, so the
        placer answered the latest question that ended. A placer that answered a moment ago
        and is silent now is stalled (its process not run on a loaded host), not gone: each
        question of a burst that gives up is a new prefix placed here blind to the others
        placed meanwhile, a copy when the same prefix is asked about on another replica and
        an uneven fleet when several are (the module docstring). The first failure ends the
        patience for every question still in flight, so a placer gone costs one long wait."""
        return self._failing[0] == 0

    def finished(self, outcome: str, asked_at: float) -> None:
        """A question asked at `asked_at` (this clock) ended: `answered` (an answer came),
        `timeout` or `error`. A failure of a question asked before the latest failure was
        counted is counted but adds nothing to the row: it was in flight with that one, and
        failed with it (a stall, a placer gone), so it is the same failure."""
        self.asking -= 1
        if outcome == "answered":
            self._failing = (0, 0.0)
            return
        self.counts[outcome] += 1
        if asked_at < self._failed_at:
            return
        now = self.clock()
        in_a_row = self._failing[0] + 1
        self._failed_at = now
        self._failing = (in_a_row, now + failure_backoff_s(in_a_row))

    def cancelled(self) -> None:
        """The client left while its question was in flight."""
        self.asking -= 1

    def resolved(
        self, candidates: Sequence[Candidate], prompt: Prompt, rank: RankId | None
    ) -> Decision | None:
        """The asker's decision on the placer's answer: `rank` first, booked here (None when
        there was no answer, or it names no candidate: decide alone then)."""
        if rank is None:
            return None
        decision = self.policy.place(candidates, prompt, rank)
        if decision is not None:
            self.counts["answered"] += 1
            return decision
        self.counts["unusable"] += 1
        if said := self._unusable.count(self.clock()):
            # The placer booked the rank and shared it; this replica's own decision is shared
            # too, so the fleet books the prefix twice until the placer's booking expires.
            if self.known(rank):
                why = "a worker this replica finds unhealthy: replicas see its health differently"
            else:
                why = (
                    "a worker this replica was not given: give every replica the same worker "
                    "list (--worker, or one --worker-selector)"
                )
            log.warning(
                "placement: %d answer(s) of the placer since this was last said named no healthy "
                "candidate here, the last %s, %s; this replica decided those new prefixes "
                "alone, and the placer booked them there",
                said,
                rank,
                why,
            )
        return None


@dataclass
class PlacementAsker:
    """Posts questions to the placer (the asyncio shell around `Placement`)."""

    session: aiohttp.ClientSession
    token: str
    placement: Placement
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000
    _failures: LogTally = field(default_factory=lambda: LogTally(_LOG_EVERY_S))

    async def ask(self, placer: str, question: bytes) -> RankId | None:
        """The placer's rank, or None after a timeout or an error (counted and logged)."""
        loop = asyncio.get_running_loop()
        asked_at = self.placement.clock()
        deadline = Deadline(self.timeout_s, MAX_WAIT_FACTOR * self.timeout_s, loop.time())
        post = asyncio.ensure_future(self._post(placer, question))
        outcome = "error"
        refused = 0  # the placer's error status, when it answered with one
        held = False
        try:
            while not post.done():
                wait = deadline.left(loop.time())
                if wait <= 0:
                    if held or not self.placement.patient():
                        break
                    deadline.hold()
                    held = True
                    continue
                due = loop.time() + wait
                await asyncio.wait((post,), timeout=wait)
                deadline.woke(due, loop.time())
            if post.done():
                rank = post.result()
                outcome = "answered"
                if loop.time() > deadline.started + self.timeout_s:
                    self.placement.counts["late"] += 1
                return rank
            outcome = "timeout"
            problem = f"no answer within {self.timeout_s * 1000:.0f} ms"
        except PlacerRefused as exc:
            problem = str(exc)
            refused = exc.status
        except (aiohttp.ClientError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            post.cancel()  # nothing when it is done; a question left unanswered is dropped
            if outcome == "cancelled":
                self.placement.cancelled()
            else:
                self.placement.finished(outcome, asked_at)
        if self._failures.count(self.placement.clock()):
            if refused:
                log.warning(
                    "placement: the placer %s refused the question (%s); new prefixes are "
                    "placed here meanwhile. %s",
                    placer,
                    problem,
                    refusal_advice(refused, problem),
                )
            else:
                log.warning(
                    "placement: the placer %s did not answer (%s); new prefixes are placed "
                    "here meanwhile. Check that it runs and has the same --internal-token; "
                    "raise --placement-timeout-ms if it is only slow",
                    placer,
                    problem,
                )
        return None

    async def _post(self, placer: str, question: bytes) -> RankId:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": CONTENT_TYPE}
        async with self.session.post(
            placer + PATH, data=question, headers=headers, allow_redirects=False
        ) as r:
            body = await read_up_to(r.content, MAX_ANSWER_BYTES)
            if r.status != 200:
                text = body[:_ERROR_HEAD_BYTES].decode("utf-8", "replace")
                raise PlacerRefused(r.status, text)
            return decode_answer(body)


@dataclass
class Placer:
    """The placer's side of `POST /internal/place` (plain code): decide a sibling's new
    prefix with this replica's own ledger, loads and in-flight, and book it here."""

    policy: CacheAware
    tree: Callable[[], BlockTree | None]
    # The healthy ranks (of the workers given alone), and the workers serving a model.
    candidates: Callable[[frozenset[str] | None], list[Candidate]]
    servers: Callable[[ModelAsk | None], frozenset[str] | None]
    counts: Counter[str]  # the replica's placement counts (`Placement.counts`)

    def place(self, body: bytes) -> bytes | None:
        """The encoded answer; None when no rank is healthy. ValueError (nothing booked) for
        a malformed question or one keyed with another block size."""
        q = decode_question(body)
        tree = self.tree()
        if tree is None or tree.block_size != q.block_size:
            mine = None if tree is None else tree.block_size
            raise ValueError(f"block_size {q.block_size}; this replica's is {mine}")
        # The asker's model, read leniently: the asker checks the rank answered serves it.
        on = None if q.model is None else self.servers((q.model, False))
        candidates = self.candidates(on)
        if not candidates:
            return None
        prompt = Prompt(q.tokens, q.block_size, tree.prefix_depths(q.keys), q.keys)
        decision = self.policy.decide(candidates, prompt)
        self.counts["placed"] += 1
        return encode_answer(decision.ranked[0].rank)
