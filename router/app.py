"""The aiohttp request path: generation routes beside the control plane, on one app.

A request is parsed and tokenized (`tokenize`), keyed (`cachetree.keys`), scored (`policy`)
and forwarded (`proxy`). A malformed request is a 400 naming the field, never a 500.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from cachetree.keys import block_keys, namespace_seed
from router.control import REPLICA, BadRequest, add_control_routes, bad_request, replica_lifecycle
from router.events import namespace_of
from router.policy import Candidate, Prompt
from router.replica import ServeConfig
from router.tokenize import RequestTokenizer

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def build_app(config: ServeConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_request_bytes)
    app.cleanup_ctx.append(replica_lifecycle(config))
    for route in GENERATION_ROUTES:
        app.router.add_post(route, _generation(route))
    add_control_routes(app)
    return app


def _prompt_tokens(route: str, body: dict[str, Any], tokenizer: RequestTokenizer) -> list[int]:
    try:
        if route == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            return tokenizer.encode_chat(messages)
        if route == "/generate":
            if "input_ids" in body:
                return tokenizer.encode_prompt(_single(body["input_ids"], "input_ids"))
            if "text" in body:
                return tokenizer.encode_prompt(_single(body["text"], "text"))
            raise BadRequest("one of 'text' or 'input_ids' is required", "text")
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", "prompt")
        return tokenizer.encode_prompt(_single(body["prompt"], "prompt"))
    except ValueError as exc:
        raise BadRequest(str(exc), _param_of(route)) from None


def _single(prompt: Any, param: str) -> Any:
    """A prompt, or the first of a batch of prompts (they are routed together)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return prompt[0]
    if not isinstance(prompt, str | list):
        raise BadRequest(f"'{param}' must be a string or a list of token ids", param)
    return prompt


def _param_of(route: str) -> str:
    return {"/v1/chat/completions": "messages", "/generate": "text"}.get(route, "prompt")


def _generation(route: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        replica = request.app[REPLICA]

        def answered_here(response: web.Response) -> web.Response:
            replica.metrics.requests.labels(route, "none", str(response.status)).inc()
            return response

        # A draining replica still serves what reaches it: /readyz already tells the load
        # balancer to stop sending, and refusing requests in the meantime would fail them.
        body_bytes = await request.read()
        try:
            body = msgspec.json.decode(body_bytes)
        except msgspec.DecodeError as exc:
            return answered_here(bad_request(BadRequest(f"body is not valid JSON: {exc}")))
        if not isinstance(body, dict):
            return answered_here(bad_request(BadRequest("body must be a JSON object")))
        try:
            tokens = _prompt_tokens(route, body, replica.tokenizer)
        except BadRequest as exc:
            return answered_here(bad_request(exc))
        routable = replica.workers.routable()
        if not routable:
            replica.metrics.decisions.labels(replica.policy.name, "no_candidates").inc()
            return answered_here(
                web.json_response(
                    {"error": {"message": "no healthy worker to route to"}}, status=503
                )
            )
        candidates = [
            Candidate(rank, replica.inflight[rank], replica.loads.get(w.url, rank.dp_rank))
            for w in routable
            for rank in w.ranks()
        ]
        tree = replica.pump.rules.tree
        depths = None
        keys: list[int] = []
        if tree is not None and replica.policy.name == "cache_aware":
            namespace = namespace_of(
                _str_or_none(body.get("lora_name")), _str_or_none(body.get("cache_salt"))
            )
            keys = block_keys(tokens, tree.block_size, namespace_seed(namespace))
            depths = tree.prefix_depths(keys)
        block_size = tree.block_size if tree is not None else 1
        prompt = Prompt(len(tokens), block_size, depths, keys)
        decision = replica.policy.decide(candidates, prompt)
        replica.metrics.decisions.labels(replica.policy.name, decision.outcome).inc()
        replica.metrics.matched_blocks.observe(decision.matched_blocks)
        return await replica.proxy.forward(request, route, body_bytes, decision.ranked)

    return handle


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
