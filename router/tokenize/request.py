"""`RequestTokenizer`: what the request path calls to turn a request into the engine's token ids.

The contract, for the data plane:

- `encode_prompt(prompt)` (completions, `/generate`): text is encoded with the tokenizer's
  special tokens; a list of token ids is checked and used as it is, or read id by id as the
  engine's request model reads it when its items are not all ints (`lax.py`). A malformed
  prompt raises ValueError: answer 400. Ids come as a sequence of ints: a list, or for the
  `bytes` tokenizer a bytes object of one id a byte, or for a chat encoded by segments an
  `array('I')` (`segments.py`), each of which `cachetree.keys.block_keys` reads as it is.
- `encode_chat_request(body)` (the whole `/v1/chat/completions` body) returns `ChatTokens`:
  - `ids`: the ids the engine will compute for this request (its chat rules, template, tokenizer),
    or those the body brings for it to use as they are (`chat_rules.given_ids`);
  - or `failure`, one of `FAILURE_REASONS`, when the router cannot reproduce the engine's
    rendering (media parts, a template that raised, ...): the request is still forwarded, routed
    by load as a cache miss, and the caller counts `kvrouter_tokenize_failures_total{reason}`.
    The first failure per template and reason is logged here, with what to do about it.
- Both take `offload=True` for a text too long to encode on the event loop: a model directory
  then returns an `Offload` (`offload.py`) whose outcome is what the call would have returned
  (`encode_chat_request`'s failures included), the malformed requests still raised at once.
  The `bytes` tokenizer encodes a byte an id, as cheap as copying the text: it never offloads.
  - It raises `ChatRequestError` (a ValueError with `.param`) only for a body the engine itself
    refuses while validating (messages not a non-empty list of objects with a string role,
    content neither string, list nor null, tools without function.name, non-boolean flags...):
    answer 400 with that field.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol

from router.tokenize.chat_rules import (
    ChatRequestError,
    Engine,
    GivenIds,
    TemplateTraits,
    Unrenderable,
    given_ids,
    render_call,
    within_counts,
)
from router.tokenize.lax import lax_int
from router.tokenize.offload import Offload
from router.tokenize.params import CHAT, COMPLETION, MAX_ENCODED_CHARS, TokenizeParams, kept
from router.tokenize.plain import BytesTokenizer, render_chat_plain
from router.tokenize.segments import SegmentCache

__all__ = ["ChatRequestError", "ChatTokens", "RequestTokenizer"]

log = logging.getLogger(__name__)

_MAX_TOKEN_ID: Final = 2**32  # block keys hash ids as u32


@dataclass(frozen=True, slots=True)
class ChatTokens:
    ids: Sequence[int]  # empty when `failure` is set
    failure: str | None = None  # a FAILURE_REASONS value: route by load, as a miss


class ChatModel(Protocol):
    """A tokenizer with its chat rendering (the bytes one, or hf.HfModel)."""

    engine: Engine  # whose chat rules it follows

    def encode_text(
        self, text: str, params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int] | Offload[Sequence[int]]: ...

    def encode_chat(
        self, body: dict[str, Any], params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int] | Offload[Sequence[int]]: ...

    def template_name(self, tools: Any) -> str: ...


class RequestTokenizer:
    def __init__(self, name: str, model: ChatModel) -> None:
        self.name = name
        self.model = model
        self._logged: set[tuple[str, str]] = set()

    @property
    def engine(self) -> Engine:
        """Whose chat rules requests are rendered by."""
        return self.model.engine

    def follow_engine(self, engine: str) -> None:
        """Render by `engine`'s chat rules from now on (ValueError for an unknown one)."""
        self.model.engine = Engine(engine)

    @property
    def segment_cache(self) -> SegmentCache | None:
        """The prefix tokenization cache, when the model has one (for metrics)."""
        segments = getattr(self.model, "segments", None)
        return segments.cache if segments is not None and segments.enabled else None

    def encode_prompt(
        self,
        prompt: str | list[Any],
        params: TokenizeParams = COMPLETION,
        *,
        token_id: Callable[[Any], int] = lax_int,
        offload: bool = False,
    ) -> Sequence[int] | Offload[Sequence[int]]:
        """Text is tokenized by `params` (with special tokens by default); token ids are checked
        and used as they are, or as `token_id` reads each when they are not all ints (the
        route's rule: pydantic's lax int for the OpenAI routes, `lax.sglang_token_id` for
        `/generate`)."""
        if isinstance(prompt, str):
            return self.model.encode_text(prompt, params, offload=offload)
        if isinstance(prompt, list):
            return kept(_checked_ids(prompt, token_id), params.keep, params.side)
        raise ValueError("the prompt must be a string or a list of token ids")

    def encode_chat_request(
        self, body: dict[str, Any], params: TokenizeParams = CHAT, *, offload: bool = False
    ) -> ChatTokens | Offload[ChatTokens]:
        """See the module docstring. Raises ChatRequestError for a 400."""
        given = given_ids(body, self.engine)
        if given is not None:
            return ChatTokens(self._given(body, given))
        try:
            encoded = self.model.encode_chat(body, params, offload=offload)
        except Unrenderable as exc:
            return self._unrenderable(body, exc)
        if isinstance(encoded, Offload):
            return encoded.map(partial(self._chat_tokens, body))
        return ChatTokens(encoded)

    def _chat_tokens(self, body: dict[str, Any], ids: Callable[[], Sequence[int]]) -> ChatTokens:
        try:
            return ChatTokens(ids())
        except Unrenderable as exc:
            return self._unrenderable(body, exc)

    def _unrenderable(self, body: dict[str, Any], exc: Unrenderable) -> ChatTokens:
        self._log_once(self.model.template_name(body.get("tools")), exc)
        return ChatTokens([], exc.reason)

    def _given(self, body: dict[str, Any], given: GivenIds) -> Sequence[int]:
        """The ids a chat brings for the engine to use as they are: nothing is rendered or cut
        (the engine's tokenization fields do not apply to them), but the rest of the body is
        still refused where the engine's request model refuses it."""
        _validated(body, self.engine)
        try:
            return _checked_ids(given.ids, given.token_id)
        except ValueError as exc:
            raise ChatRequestError(str(exc), given.param) from None

    def _log_once(self, template: str, exc: Unrenderable) -> None:
        if (template, exc.reason) in self._logged:
            return
        self._logged.add((template, exc.reason))
        log.warning(
            "tokenizer %s, %s chat template: cannot render a request as the engine would (%s: "
            "%s); such requests are routed by load as cache misses and counted in "
            "kvrouter_tokenize_failures_total{reason=%r}. Logged once per template and reason; "
            "if the engine serves them, report the request shape.",
            self.name,
            template,
            exc.reason,
            exc,
            exc.reason,
        )

    def __repr__(self) -> str:
        return f"RequestTokenizer({self.name!r})"


def _checked_ids(ids: list[Any], token_id: Callable[[Any], int]) -> list[int]:
    if not ids:
        raise ValueError("the prompt is an empty list of token ids")
    # C-level passes only (the types as a set, then min/max), not a Python loop per id: a
    # 100k-token prompt is checked in a few milliseconds. `type(t) is int` rather than
    # isinstance, because bool is an int subclass: `true`, `2.0` or `"2"` are ids only as the
    # engine coerces them, read one by one on this rare path.
    if set(map(type, ids)) != {int}:
        try:
            ids = [token_id(t) for t in ids]
        except ValueError as exc:
            raise ValueError(f"token ids must be integers ({exc})") from None
    if min(ids) < 0 or max(ids) >= _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be within [0, {_MAX_TOKEN_ID})")
    return ids


class BytesModel:
    """The `bytes` tokenizer with the plain chat format (the demo fleet's, no model files)."""

    def __init__(self) -> None:
        self._tokenizer = BytesTokenizer()
        self.engine = Engine.VLLM  # the plain format is the same whichever engine it names

    def encode_text(
        self, text: str, params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int]:
        return self._bounded(text, params)

    def encode_chat(
        self, body: dict[str, Any], params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int]:
        # The plain format renders any text, but not past the bounds on what the event loop
        # walks: `_validated` lets those by, as it lets by everything else it cannot render.
        within_counts(body)
        _validated(body, self.engine)
        return self._bounded(render_chat_plain(body["messages"]), params)

    def _bounded(self, text: str, params: TokenizeParams) -> Sequence[int]:
        """The ids of `text`'s first `MAX_ENCODED_CHARS`, exactly the engine's first ids (one
        a byte), cut as `params` says. A cut that keeps the last ids of a longer text has
        none known: no ids, a miss (as hf.py answers). No special tokens in this vocabulary:
        a cut is one of the ids alone."""
        if len(text) > MAX_ENCODED_CHARS:
            if params.keep is not None and params.side != "right":
                return b""
            text = text[:MAX_ENCODED_CHARS]
        return kept(self._tokenizer.encode_bytes(text), params.keep, params.side)

    def template_name(self, tools: Any) -> str:
        return "plain"


def _validated(body: dict[str, Any], engine: Engine) -> None:
    # The same 400s as a model's template path, by the rules followed: validation is shared,
    # the rendering is not. The plain format renders any text: only malformed bodies are
    # refused.
    with contextlib.suppress(Unrenderable):
        render_call(body, _PLAIN_TRAITS, engine)


_PLAIN_TRAITS: Final = TemplateTraits(
    names_developer=False,
    content_as_parts=False,
    content_as_parts_sglang=False,
    accepted_kwargs=frozenset(),
)
