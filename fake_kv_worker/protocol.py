"""Request parsing and response bodies for the OpenAI-style and SGLang-native endpoints.

No I/O here: the routes in `app.py` read bytes, call these, and write what they return. Every
malformed input raises `RequestError` naming the offending field, which the app renders as an
OpenAI-style error body: `{"error": {"message", "type": "invalid_request_error", "param",
"code"}}` (`code` the HTTP status, as vLLM's and SGLang's carry it).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec

from fake_kv_worker.text import render_plain_chat

MAX_TOKEN_ID: Final = (1 << 32) - 1  # engines carry token ids as u32 (SGLang hashes them so)
MAX_GENERATED_TOKENS: Final = 100_000  # a fake worker has no reason to stream more than this
DP_RANK_HEADER: Final = "X-Data-Parallel-Rank"

# Deterministic filler: token i of every completion is FILLER[i % len(FILLER)].
FILLER: Final = (
    " lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    " consectetur",
    " adipiscing",
    " elit",
)


class RequestError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None,
        *,
        status: int = 400,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_

    def body(self) -> dict[str, Any]:
        # vLLM's ErrorInfo carries the status as `code`, and so does SGLang's error body.
        body = error_body(self.message, self.type, self.param)
        body["error"]["code"] = self.status
        return body


def error_body(message: str, type_: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param}}


# --- generic field readers ------------------------------------------------------------------


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", None) from exc
    if not isinstance(value, dict):
        raise RequestError("request body must be a JSON object", None)
    return value


def get_int(
    body: Mapping[str, Any],
    name: str,
    default: int,
    *,
    minimum: int,
    maximum: int,
    param: str | None = None,
) -> int:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python but never a count on the wire.
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise RequestError(
            f"'{name}' must be an integer in [{minimum}, {maximum}], got {value!r}", param or name
        )
    return value


# The engines' request models are pydantic models in lax mode: a bool field takes these words
# in any ASCII case, and 0/1; an int field takes an integral float or an integer's text.
_BOOL_WORDS: Final = {
    **dict.fromkeys(("0", "f", "n", "no", "off", "false"), False),
    **dict.fromkeys(("1", "t", "y", "on", "yes", "true"), True),
}
# pydantic's integer text, once stripped of Unicode white space: a sign, leading zeros (which
# may hold underscores), digits with single underscores between them, a `.000` fraction.
_INT_TEXT: Final = re.compile(
    r"[+-]?(?:0(?:[0_]*0)?(?:\.0+)?|(?:0[0_]*)?[1-9](?:_?[0-9])*(?:\.0+)?)"
)
# ... and a quirk of its leading-zero strip: zeros then a minus sign, "0-2", is -2.
_ZEROS_MINUS_TEXT: Final = re.compile(r"\+?0[0_]*-(_?(?:0|[1-9](?:_?[0-9])*)(?:\.0+)?)")
_UNICODE_SPACE: Final = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def lax_bool(value: object, param: str) -> bool:
    """A pydantic bool field's reading of a JSON value (null refused)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.isascii() and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    raise RequestError(f"'{param}' must be a boolean, got {value!r}", param)


def lax_int(value: object) -> int | None:
    """A pydantic int field's reading of a JSON value, or None where it refuses it."""
    if isinstance(value, int):  # bools too: True is 1
        return int(value)
    if isinstance(value, float):
        if value.is_integer() and -(2.0**63) < value < 2.0**63:
            return int(value)
        return None
    if isinstance(value, str):
        text = value.strip(_UNICODE_SPACE)
        if _INT_TEXT.fullmatch(text):
            return int(text.split(".")[0].replace("_", ""))
        quirk = _ZEROS_MINUS_TEXT.fullmatch(text)
        if quirk:
            return -int(quirk.group(1).split(".")[0].replace("_", ""))
    return None


def get_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    return lax_bool(value, name)


def token_ids(value: object, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise RequestError(f"'{param}' must be a list of token ids in [0, {MAX_TOKEN_ID}]", param)
    return value


def lax_token_ids(value: list[Any], param: str) -> list[int]:
    """vLLM's `list[int]` prompt read in lax mode (ids 0 and up)."""
    ids = [lax_int(t) for t in value]
    if any(t is None for t in ids):
        raise RequestError(f"'{param}' must be a list of token ids in [0, {MAX_TOKEN_ID}]", param)
    return token_ids(ids, param)


def sglang_token_ids(value: list[Any], param: str) -> list[int]:
    """SGLang's `/generate` `input_ids`: its validator packs them into an int64 array, which
    takes ints and bools and nothing else."""
    if any(not isinstance(t, int) for t in value):
        raise RequestError(f"'{param}' elements must be int", param)
    return token_ids([int(t) for t in value], param)


def token_chains(body: Mapping[str, Any], name: str = "token_chains") -> list[list[int]]:
    value = body.get(name)
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a list of token id lists", name)
    return [token_ids(chain, name) for chain in value]


def dp_rank_of(value: object, dp_size: int, param: str) -> int:
    """A dp rank from a header (str) or a body field (int); absent means rank 0."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise RequestError(f"'{param}' must be an integer, got {value!r}", param) from None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < dp_size:
        raise RequestError(
            f"'{param}' must be a dp rank in [0, {dp_size - 1}], got {value!r}", param
        )
    return value


# --- generation requests --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: str | list[int]  # text to tokenize, or token ids used as they are
    max_tokens: int
    stream: bool
    include_usage: bool  # OpenAI `stream_options.include_usage`
    prompt_param: str  # the field the prompt came from, for error messages
    chat: Mapping[str, Any] | None = None  # a chat body, for a model's own chat rendering
    add_special_tokens: bool = True  # vLLM's completion field (text prompts only)
    # The prompt came as embeddings (vLLM's prompt_embeds, SGLang's input_embeds): served with
    # no token ids, so nothing is cached or published.
    embeds: bool = False
    # vLLM's truncate_prompt_tokens (-1 as given: the context less max_tokens) and side.
    truncation: tuple[int | None, str | None] = (None, None)


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...], default: int) -> int:
    for name in names:
        if body.get(name) is not None:
            return get_int(body, name, default, minimum=0, maximum=MAX_GENERATED_TOKENS)
    return default


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise RequestError(
            "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"
        )
    return value


def parse_completion(body: Mapping[str, Any], default_max_tokens: int) -> GenerationRequest:
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if prompt is None and embeds is not None:
        # vLLM: base64 tensors, one or a non-empty list of them.
        if not (isinstance(embeds, str) or (isinstance(embeds, list) and embeds)) or (
            isinstance(embeds, list) and not all(isinstance(e, str) for e in embeds)
        ):
            raise RequestError("'prompt_embeds' must be a string or a list of them", "prompt")
        return GenerationRequest(
            prompt=[],
            max_tokens=_max_tokens(body, ("max_tokens",), default_max_tokens),
            stream=get_bool(body, "stream", False),
            include_usage=_include_usage(body),
            prompt_param="prompt_embeds",
            embeds=True,
        )
    if isinstance(prompt, str):
        parsed: str | list[int] = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and not all(isinstance(t, str) for t in prompt)
        and not all(isinstance(t, list) for t in prompt)
    ):
        # pydantic's union: a list of strings is a batch; any other list is ids, read lax.
        parsed = lax_token_ids(prompt, "prompt")
    else:
        # Batched prompts (a list of strings or of id lists) are valid OpenAI but not simulated.
        raise RequestError("'prompt' must be a string or a non-empty list of token ids", "prompt")
    return GenerationRequest(
        prompt=parsed,
        max_tokens=_max_tokens(body, ("max_tokens",), default_max_tokens),
        stream=get_bool(body, "stream", False),
        include_usage=_include_usage(body),
        prompt_param="prompt",
        add_special_tokens=(
            lax_bool(body["add_special_tokens"], "add_special_tokens")
            if "add_special_tokens" in body
            else True  # not Optional in vLLM's model: null is refused like any non-boolean
        ),
        truncation=truncation_fields(body),
    )


def truncation_fields(body: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """vLLM's `truncate_prompt_tokens` (-1 kept as it is) and `truncation_side`, checked."""
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise RequestError("'truncation_side' must be 'left' or 'right'", "truncation_side")
    raw = body.get("truncate_prompt_tokens")
    if raw is None:
        return None, side
    keep = lax_int(raw)
    if keep is None or keep < -1:
        raise RequestError("'truncate_prompt_tokens' must be -1 or more", "truncate_prompt_tokens")
    return keep, side


def parse_chat(body: Mapping[str, Any], default_max_tokens: int) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise RequestError(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(
                f"'messages[{i}].content' must be a string or a list of parts",
                f"messages[{i}].content",
            )
    return GenerationRequest(
        prompt=render_plain_chat(messages),
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), default_max_tokens),
        stream=get_bool(body, "stream", False),
        include_usage=_include_usage(body),
        prompt_param="messages",
        chat=body,
        truncation=truncation_fields(body),
    )


def parse_generate(body: Mapping[str, Any], default_max_tokens: int) -> GenerationRequest:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise RequestError("give either 'text' or 'input_ids', not both", "text")
    embeds = body.get("input_embeds")
    if text is None and input_ids is None and isinstance(embeds, list) and embeds:
        prompt: str | list[int] = []  # SGLang: served from the embeddings alone
    elif input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("'input_ids' must be a non-empty list of token ids", "input_ids")
        prompt = sglang_token_ids(input_ids, "input_ids")
    elif isinstance(text, str):
        prompt = text
    else:
        raise RequestError("'text' must be a string (or give 'input_ids')", "text")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object", "sampling_params")
    max_new = get_int(
        params,
        "max_new_tokens",
        default_max_tokens,
        minimum=0,
        maximum=MAX_GENERATED_TOKENS,
        param="sampling_params.max_new_tokens",
    )
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_new,
        stream=get_bool(body, "stream", False),
        include_usage=False,
        prompt_param="input_ids" if input_ids is not None else "text",
        embeds=prompt == [],
    )


# --- responses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def filler_piece(index: int) -> str:
    return FILLER[index % len(FILLER)]


def filler_text(count: int) -> str:
    return "".join(filler_piece(i) for i in range(count))


class ResponseShape(Protocol):
    """How one endpoint writes a whole response and its stream chunks."""

    def full(self, text: str, usage: Usage) -> dict[str, Any]: ...

    def opening_chunks(self) -> list[dict[str, Any]]: ...

    def token_chunk(
        self, piece: str, text_so_far: str, last: bool, usage: Usage
    ) -> dict[str, Any]: ...

    def closing_chunks(self, usage: Usage, include_usage: bool) -> list[dict[str, Any]]: ...


class _OpenAIShape:
    object_full: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def closing_chunks(self, usage: Usage, include_usage: bool) -> list[dict[str, Any]]:
        if not include_usage:
            return []
        chunk = self._envelope(self.object_chunk, [])
        chunk["usage"] = usage.to_json()
        return [chunk]


class CompletionShape(_OpenAIShape):
    object_full = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl"

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        body = self._envelope(
            self.object_full,
            [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        )
        body["usage"] = usage.to_json()
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def token_chunk(self, piece: str, text_so_far: str, last: bool, usage: Usage) -> dict[str, Any]:
        return self._envelope(
            self.object_chunk,
            [
                {
                    "index": 0,
                    "text": piece,
                    "logprobs": None,
                    "finish_reason": "length" if last else None,
                }
            ],
        )


class ChatShape(_OpenAIShape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        body = self._envelope(
            self.object_full,
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
        )
        body["usage"] = usage.to_json()
        return body

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope(self.object_chunk, [choice])]

    def token_chunk(self, piece: str, text_so_far: str, last: bool, usage: Usage) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": {"content": piece},
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        return self._envelope(self.object_chunk, [choice])


class GenerateShape:
    """SGLang's native `/generate`: streamed chunks carry the cumulative text."""

    def __init__(self, model: str) -> None:
        self.id = uuid.uuid4().hex

    def _meta(self, usage: Usage, finished: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "finish_reason": (
                {"type": "length", "length": usage.completion_tokens} if finished else None
            ),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        }

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        return {"text": text, "meta_info": self._meta(usage, True)}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def token_chunk(self, piece: str, text_so_far: str, last: bool, usage: Usage) -> dict[str, Any]:
        return {"text": text_so_far, "meta_info": self._meta(usage, last)}

    def closing_chunks(self, usage: Usage, include_usage: bool) -> list[dict[str, Any]]:
        return []
