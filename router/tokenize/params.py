"""What a request's fields tell the engine's tokenizer, beyond the prompt itself. Pure.

The same prompt becomes different ids by the request's own fields, so the router reads them as
the engine does (vLLM's `TokenizeParams`, built by its request models' `build_tok_params`):

- `add_special_tokens`: whether the tokenizer's special tokens (BOS, and EOS for the few that
  add one) go around the encoded text. vLLM: a completion defaults to true, a chat to false (its
  template writes them; true adds them again on top). Token-id prompts are never touched. SGLang's
  request models have no such field: a completion's text always gets them, a chat never.

Read with the engines' lax coercion (`lax.py`); a value the engine refuses raises `BadField`,
answered 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from router.tokenize.chat_rules import Engine
from router.tokenize.lax import lax_bool


class BadField(ValueError):
    """A field the engine's request model refuses: a 400 naming it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class TokenizeParams:
    """How the engine encodes this request's text (a chat's once rendered)."""

    add_special_tokens: bool


COMPLETION: Final = TokenizeParams(add_special_tokens=True)
CHAT: Final = TokenizeParams(add_special_tokens=False)


def completion_params(body: dict[str, Any], engine: Engine) -> TokenizeParams:
    """A `/v1/completions` body's (`/generate`'s too, whose model has no such fields)."""
    if engine is Engine.SGLANG or "add_special_tokens" not in body:
        return COMPLETION  # most requests: one dict lookup
    return TokenizeParams(_bool(body, "add_special_tokens"))


def chat_params(body: dict[str, Any], engine: Engine) -> TokenizeParams:
    """A `/v1/chat/completions` body's."""
    if engine is Engine.SGLANG or "add_special_tokens" not in body:
        return CHAT
    return TokenizeParams(_bool(body, "add_special_tokens"))


def _bool(body: dict[str, Any], key: str) -> bool:
    try:
        return lax_bool(body[key])
    except ValueError:
        raise BadField(f"'{key}' must be a boolean", key) from None
