"""What a request's fields tell the engine's tokenizer, beyond the prompt itself. Pure.

The same prompt becomes different ids by the request's own fields, so the router reads them as
the engine does (vLLM's `TokenizeParams`, built by its request models' `build_tok_params`):

- `add_special_tokens`: whether the tokenizer's special tokens (BOS, and EOS for the few that
  add one) go around the encoded text. vLLM: a completion defaults to true, a chat to false (its
  template writes them; true adds them again on top). Token-id prompts are never touched. SGLang's
  request models have no such field: a completion's text always gets them, a chat never.
- `truncate_prompt_tokens` k (vLLM; SGLang has no such field): keep k tokens of the prompt. With
  `truncation_side` unset, text is cut by the tokenizer itself, which vLLM loads with
  `truncation_side="left"` for generation: the last tokens are kept and room is left for the
  special tokens, so `[BOS] + last k-1`; token ids keep their last k. With `truncation_side`
  `"left"` or `"right"`, the whole encoding (special tokens included) keeps its last or first
  k. `-1` means "the model's context less max_tokens", which the router does not know: it is
  read as no truncation. A prompt within the context is not cut by the engine either, so its
  ids are exact; one past it is cut to its last tokens by the engine and keyed whole by the
  router, a miss where the engine cached the cut prompt.

Read with the engines' lax coercion (`lax.py`); a value the engine refuses raises `BadField`,
answered 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.tokenize.chat_rules import Engine
from router.tokenize.lax import lax_bool_field, lax_int


class BadField(ValueError):
    """A field the engine's request model refuses: a 400 naming it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class TokenizeParams:
    """How the engine encodes this request's prompt (a chat's text once rendered)."""

    add_special_tokens: bool
    keep: int | None = None  # truncate_prompt_tokens (>= 0), or None: the whole prompt
    side: str | None = None  # truncation_side: "left", "right", or None: the tokenizer's


# Text past this many characters is not encoded, by any tokenizer: ~128k tokens, past most
# models' context, and encoding runs on the event loop (a 32 MiB prompt of one letter held it
# 20 s with a real vocabulary; keying 30M characters by the `bytes` tokenizer, 0.9 s).
MAX_ENCODED_CHARS: Final = 1 << 19

COMPLETION: Final = TokenizeParams(add_special_tokens=True)
CHAT: Final = TokenizeParams(add_special_tokens=False)
_SIDES: Final = ("left", "right")
_INT64_MAX: Final = 2**63 - 1


def completion_params(body: dict[str, Any], engine: Engine) -> TokenizeParams:
    """A `/v1/completions` body's (`/generate`'s model has no such fields)."""
    return _params(body, engine, COMPLETION)


def chat_params(body: dict[str, Any], engine: Engine) -> TokenizeParams:
    """A `/v1/chat/completions` body's."""
    return _params(body, engine, CHAT)


def kept(ids: Sequence[int], keep: int | None, side: str | None) -> Sequence[int]:
    """vLLM's cut of an encoded prompt: its last `keep` ids (side "left", the tokenizer's) or
    its first (side "right"); a budget below 1 keeps nothing."""
    if keep is None or keep >= len(ids):
        return ids
    if keep <= 0:
        return ids[:0]
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def _params(body: dict[str, Any], engine: Engine, default: TokenizeParams) -> TokenizeParams:
    if engine is Engine.SGLANG or not (
        "add_special_tokens" in body
        or "truncate_prompt_tokens" in body
        or "truncation_side" in body
    ):
        return default  # most requests: three dict lookups, no generator
    special = lax_bool_field(body, "add_special_tokens", default.add_special_tokens, BadField)
    side = body.get("truncation_side")
    if side is not None and side not in _SIDES:  # a Literal: the exact strings only
        raise BadField("'truncation_side' must be 'left' or 'right'", "truncation_side")
    return TokenizeParams(special, _keep(body), side)


def _keep(body: dict[str, Any]) -> int | None:
    raw = body.get("truncate_prompt_tokens")
    if raw is None:
        return None
    try:
        keep = lax_int(raw)
    except ValueError:
        keep = -2
    if not -1 <= keep <= _INT64_MAX:
        raise BadField(
            "'truncate_prompt_tokens' must be an integer, -1 or more", "truncate_prompt_tokens"
        )
    return None if keep == -1 else keep  # the context less max_tokens: see the docstring
