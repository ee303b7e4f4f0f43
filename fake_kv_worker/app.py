"""The fake worker's HTTP surface (aiohttp): engine endpoints plus test controls.

Engine endpoints behave like vLLM/SGLang's as far as a router can tell: `/health`,
`/server_info` (SGLang's `kv_events` discovery block), `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, `/generate`, `/v1/loads` (smg schema), `/metrics`, and, with
`--serve-kv-snapshot`, `/v1/kv-snapshot`. A request picks its dp rank with the
`X-Data-Parallel-Rank` header, as the router sends it.

Test controls under `/control/*` drive KV events by request, never on a timer, and every one
answers with the `last_seq` of the rank it touched, so a test can wait until a subscriber has
seen exactly that seq. See `engine.py` for how actions map to batches.

A request naming one of `--lora-modules` (`WorkerState.adapter_of`) is served under that LoRA
adapter: its prompt hits only blocks cached under it, and its blocks are published (and listed
by `/v1/kv-snapshot`) with the adapter's `lora_name`; `/control/store` takes `lora_name` too.
`/v1/models` lists each adapter as the engines do: a model whose `parent` is the served one.
The vLLM flavour also serves vLLM's runtime LoRA routes (those `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
turns on): `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads one (no weights: any
path is taken) and `POST /v1/unload_lora_adapter {"lora_name"}` drops one, `--lora-modules`'
too, changing what `/v1/models` lists and which names are served, with vLLM's 400s and 404.
`/control/state` counts the `/v1/models` reads (`models_reads`).

Two response headers say what a generation request cost, for tests that assert costs:
`X-Fake-Worker-DP-Rank` and `X-Fake-Worker-Cached-Tokens`.

With `--api-key`, as vLLM's: every `/v1/*` request without `Authorization: Bearer <key>` is a
401 in the OpenAI error shape (`/health`, `/metrics` and the controls stay open).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import msgspec
from aiohttp import web

from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.engine import RankEngine
from fake_kv_worker.metrics import loads_body, prometheus_text
from fake_kv_worker.model_chat import ModelChat, Truncation, given_chat_ids, vllm_cut
from fake_kv_worker.protocol import (
    DP_RANK_HEADER,
    ChatShape,
    CompletionShape,
    GenerateShape,
    GenerationRequest,
    RequestError,
    ResponseShape,
    Usage,
    dp_rank_of,
    error_body,
    filler_piece,
    filler_text,
    get_int,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_object,
    token_chains,
)
from fake_kv_worker.publisher import RankPublisher
from fake_kv_worker.text import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

CACHED_TOKENS_HEADER: Final = "X-Fake-Worker-Cached-Tokens"
SERVED_RANK_HEADER: Final = "X-Fake-Worker-DP-Rank"


class FailureBudget:
    """The next `count` generation requests fail with `status` (`--fail-first`, /control/fail)."""

    def __init__(self, count: int, status: int = 503) -> None:
        self.count = count
        self.status = status
        self.failed = 0

    def take(self) -> int | None:
        if self.count <= 0:
            return None
        self.count -= 1
        self.failed += 1
        return self.status


class WorkerState:
    """Everything the routes read and drive. Built by `server.FakeWorker`."""

    def __init__(
        self,
        config: WorkerConfig,
        ranks: list[RankEngine],
        publishers: list[RankPublisher],
        *,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.publishers = publishers
        self.tokenizer: Tokenizer = ByteTokenizer()
        # A model directory: its tokenizer, and its chat template under the engine's chat rules.
        self.model: ModelChat | None = None
        if config.tokenizer != "bytes":
            self.model = ModelChat(
                config.tokenizer, config.metrics_engine, config.cache_blocks * config.block_size
            )
            self.tokenizer = self.model
        self.failures = FailureBudget(config.fail_first)
        # The loaded adapters, by name, with the path `/v1/models` gives as their root (vLLM's
        # `lora_path`; a `--lora-modules` one's is its name), in the order they were loaded.
        self.adapters: dict[str, str] = {name: name for name in config.lora_modules}
        self.models_reads = 0  # GET /v1/models answered: what a router's listing reads cost
        self._clock = clock
        self._ready_at = clock() + config.startup_delay_s

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if self.model is not None and req.chat is not None:
            return self.model.chat_ids(dict(req.chat))
        given = None if req.chat is None else given_chat_ids(req.chat, self.config.metrics_engine)
        if given is not None:  # bytes: a chat's ids for the engine to take as they are
            return given
        truncation = self._truncation(req)
        if isinstance(req.prompt, list):
            return vllm_cut(req.prompt, truncation)
        if self.model is not None:
            return self.model.encode(req.prompt, req.add_special_tokens, truncation)
        # bytes: no special tokens to add or to keep room for
        return vllm_cut(self.tokenizer.encode(req.prompt), truncation)

    def _truncation(self, req: GenerationRequest) -> Truncation:
        """vLLM's cut of a completion prompt; SGLang's models have no such fields."""
        keep, side = req.truncation
        if self.config.metrics_engine == "sglang":
            return None, None
        if keep == -1:  # the model's context less the tokens asked for
            keep = self.config.cache_blocks * self.config.block_size - req.max_tokens
        return keep, side

    def healthy(self) -> bool:
        return self._clock() >= self._ready_at

    def rank_from_body(self, body: Mapping[str, Any]) -> int:
        return dp_rank_of(body.get("dp_rank"), self.config.dp_size, "dp_rank")

    def adapter_of(self, body: Mapping[str, Any], *, native: bool) -> str | None:
        """The loaded adapter a request names, as the engine reads it (None: the base model).
        vLLM: `model` is the served model's name or an adapter's (absent or empty: the served
        model); any other name is answered 404 as vLLM's `_check_model` answers it. SGLang:
        `model` as "base:adapter" (after the served name, or else the first colon; stripped),
        else `lora_path` (the first, for a batch); either must name a loaded adapter. SGLang's
        native `/generate` (`native`; read so whichever engine the fake plays) has no `model`
        field (its GenerateReqInput drops it unread): `lora_path` alone names the adapter."""
        loaded = self.adapters
        model = None if native else body.get("model")
        if self.config.metrics_engine == "vllm" and not native:
            if not isinstance(model, str) or not model or model == self.config.model:
                return None
            if model not in loaded:
                raise RequestError(
                    f"The model `{model}` does not exist.",
                    "model",
                    status=404,
                    type_="NotFoundError",
                )
            return model
        name, param = None, "model"
        if isinstance(model, str) and ":" in model and model != self.config.model:
            served = self.config.model + ":"
            cut = len(served) if model.startswith(served) else model.index(":") + 1
            name = model[cut:].strip() or None
        if name is None:
            name, param = body.get("lora_path"), "lora_path"
            if isinstance(name, list):
                name = name[0] if name else None
        if name is not None and (not isinstance(name, str) or name not in loaded):
            raise RequestError(f"{param}: {name!r} is not a loaded adapter", param)
        return name


STATE_KEY: Final = web.AppKey("fake_kv_worker_state", WorkerState)


def _json(
    body: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        log.info("%s %s rejected: %s (param %s)", request.method, request.path, exc, exc.param)
        return _json(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (404, 405, 413 body too large) get the same JSON shape.
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        keep = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return _json(error_body(exc.reason, kind, None), status=exc.status, headers=keep)


@web.middleware
async def _api_key(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    key = request.app[STATE_KEY].config.api_key
    if key is None or not request.path.startswith("/v1/"):
        return await handler(request)
    if request.headers.get("Authorization") != f"Bearer {key}":
        return _json(error_body("Unauthorized", "authentication_error", None), status=401)
    return await handler(request)


async def _read_body(request: web.Request) -> dict[str, Any]:
    # `read` enforces client_max_size (413) before anything is parsed.
    return parse_json_object(await request.read())


# --- engine endpoints -----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.healthy():
        return _json(error_body("starting up", "service_unavailable", None), status=503)
    return web.Response(status=200)


async def server_info(request: web.Request) -> web.Response:
    cfg = request.app[STATE_KEY].config
    kv_events: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": cfg.host,
        "endpoint_port_base": cfg.kv_port_base,
        "topic": cfg.topic,
        "block_size": cfg.block_size,
        "dp_size": cfg.dp_size,
    }
    if cfg.replay_port_base > 0:
        kv_events["replay_endpoint_port_base"] = cfg.replay_port_base
    return _json(
        {"served_model_name": cfg.model, "speculative_algorithm": None, "kv_events": kv_events}
    )


async def models(request: web.Request) -> web.Response:
    """The served model, then each loaded adapter as a card whose `parent` is the served
    model, as vLLM's and SGLang's `/v1/models` list loaded adapters."""
    state = request.app[STATE_KEY]
    state.models_reads += 1
    cfg = state.config
    created = int(time.time())
    card = {"object": "model", "created": created, "owned_by": cfg.metrics_engine}
    base = {**card, "id": cfg.model, "root": cfg.model, "parent": None}
    base["max_model_len"] = cfg.cache_blocks * cfg.block_size
    adapters = [
        {**card, "id": name, "root": root, "parent": cfg.model}
        for name, root in state.adapters.items()
    ]
    return _json({"object": "list", "data": [base, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's `/v1/load_lora_adapter`: the adapter is served and listed from now on. Both
    names are required, and a name already loaded is refused (400s, as vLLM's
    `_check_load_lora_adapter_request`); success is vLLM's plain-text 200."""
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not _name(name) or not _name(path):
        raise RequestError(
            "Both 'lora_name' and 'lora_path' must be provided.", None, type_="InvalidUserInput"
        )
    if name in state.adapters:
        raise RequestError(
            f"The lora adapter '{name}' has already been loaded.", None, type_="InvalidUserInput"
        )
    state.adapters[name] = path
    log.info("loaded LoRA adapter %r (path %r)", name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's `/v1/unload_lora_adapter`: the adapter is no longer served nor listed; one not
    loaded is vLLM's 404."""
    state = request.app[STATE_KEY]
    name = (await _read_body(request)).get("lora_name")
    if not _name(name):
        raise RequestError(
            "'lora_name' needs to be provided to unload a LoRA adapter.",
            None,
            type_="InvalidUserInput",
        )
    if name not in state.adapters:
        raise RequestError(
            f"The lora adapter '{name}' cannot be found.",
            None,
            status=404,
            type_="NotFoundError",
        )
    del state.adapters[name]
    log.info("unloaded LoRA adapter %r", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


async def loads(request: web.Request) -> web.Response:
    return _json(loads_body(request.app[STATE_KEY].ranks))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    text = prometheus_text(state.ranks, state.config.metrics_engine, state.config.model)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


# The tier names of the snapshot body, by engine medium (vLLM's and SGLang's spellings).
_MEDIUM_TIERS = {
    "GPU": "device",
    "CPU": "host",
    "CPU_PINNED": "host",
    "DISK": "disk",
    "NVME": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
}


def _tier_name(medium: str) -> str | None:
    # An unknown medium has no tier a router would count: report null rather than guess.
    return _MEDIUM_TIERS.get(medium.upper())


async def kv_snapshot(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    # Built without an await, so every rank's blocks are exactly its state as of its last_seq.
    body = {
        "ranks": [rank.snapshot(_tier_name) for rank in state.ranks],
        "block_size": state.config.block_size,
    }
    return _json(body)


Parser = Callable[[Mapping[str, Any], int], GenerationRequest]
ShapeFactory = Callable[[str], ResponseShape]


def _generation_route(
    parse: Parser, shape_factory: ShapeFactory, *, native: bool = False
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE_KEY]
        status = state.failures.take()
        if status is not None:
            log.info(
                "%s failed on purpose with %d (%d more to fail)",
                request.path,
                status,
                state.failures.count,
            )
            return _json(error_body("injected failure", "server_error", None), status=status)
        dp_rank = dp_rank_of(
            request.headers.get(DP_RANK_HEADER), state.config.dp_size, DP_RANK_HEADER
        )
        body = await _read_body(request)
        req = parse(body, state.config.max_tokens_default)
        lora_name = state.adapter_of(body, native=native)
        tokens = state.prompt_ids(req)
        if not tokens and not req.embeds:
            raise RequestError("the prompt is empty", req.prompt_param)
        rank = state.ranks[dp_rank]
        shape = shape_factory(state.config.model)
        async with rank.serve(tokens, lora_name) as served:
            headers = {
                SERVED_RANK_HEADER: str(dp_rank),
                CACHED_TOKENS_HEADER: str(served.cached_tokens),
            }
            log.debug(
                "dp rank %d serving %s: %d prompt tokens, %d cached, %d to generate",
                dp_rank,
                request.path,
                served.prompt_tokens,
                served.cached_tokens,
                req.max_tokens,
            )
            if not req.stream:
                for _ in range(req.max_tokens):
                    await rank.decode_step()
                usage = Usage(served.prompt_tokens, req.max_tokens, served.cached_tokens)
                return _json(shape.full(filler_text(req.max_tokens), usage), headers=headers)
            return await _stream(
                request, rank, shape, req, served.prompt_tokens, served.cached_tokens, headers
            )

    return handle


async def _stream(
    request: web.Request,
    rank: RankEngine,
    shape: ResponseShape,
    req: GenerationRequest,
    prompt_tokens: int,
    cached_tokens: int,
    headers: dict[str, str],
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)

    async def send(chunk: object) -> None:
        await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

    try:
        for chunk in shape.opening_chunks():
            await send(chunk)
        text = ""
        # max_tokens 0 still ends with one (empty) chunk carrying the finish reason.
        for i in range(max(req.max_tokens, 1)):
            piece = ""
            if req.max_tokens:
                await rank.decode_step()
                piece = filler_piece(i)
            text += piece
            done = i + 1 if req.max_tokens else 0
            usage = Usage(prompt_tokens, done, cached_tokens)
            await send(shape.token_chunk(piece, text, i + 1 >= req.max_tokens, usage))
        final = Usage(prompt_tokens, req.max_tokens, cached_tokens)
        for chunk in shape.closing_chunks(final, req.include_usage):
            await send(chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client went away during a %s stream", request.path)
    return resp


# --- test controls --------------------------------------------------------------------------


async def control_store(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    dp_rank = state.rank_from_body(body)
    chains = token_chains(body)
    medium = body.get("medium", "GPU")
    if not isinstance(medium, str) or not medium:
        raise RequestError("'medium' must be a non-empty string", "medium")
    lora_name = body.get("lora_name")
    if lora_name is not None and lora_name not in state.adapters:
        raise RequestError(
            f"'lora_name' must name a loaded adapter, one of {list(state.adapters)}",
            "lora_name",
        )
    block_size = state.config.block_size
    # Validate every chain first, so a bad request publishes nothing at all.
    for chain in chains:
        if len(chain) < block_size:
            raise RequestError(
                f"every chain needs at least one full block ({block_size} tokens)", "token_chains"
            )
    rank = state.ranks[dp_rank]
    seqs = [rank.store_chain(chain, medium, lora_name) for chain in chains]
    log.info(
        "dp rank %d stored %d chain(s) (%s, adapter %s) as seq(s) %s",
        dp_rank,
        len(chains),
        medium,
        lora_name,
        seqs,
    )
    return _json({"dp_rank": dp_rank, "last_seq": rank.last_seq, "seqs": seqs})


async def control_evict(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    dp_rank = state.rank_from_body(body)
    rank = state.ranks[dp_rank]
    has_chains, has_count = "token_chains" in body, "count" in body
    if has_chains == has_count:
        raise RequestError("give exactly one of 'token_chains' and 'count'", "token_chains")
    if has_chains:
        chains = token_chains(body)
        keep = get_int(body, "keep_blocks", 0, minimum=0, maximum=1 << 31)
        evicted = rank.evict_chains(chains, keep)
    else:
        evicted = rank.evict_lru(get_int(body, "count", 1, minimum=0, maximum=1 << 31))
    log.info("dp rank %d evicted %d block(s) on request", dp_rank, evicted)
    return _json({"dp_rank": dp_rank, "last_seq": rank.last_seq, "evicted": evicted})


async def control_clear(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    dp_rank = state.rank_from_body(await _read_body(request))
    rank = state.ranks[dp_rank]
    cleared = rank.clear()
    log.info("dp rank %d cleared %d block(s) on request", dp_rank, cleared)
    return _json({"dp_rank": dp_rank, "last_seq": rank.last_seq, "cleared": cleared})


async def control_drop_next(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    dp_rank = state.rank_from_body(body)
    publisher = state.publishers[dp_rank]
    publisher.drop_next(get_int(body, "count", 1, minimum=0, maximum=1 << 31))
    log.info(
        "dp rank %d will keep the next %d batch(es) off the live stream",
        dp_rank,
        publisher.drops_pending,
    )
    return _json(
        {
            "dp_rank": dp_rank,
            "last_seq": publisher.last_seq,
            "drops_pending": publisher.drops_pending,
        }
    )


async def control_skip_seq(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    dp_rank = state.rank_from_body(body)
    count = get_int(body, "count", 1, minimum=1, maximum=1 << 31)
    last_seq = state.publishers[dp_rank].skip_seq(count)
    return _json({"dp_rank": dp_rank, "last_seq": last_seq})


async def control_restart_publisher(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    dp_rank = state.rank_from_body(await _read_body(request))
    rank = state.ranks[dp_rank]
    rank.restart()
    return _json({"dp_rank": dp_rank, "last_seq": rank.last_seq})


async def control_fail(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _read_body(request)
    count = get_int(body, "count", 1, minimum=0, maximum=1 << 31)
    status = get_int(body, "status", 503, minimum=400, maximum=599)
    state.failures.count, state.failures.status = count, status
    log.info("the next %d generation request(s) will fail with %d", count, status)
    return _json({"count": count, "status": status})


async def control_state(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return _json(
        {
            "ranks": [rank.state() for rank in state.ranks],
            "pending_failures": state.failures.count,
            "failure_status": state.failures.status,
            "failed_requests": state.failures.failed,
            "healthy": state.healthy(),
            "models_reads": state.models_reads,
        }
    )


def build_app(state: WorkerState) -> web.Application:
    app = web.Application(
        middlewares=[_errors, _api_key], client_max_size=state.config.max_body_bytes
    )
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/models", models)
    if state.config.metrics_engine == "vllm":
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/v1/completions", _generation_route(parse_completion, CompletionShape))
    app.router.add_post("/v1/chat/completions", _generation_route(parse_chat, ChatShape))
    app.router.add_post("/generate", _generation_route(parse_generate, GenerateShape, native=True))
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
    if state.config.serve_kv_snapshot:
        app.router.add_get("/v1/kv-snapshot", kv_snapshot)
    app.router.add_post("/control/store", control_store)
    app.router.add_post("/control/evict", control_evict)
    app.router.add_post("/control/clear", control_clear)
    app.router.add_post("/control/drop-next", control_drop_next)
    app.router.add_post("/control/skip-seq", control_skip_seq)
    app.router.add_post("/control/restart-publisher", control_restart_publisher)
    app.router.add_post("/control/fail", control_fail)
    app.router.add_get("/control/state", control_state)
    return app
