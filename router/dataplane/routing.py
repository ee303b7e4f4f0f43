"""What the router reads of a generation request, and the routing decision, as plain code.

`RequestRouter.route(path, body)` runs synchronously when a request's body is complete (in
the parser's callback, no task): decode the JSON body, read the prompt the route carries,
tokenize it, key it, ask the index how deep each rank holds it, and let the policy rank the
healthy ranks. It returns the `Decision` the relay walks (failing over down `ranked`), or a
`Refusal` the client gets as is: a malformed body is a 400 naming the field (JSON nested too
deep included, never a 500), no healthy worker a 503.

A body that may hold more than `MAX_BODY_VALUES` JSON values or `MAX_BODY_KEYS` object keys is
not decoded at all (decoding and walking it held the loop for seconds): it is forwarded unread,
routed by load as a miss, counted in `bodies_unread` by route (and a chat's as a tokenize
failure, `too_large`: a chat routed without its tokens) and logged once; the engine validates
it.

A request naming a model is decided among the ranks of the workers serving it
(`router.model_servers`, read by `model_asked`), and so are its placer's question, its
decision after a long prompt's encode and its failover (the policy ranks those ranks alone);
one naming a model no listing holds goes to any worker, whose engine answers, and has the
registry read the listings again (`WorkerRegistry.reread_listings`).

The calls into the tokenizer and the policy sit in one small method, `choose`, so a change of
either interface touches only it.

A new prefix on a replica with siblings (`router.placement`: every candidate rank holds the
prompt equally deep, a check that is O(1) for the common prompt some rank holds deeper) is
placed by the placer replica: `route` then returns an `AskFirst` instead of a decision, the
connection waits for the answer off the loop (`AskFirst.wait`), and `placed` decides on it,
on the ranks healthy then.

A prompt longer than `offload_chars` (a completion's text, or a chat's body: its size bounds
the text rendered from it) is checked and rewritten on the loop, then rendered and encoded
in a worker thread (`router.tokenize.offload`): `route` returns an `EncodeFirst`, the data
plane runs its work off the loop and its continuation on it, which keys, looks up and
decides, on the ranks healthy then, as the synchronous path does (the same keys). When the
data plane's bound on such encodes is full, or its encode waited too long for a thread,
`EncodeFirst.busy` routes it by load as a miss (no keys). Every other request is decided
synchronously as above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Protocol

import msgspec

from cachetree.keys import block_keys, namespace_seed
from router.dataplane.exchange import RETRY_SOON, Refusal
from router.dataplane.inflight import InflightTracker
from router.events import namespace_of
from router.index import IndexRules
from router.loads import LoadMonitor
from router.metrics import RouterMetrics
from router.model_servers import EVERY, ModelAsk, ModelServers, model_servers
from router.placement import AskFirst, Placement, PlacementAsker
from router.policy import Candidate, Decision, Policy, Prompt
from router.tokenize import ChatRequestError, ChatTokens, Engine, RequestTokenizer
from router.tokenize.lax import lax_int, sglang_token_id
from router.tokenize.offload import Offload
from router.tokenize.params import COMPLETION, BadField, chat_params, completion_params
from router.workers import WorkerRegistry

log = logging.getLogger(__name__)


Routed = Decision | Refusal | AskFirst


@dataclass(frozen=True, slots=True)
class EncodeFirst:
    """`RequestRouter.route`'s answer for a prompt too long to encode on the loop: the data
    plane runs `work.run` in a worker thread, then `work.then` on the loop with its outcome,
    which decides; or, when its bound on such encodes is full, `busy` at once (by load, a
    miss), as it is when no thread took the encode in time (`EncodeQueue.late`). Each is
    called once at most, and neither when the client left first."""

    work: Offload[Routed]
    busy: Callable[[], Routed]


class Router(Protocol):
    """What the data plane asks when a generation request's body is complete."""

    def route(self, route: bytes, raw: bytes) -> Routed | EncodeFirst: ...


# The policies that read the index; the others decide without tokenizing the prompt.
INDEX_POLICIES: Final = frozenset({"cache_aware"})
# The policies that read no load either: they order the routable ranks alone, and are given
# them as kept between requests (`RequestRouter.ranks_alone`), not as a fresh read of every
# rank's in-flight count and engine load.
ORDER_POLICIES: Final = frozenset({"round_robin", "random"})
NO_PROMPT: Final = Prompt(0, 1)  # what an index-free policy is told of a prompt
CHAT = b"/v1/chat/completions"
GENERATE = b"/generate"
# Read on every request (`model_asked`): an enum member read through its class costs ~0.1 us
# on Python 3.11, a module global a fifth of it.
_VLLM: Final = Engine.VLLM


# JSON values and object keys a body may hold for the router to read it (decode, check,
# tokenize, key) on the event loop, where each costs time: a 30 MiB chat of 10.5M empty content
# parts held the loop 4.6 s (0.7 s of it to decode), 16M token ids 1.7 s, and a key costs ~1 us
# to decode when keys do not repeat (one object of a million, 0.9 s). At these bounds the
# costliest shapes take ~100 ms. A real request holds far fewer: a 128k-token prompt of ids
# ~131k values, a chat of 1,000 turns with tools ~20k of each.
MAX_BODY_VALUES: Final = 1 << 19
MAX_BODY_KEYS: Final = 1 << 17
# A text (a completion's prompt; a chat's body) longer than this is rendered and encoded in a
# worker thread (`--tokenize-offload-chars`). Measured (tests' model directories, a 32k
# byte-level vocabulary among them): encoding costs ~0.2 ms per 1,000 characters, 1.3-1.9 ms
# at 8,000, 180-560 ms at 512 Ki; a hand-off to the thread and back costs ~0.1 ms and a turn
# of the loop, which shorter texts would not win back.
DEFAULT_OFFLOAD_CHARS: Final = 8192


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def decode_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; `BadRequest` otherwise."""
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec's own depth guard; it is not a DecodeError, and must not become a 500.
        raise BadRequest("body is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object")
    return value


# Every byte but the marks `past_bounds` counts: deleted in one pass, at ~1 GB/s (a pass of
# `bytes.count` per mark cost four times as much on a large body).
_NOT_MARKS: Final = bytes(c for c in range(256) if c not in b",[{:")


def past_bounds(raw: bytes) -> str | None:
    """What `raw` may hold more of than the router reads on its event loop, or None. Values:
    its commas and opening brackets, since every other value is the first of its array or
    object or follows a comma; keys: its colons. Characters inside strings count too, so this
    overstates a text with many of them. A body no longer than the smaller bound is not
    scanned (each counted character is a byte)."""
    if len(raw) <= MAX_BODY_KEYS:
        return None
    marks = raw.translate(None, _NOT_MARKS)
    if len(marks) <= MAX_BODY_KEYS:
        return None
    keys = marks.count(b":")
    if keys > MAX_BODY_KEYS:
        return f"up to {keys} object keys (bound {MAX_BODY_KEYS})"
    if len(marks) - keys > MAX_BODY_VALUES:
        return f"up to {len(marks) - keys} JSON values (bound {MAX_BODY_VALUES})"
    return None


def prompt_param(route: bytes, body: dict[str, Any]) -> str:
    """The field a completion or /generate body carries its prompt in: for /generate,
    `input_ids` unless it is absent or null (as SGLang reads it), else `text`."""
    if route == GENERATE:
        return "text" if body.get("input_ids") is None else "input_ids"
    return "prompt"


def embeds_only(route: bytes, body: dict[str, Any]) -> bool:
    """Whether a completion or /generate body brings its prompt as embeddings alone: vLLM's
    `prompt_embeds` (base64 tensors: a string or a non-empty list of them) with no `prompt`,
    SGLang's `input_embeds` (a non-empty list) with neither `text` nor `input_ids`. The
    engines serve these; they have no token ids, so they are routed by load, as a miss."""
    if route == GENERATE:
        embeds = body.get("input_embeds")
        return (
            body.get("text") is None
            and body.get("input_ids") is None
            and type(embeds) is list
            and len(embeds) > 0
        )
    embeds = body.get("prompt_embeds")
    if body.get("prompt") is not None or embeds is None:
        return False  # most requests: two lookups
    return type(embeds) is str or (
        type(embeds) is list and len(embeds) > 0 and all(type(e) is str for e in embeds)
    )


def prompt_of(route: bytes, body: dict[str, Any]) -> Any:
    """The prompt field of a completion or /generate body (one prompt of a batch)."""
    param = prompt_param(route, body)
    if route == GENERATE:
        if body.get(param) is None:
            raise BadRequest("one of 'text', 'input_ids' or 'input_embeds' is required", "text")
        if param == "input_ids" and not isinstance(body[param], list):
            raise BadRequest("'input_ids' must be a list of token ids", param)
    elif param not in body:
        raise BadRequest("'prompt' (or 'prompt_embeds') is required", "prompt")
    return single(body[param], param)


def messages_of(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    return messages


def single(prompt: Any, param: str) -> Any:
    """A prompt, or the first of a batch of prompts (they are routed together).

    A list is a batch of texts only when every item is a string: the engines' request models
    read `["1", 2]` as the token ids 1 and 2 (pydantic's lax union), and `/generate` never
    takes strings among its `input_ids`."""
    if type(prompt) is str:  # most requests: one string, nothing more to check
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, list):
            return first
        if type(first) is str and param != "input_ids" and all(type(p) is str for p in prompt):
            return first
    if not isinstance(prompt, str | list):
        raise BadRequest(f"'{param}' must be a string or a list of token ids", param)
    return prompt


def param_of(route: bytes) -> str:
    return {CHAT: "messages", GENERATE: "text"}.get(route, "prompt")


def namespace_for(
    route: bytes,
    body: dict[str, Any],
    ask: ModelAsk | None,
    adapters: Collection[str],
    served: Collection[str],
    engine: Engine,
) -> str | None:
    """The key namespace of a request: its LoRA adapter and cache salt, as events carry them
    (`events.namespace_of`), the adapter named as its engine reads the name. `ask` is what
    the request asks for (`model_asked`, read once per request: its adapter, when it names
    one, is in it), `served` the base model names the workers' `/v1/models` list
    (`WorkerRegistry.served_models`), `adapters` the adapter names learned
    (`IndexRules.adapters`).
    - vLLM: `model` is a served base model's name or an adapter's (absent: the base model). A
      name that is neither a served one nor a learned adapter is keyed in its own namespace
      once any served name is known: it names an adapter loaded since (its blocks are keyed
      so), or nothing vLLM serves (refused, nothing cached); keyed as the base model's, it was
      a false hit on the base model's blocks. With no served name known (no worker's
      `/v1/models` was readable) names cannot be told apart, and only a learned one is keyed
      as an adapter's.
    - SGLang: `model` as "base:adapter" (a served name is a base model's, colons and all;
      the adapter part stripped), else `lora_path` (the first, for a batch), as SGLang picks
      them. Both name the adapter outright, learned or not: SGLang refuses one not loaded.
    - `/generate`, SGLang's native API (whichever engine: vLLM serves no such route):
      `lora_path` alone. Its request (GenerateReqInput) has no `model` field, so SGLang
      drops a `model` unread there, "base:adapter" or not."""
    salt = body.get("cache_salt")
    lora = _adapter_asked(route, ask, adapters, served, engine)
    if lora is None and salt is None:  # most requests
        return None
    return namespace_of(lora, _str_or_none(salt))


def _adapter_asked(
    route: bytes,
    ask: ModelAsk | None,
    adapters: Collection[str],
    served: Collection[str],
    engine: Engine,
) -> str | None:
    """The adapter in what a request asks for: a strict name is an adapter's (`model_asked`)
    but for vLLM's `model`, which may name a base model too."""
    if ask is None or not ask[1]:
        return None
    name = ask[0]
    if engine is not _VLLM or route == GENERATE:
        return name
    if name in served:
        return None
    return name if served or name in adapters else None


def model_asked(
    route: bytes, body: dict[str, Any], served: Collection[str], engine: Engine
) -> ModelAsk | None:
    """The model a request must go to a worker serving (`router.model_servers`): vLLM's
    `model`, a base model's or an adapter's name; SGLang's adapter ("base:adapter" or
    `lora_path`), else its `model`, which SGLang serves whatever it names (not `strict`); on
    `/generate`, `lora_path` alone. None: any worker. Whatever names an adapter is strict, so
    `namespace_for` reads the adapter from here rather than from the body again."""
    if route == GENERATE:
        lora = _lora_path(body)
        return None if lora is None else (lora, True)
    model = body.get("model")
    if engine is _VLLM:
        return (model, True) if type(model) is str and model else None
    if type(model) is str and ":" in model and model not in served:
        adapter = _sglang_model_adapter(model, served)
        if adapter:
            return (adapter, True)
    lora = _lora_path(body)
    if lora is not None:
        return (lora, True)
    return (model, False) if type(model) is str and model else None


def _lora_path(body: dict[str, Any]) -> str | None:
    """SGLang's `lora_path`: the adapter it names (the first, for a batch), or None."""
    path = body.get("lora_path")
    if type(path) is list:
        path = path[0] if path else None
    return path if type(path) is str and path else None


def _sglang_model_adapter(model: str, served: Collection[str]) -> str:
    """The adapter part of SGLang's "base:adapter" `model` (empty: none): after a served name
    the model starts with, else after the first colon."""
    for base in served:
        if model.startswith(base) and model[len(base) : len(base) + 1] == ":":
            return model[len(base) + 1 :].strip()
    return model.split(":", 1)[1].strip()


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


@dataclass(slots=True)
class RequestRouter:
    """The replica's parts a routing decision reads."""

    tokenizer: RequestTokenizer
    policy: Policy
    workers: WorkerRegistry
    loads: LoadMonitor
    inflight: InflightTracker
    rules: IndexRules
    metrics: RouterMetrics
    # A new prefix is placed by the placer replica (`router.placement`); None: off.
    placement: Placement | None = None
    asker: PlacementAsker | None = None
    # A longer text is encoded off the loop (`EncodeFirst`); 0: never.
    offload_chars: int = DEFAULT_OFFLOAD_CHARS
    # Kept between requests (`_keep`): the registry's routable ranks last read (a new list
    # whenever they or the workers' listings change), and what was made of them: the
    # candidates of `ranks_alone`, those of each set of workers a model is served by, and
    # the model table of `servers`.
    _kept_of: object = field(default=None, init=False, repr=False)
    _alone: list[Candidate] = field(default_factory=list, init=False, repr=False)
    _alone_on: dict[frozenset[str], list[Candidate]] = field(
        default_factory=dict, init=False, repr=False
    )
    _servers: ModelServers = field(
        default_factory=lambda: model_servers(()), init=False, repr=False
    )
    _logged_unread: bool = field(default=False, init=False, repr=False)

    def candidates(self, on: frozenset[str] | None = None) -> list[Candidate]:
        """The healthy ranks with this replica's in-flight and their engines' loads: of the
        workers `on` alone, when given (`servers`)."""
        counts, fresh = self.inflight.counts, self.loads.fresh
        candidates = []
        for w, ranks in self.workers.routable_ranks():  # remade only when the workers change
            if on is not None and w.url not in on:
                continue
            engine = fresh(w.url)
            for r in ranks:
                candidates.append(Candidate(r, counts[r], engine.get(r.dp_rank)))
        return candidates

    def ranks_alone(self, on: frozenset[str] | None = None) -> list[Candidate]:
        """The healthy ranks, in `candidates`' order, with no in-flight count or load: for an
        `ORDER_POLICIES` policy, which reads neither; of the workers `on` alone, when given.
        Made again only when the ranks change (callers do not change the list)."""
        self._keep()
        return self._alone if on is None else self._alone_on_workers(on)

    def servers(self, ask: ModelAsk | None) -> frozenset[str] | None:
        """The routable workers a request asking for `ask` may go to (None: every one), by a
        table made again only when the ranks or listings change."""
        self._keep()
        return self._servers.workers_for(ask)

    def _keep(self) -> None:
        """What is kept between requests, made anew when the routable ranks changed."""
        routable = self.workers.routable_ranks()
        if routable is not self._kept_of:
            self._alone = [Candidate(r) for _, ranks in routable for r in ranks]
            self._alone_on = {}
            self._servers = model_servers((w.url, w.models) for w, _ in routable)
            self._kept_of = routable

    def _alone_on_workers(self, on: frozenset[str]) -> list[Candidate]:
        alone = self._alone_on.get(on)
        if alone is None:  # one list per set of workers serving a model: a bounded few
            alone = [c for c in self._alone if c.rank.worker_url in on]
            self._alone_on[on] = alone
        return alone

    def route(self, route: bytes, raw: bytes) -> Routed | EncodeFirst:
        body: dict[str, Any] | None = None
        past = past_bounds(raw)
        if past is not None:
            self._unread(route, len(raw), past)
        else:
            try:
                body = decode_body(raw)
            except BadRequest as exc:
                return Refusal(400, str(exc), param=exc.param)
        ask = (
            None
            if body is None  # unread: the engine validates it
            else model_asked(route, body, self.workers.served_models, self.tokenizer.engine)
        )
        self._keep()  # what follows reads the kept parts as `servers` and `ranks_alone` do
        on = EVERY
        if ask is not None:
            on = self._servers.workers_for(ask)
            if self._servers.unheard(on):  # loaded since the listings were read, or nowhere
                self.workers.reread_listings()
        if self.policy.name not in ORDER_POLICIES:
            candidates = self.candidates(on)
        else:
            candidates = self._alone if on is None else self._alone_on_workers(on)
        if not candidates:
            return self._no_candidates()
        try:
            decision = self.choose(route, body, candidates, len(raw), ask)
        except BadRequest as exc:
            return Refusal(400, str(exc), param=exc.param)
        except ValueError as exc:  # the tokenizer's: a chat it cannot take
            return Refusal(400, str(exc), param=param_of(route))
        if isinstance(decision, AskFirst | EncodeFirst):
            return decision
        return self._counted(decision)

    def placed(self, ask: AskFirst) -> Decision | Refusal:
        """The decision for a new prefix once its placer answered (`ask.rank`) or did not:
        on the ranks healthy now serving its model, by the index now (either may have
        changed while waiting)."""
        candidates = self.candidates(self.servers(ask.model))
        tree = self.rules.tree
        if not candidates or tree is None:
            return self._no_candidates()
        prompt = ask.prompt
        prompt = Prompt(
            prompt.tokens, prompt.block_size, tree.prefix_depths(prompt.keys), prompt.keys
        )
        placement = self.placement
        assert placement is not None
        decision = placement.resolved(candidates, prompt, ask.rank)
        return self._counted(decision or self.policy.decide(candidates, prompt))

    def _encode_first(
        self,
        route: bytes,
        body: dict[str, Any],
        tokens: Offload[Sequence[int]],
        candidates: list[Candidate],
        ask: ModelAsk | None,
    ) -> EncodeFirst:
        """What `choose` does after tokenizing, once `tokens` is encoded off the loop."""

        def encoded(ids: Callable[[], Sequence[int]]) -> Routed:
            try:
                tokens = ids()
            except BadRequest as exc:
                return Refusal(400, str(exc), param=exc.param)
            # The ranks healthy now serving its model, after the wait.
            now = self.candidates(self.servers(ask))
            if not now:
                return self._no_candidates()
            return self._counted_unless_asked(self._keyed(route, body, tokens, now, ask))

        def busy() -> Routed:  # counted by the data plane (`EncodeQueue.busy`, `.late`)
            return self._counted_unless_asked(self._keyed(route, body, (), candidates, ask))

        return EncodeFirst(tokens.map(encoded), busy)

    def _counted_unless_asked(self, decision: Decision | AskFirst) -> Decision | AskFirst:
        return decision if isinstance(decision, AskFirst) else self._counted(decision)

    def _chat_ids(self, encoded: ChatTokens) -> Sequence[int]:
        if encoded.failure is not None:
            # Rendered unlike the engine would: forwarded all the same, routed by load alone
            # (no tokens, no keys), as a miss.
            self.metrics.tokenize_failures[(encoded.failure,)] += 1
        return encoded.ids

    def _offloads(self, chars: int) -> bool:
        return 0 < self.offload_chars < chars

    def _unread(self, route: bytes, size: int, past: str) -> None:
        self.metrics.bodies_unread[(route.decode(),)] += 1
        if route == CHAT:  # the tokenize failures are chats'; the alert divides by chats
            self.metrics.tokenize_failures[("too_large",)] += 1
        if self._logged_unread:
            return
        self._logged_unread = True
        log.warning(
            "a %s body of %d bytes holds %s, more than the router reads on its event "
            "loop: it is forwarded unread (the engine validates it), routed by "
            "load as a miss and counted in kvrouter_bodies_unread_total. "
            "No real request comes near this bound: look for the client that sends such "
            "bodies. Logged once.",
            route.decode(errors="replace"),
            size,
            past,
        )

    def _no_candidates(self) -> Refusal:
        self.metrics.decisions[self.policy.name, "no_candidates"] += 1
        return Refusal(
            503, "no healthy worker to route to", type="service_unavailable", extra=RETRY_SOON
        )

    def _counted(self, decision: Decision) -> Decision:
        self.metrics.decisions[self.policy.name, decision.outcome] += 1
        self.metrics.matched_blocks.observe(decision.matched_blocks)
        return decision

    def choose(
        self,
        route: bytes,
        body: dict[str, Any] | None,
        candidates: list[Candidate],
        size: int,
        ask: ModelAsk | None,
    ) -> Decision | AskFirst | EncodeFirst:
        """Tokenize, key, look up and decide: every call into the tokenizer and the policy.
        A body left unread (None: `past_bounds`) is routed by load, as a miss. A text longer
        than `offload_chars` (a chat: a body of `size` bytes) is encoded off the loop.
        `candidates` serve the model the request asks for (`ask`, whose adapter keys it):
        so do those its placer or the continuation of its encode decide among.

        A policy that does not read the index (round_robin, random, least_load,
        power_of_two) decides on the candidates alone: the prompt is checked for its shape
        but not tokenized or keyed (its CPU was a quarter of such a request's routing work),
        and what the tokenizer alone would refuse is left to the engine to refuse.
        """
        if self.policy.name not in INDEX_POLICIES:
            if body is not None and route == CHAT:
                messages_of(body)
            elif body is not None and not embeds_only(route, body):
                prompt_of(route, body)
            return self.policy.decide(candidates, NO_PROMPT)
        engine = self.tokenizer.engine
        tokens: Sequence[int] = ()  # none: routed by load alone, as a miss
        if body is None:  # unread: counted by `route`
            pass
        elif route != CHAT and embeds_only(route, body):
            self.metrics.tokenize_failures[("embeds",)] += 1
        elif route == CHAT:
            messages_of(body)
            try:
                encoded = self.tokenizer.encode_chat_request(
                    body, chat_params(body, engine), offload=self._offloads(size)
                )
            except (ChatRequestError, BadField) as exc:
                raise BadRequest(str(exc), exc.param) from None
            if isinstance(encoded, Offload):
                ids = encoded.map(lambda outcome: self._chat_ids(outcome()))
                return self._encode_first(route, body, ids, candidates, ask)
            tokens = self._chat_ids(encoded)
        else:
            prompt = prompt_of(route, body)
            param = prompt_param(route, body)
            offload = type(prompt) is str and self._offloads(len(prompt))
            try:
                if route == GENERATE:  # SGLang's own model: no tokenization fields
                    params, token_id = COMPLETION, sglang_token_id
                else:
                    params, token_id = completion_params(body, engine), lax_int
                encoded_prompt = self.tokenizer.encode_prompt(
                    prompt, params, token_id=token_id, offload=offload
                )
            except BadField as exc:
                raise BadRequest(str(exc), exc.param) from None
            except ValueError as exc:  # a prompt the tokenizer cannot take
                raise BadRequest(str(exc), param) from None
            if isinstance(encoded_prompt, Offload):
                ids = encoded_prompt.map(partial(_prompt_ids, param))
                return self._encode_first(route, body, ids, candidates, ask)
            tokens = encoded_prompt
        return self._keyed(route, body, tokens, candidates, ask)

    def _keyed(
        self,
        route: bytes,
        body: dict[str, Any] | None,
        tokens: Sequence[int],
        candidates: list[Candidate],
        ask: ModelAsk | None,
    ) -> Decision | AskFirst:
        """Key `tokens`, look their blocks up and decide (or ask the placer)."""
        engine = self.tokenizer.engine
        tree = self.rules.tree
        if tree is None:  # no worker registered yet: no block size, no index
            return self.policy.decide(candidates, Prompt(len(tokens), 1))
        namespace = (
            None
            if body is None
            else namespace_for(
                route, body, ask, self.rules.adapters, self.workers.served_models, engine
            )
        )
        keys = block_keys(tokens, tree.block_size, namespace_seed(namespace))
        prompt = Prompt(len(tokens), tree.block_size, tree.prefix_depths(keys), keys)
        if self.placement is not None and self.asker is not None:
            placer = self.placement.question(candidates, prompt)
            if placer is not None:  # a new prefix: its placer decides
                narrowed = self.servers(ask) is not None
                return AskFirst(placer, prompt, self.asker, self.placed, ask, narrowed)
        return self.policy.decide(candidates, prompt)


def _prompt_ids(param: str, ids: Callable[[], Sequence[int]]) -> Sequence[int]:
    """A prompt's ids encoded off the loop; what the tokenizer cannot take is a 400, as on
    the synchronous path."""
    try:
        return ids()
    except ValueError as exc:
        raise BadRequest(str(exc), param) from None
