"""A chat request body -> the call the engine makes to render it. Pure rules, no I/O, no templates.

Theory of operation. An engine does not hand the OpenAI `messages` to the chat template as they
came: it first rewrites them (content parts joined or kept, `null` content, tool-call arguments
parsed, roles renamed, tools re-serialized by its request model) and chooses the template
variables (`add_generation_prompt`, `continue_final_message`, `documents`, the request's
`chat_template_kwargs` filtered against the template). Then it calls transformers'
`apply_chat_template(tokenize=False)` and encodes the text without special tokens. The router's
block keys hash the engine's token ids, so it has to make the same rewrite: this module is that
rewrite, for each engine, as plain functions from a request body to a `RenderCall`.

vLLM's rules are the default (`vllm/renderers/chat_utils`, `renderers/hf.py`, the OpenAI request
models); SGLang's (`entrypoints/openai/serving_chat.py`, `parser/jinja_template_utils.py`) where
they differ:

- content as string or parts: vLLM passes parts when the template loops over a message's
  content (else one string); SGLang too, and also whenever the template names image, audio,
  video or vision.
- text parts into a string: vLLM joins with a newline, leaving empty texts out; SGLang with a
  space, empty texts kept. A part without text: vLLM skips a `text` or `refusal` one, and
  keeps a `thinking`, `input_text` or `output_text` one as `{"type": "text", "text": null}`
  where the template takes parts (left out of a string).
- a `tool_reference` part (a deferred tool's `name`): vLLM (0.22+) keeps it as a part, or joins
  the name like a text; SGLang keeps it as a part, or leaves it out of the string.
- `content: null`: vLLM gives `""` (string format) or `[]`; SGLang `""`.
- `developer`: vLLM sends it as `system` unless the template names `developer`; SGLang keeps it.
- Claude Code's billing header (`x-anthropic-billing-header: ...; cch=...;`, a per-request
  value) starting a system text: vLLM drops that line (0.32+), SGLang keeps it.
- an assistant's reasoning: vLLM reads `reasoning`, else the deprecated `reasoning_content`
  (its request model renames it, 0.22+), and gives the template both; SGLang reads
  `reasoning_content` alone.
- tool-call `arguments` as a JSON string: both parse it (vLLM with `json.loads`, SGLang with
  orjson: no NaN, Infinity or lone surrogates, an integer past 64 bits read as a float);
  malformed or no object, vLLM uses `{}`, SGLang refuses the request, as it does arguments
  that are neither a string, an object nor null.
- a last message from the assistant: vLLM renders it as it is; SGLang makes it a user turn, or
  with `continue_final_message` appends its text after the generation prompt.
- `add_generation_prompt`, `documents`: vLLM takes them from the request; SGLang always adds
  the generation prompt and passes no documents.
- `reasoning_effort`: both pass it to the template, and derive `enable_thinking` from it
  (`effort != "none"`) unless `chat_template_kwargs` sets that, for templates that think only
  when asked (Gemma 4's). vLLM (0.22+, `build_chat_params`): one of its seven words, the
  request's field over `chat_template_kwargs.reasoning_effort`. SGLang (0.5.23,
  `normalize_reasoning_inputs`, `_convert_to_internal_request`): its eight words or a number in
  [0, 0.99], also read from a `reasoning` object, deriving `thinking` too;
  `chat_template_kwargs.reasoning_effort` over the request's field.
- `tools`: each engine's request model dump, flags read as pydantic reads them (a flag it
  cannot read is a 400), the tool's `defer_loading` its function's unless that has one, a
  function's null flag left out, a missing description `null`. vLLM: `{type, function: {name,
  description, parameters, strict, defer_loading}, defer_loading}`, its declared fields alone.
  SGLang (0.5.23): `{type, function, defer_loading}`, the function's declared fields in the
  client's order (those it left out after); none when `tool_choice` is `none`, only the named
  one for a named choice.
- roles: vLLM renders any; SGLang its list alone (`root` among them), lower-cased, but
  `user` exactly (its user model's role is case-sensitive: `User` is its 400).
- message fields: SGLang (0.5.23) gives the template a message's `phase` (`commentary` or
  `final_answer`) and `prefix` (DeepSeek's prefix completion, a boolean) but a user's; vLLM
  neither. SGLang refuses a `name` or `tool_call_id` (a history tool call's `name` too) that
  is not a string; vLLM passes them on.
- content parts: SGLang's request model takes `text`, `thinking`/`reasoning` (left out of
  what the template sees), media and `tool_reference` parts alone: an `input_text` part or a
  bare string is its 400, and the router routes such a chat as a miss, as a role SGLang
  refuses. A thinking part too unless in an assistant message, with exactly one of
  `thinking` or `text`.

A chat may also bring the token ids the engine is to use as they are, its template skipped
(`given_ids`): SGLang's `input_ids`, vLLM's `kv_transfer_params.prompt_token_ids`. The router
keys those, as the engine caches them.

Two outcomes besides a `RenderCall`: `ChatRequestError` for a body the engine refuses at
validation (a 400 with the field), and `Unrenderable(reason)` for a request the engine may well
serve but the router cannot reproduce (media parts, a per-request template): it is routed by load
as a cache miss, never refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from router.tokenize.lax import lax_bool, lax_bool_field, lax_float, lax_int, shown


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


ENGINES: Final = tuple(e.value for e in Engine)

# Reasons a request is routed as a miss; the label values of kvrouter_tokenize_failures_total.
FAILURE_REASONS: Final = (
    "content",  # a content part that is not text (media, unknown types)
    "request_template",  # the request brings its own chat template
    "tool_arguments",  # SGLang refuses tool-call arguments that are not a JSON object
    "role",  # SGLang refuses roles outside its list
    "tools",  # a tool the engine's request model would not accept
    "deep_tools",  # JSON a template dumps nested past MAX_TOOL_NESTING: not rendered on the loop
    # More messages, tools or parts than MAX_CHAT_MESSAGES / MAX_CHAT_TOOLS / MAX_CHAT_PARTS,
    # JSON to dump past MAX_DUMPED_VALUES, text past MAX_CHAT_CHARS; or a chat's body past
    # routing's bounds on what it decodes (MAX_BODY_VALUES, MAX_BODY_KEYS), which is then not
    # decoded at all (any route's such body: kvrouter_bodies_unread_total).
    "too_large",
    "no_template",  # the model has no chat template
    "render",  # the template raised (raise_exception, a type error, ...)
    "encode",  # the tokenizer failed on the rendered text
    # Not a chat: a completion or /generate prompt given as embeddings (vLLM's prompt_embeds,
    # SGLang's input_embeds), which has no token ids to key. Left out of the chat alert.
    "embeds",
)


# JSON levels what a template dumps may nest to (tools, tool-call arguments, the values of
# `chat_template_kwargs`; real schemas stay under ten): templates dump them with
# `tojson(indent=...)`, whose cost grows with the square of the depth (480 levels, a 20 KB
# body, rendered for 1.1 s on the event loop; 300 levels in a 2.5 MB body, 7.6 s).
MAX_TOOL_NESTING: Final = 64
# Values the JSON a template may dump holds, all together (list items and object values): its
# `tojson` costs a few microseconds a value, on the event loop (one tool of 500,000 properties
# held it 2.4 s). An agent's tools hold a few thousand.
MAX_DUMPED_VALUES: Final = 1 << 16
# Messages and tools a chat may have for the router to render it. The rules and the render
# take time in proportion to them, on the event loop: a million empty messages held it for
# 3.6 s, 330,000 tools for 3 s. Past these a chat is routed by load, as a miss; agents'
# conversations stay far below (a 1M-token context is a few thousand turns).
MAX_CHAT_MESSAGES: Final = 10_000
MAX_CHAT_TOOLS: Final = 2_048
# Content parts and tool calls, all messages together: each is checked and rendered like a
# message (a million empty parts in one message held the loop 2.7 s). Two per message at the
# message bound; a real chat has a few per turn.
MAX_CHAT_PARTS: Final = 20_000
# Characters of text a chat may hold for the router to render it, all strings the template is
# given together (contents, tool calls, any other message field, tools, template variables,
# keys included): four times what is encoded of it (params.MAX_ENCODED_CHARS). A template's
# time may grow faster than its text: DeepSeek-V3.1's appends each system message to those
# before it, so 8,000 of 1.5 KB (12 MB) rendered for 17.9 s in a worker thread, holding it;
# 10,000 messages of 2 Mi characters in all, 6.5 s. Past it the chat is routed by load.
MAX_CHAT_CHARS: Final = 1 << 21


class ChatRequestError(ValueError):
    """A chat body the engine refuses while validating it: answered 400, naming the field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class Unrenderable(Exception):
    """The router cannot render this request as the engine would: route it as a miss."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in FAILURE_REASONS, reason
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What the rules need to know of the chat template (see template_traits.py)."""

    names_developer: bool  # the template handles a `developer` role itself
    content_as_parts: bool  # vLLM's detection: the template loops over message content
    content_as_parts_sglang: bool  # SGLang's detection (a keyword shortcut, fixed loop names)
    accepted_kwargs: frozenset[str]  # template variables + apply_chat_template's own parameters


@dataclass(slots=True)
class RenderCall:
    """The engine's `apply_chat_template(conversation, tools=..., **kwargs)`, and its aftermath."""

    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    suffix: str = ""  # appended to the rendered text (SGLang's continued assistant message)
    retry_with_bare_tools: bool = False  # SGLang renders again with `tool["function"]` on failure


def render_call(body: dict[str, Any], traits: TemplateTraits, engine: Engine) -> RenderCall:
    """The engine's render call for a chat body. Raises ChatRequestError or Unrenderable."""
    within_counts(body)
    messages = _checked_messages(body.get("messages"))
    tools = _checked_tools(body.get("tools"))
    continue_final = lax_bool_field(body, "continue_final_message", False, ChatRequestError)
    if body.get("chat_template") is not None:
        # vLLM refuses it unless started with --trust-request-chat-template; either way the
        # router would have to run client-supplied template code to follow it.
        raise Unrenderable("request_template", "the request carries its own chat_template")
    with _wrong_shapes_refused():
        if engine is Engine.SGLANG:
            call = _sglang_call(body, messages, tools, continue_final, traits)
        else:
            template_kwargs = _checked_object(
                body.get("chat_template_kwargs"), "chat_template_kwargs"
            )
            # SGLang's request model has no such field (it always adds the prompt): vLLM's only.
            add_generation_prompt = lax_bool_field(
                body, "add_generation_prompt", True, ChatRequestError
            )
            if continue_final and add_generation_prompt:
                raise ChatRequestError(
                    "cannot set both continue_final_message and add_generation_prompt to true",
                    "continue_final_message",
                )
            call = _vllm_call(
                body,
                messages,
                tools,
                template_kwargs,
                add_generation_prompt,
                continue_final,
                traits,
            )
    _within_nesting(call)
    return call


@contextmanager
def _wrong_shapes_refused() -> Iterator[None]:
    """A field of the wrong shape the checks let by (a part's text that is null, a tool
    without a name, a tool_choice that is no object, ...) fails the rules with a KeyError,
    TypeError or AttributeError: the engine's request model refuses such a body with a 400,
    and so does the router, naming what it met."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ChatRequestError(f"a field has the wrong type or is missing: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class GivenIds:
    """Token ids a chat body brings, which the engine takes as its prompt without rendering."""

    ids: list[Any]
    param: str  # the field they came in, which a 400 names
    token_id: Callable[[Any], int]  # how the engine's request model reads one id


def given_ids(body: dict[str, Any], engine: Engine) -> GivenIds | None:
    """The ids the engine will use as they are for this chat, or None: it renders the messages.

    - SGLang (0.5.16 to 0.5.23): `input_ids` unless null (`ChatCompletionRequest.input_ids`, a
      pydantic `List[int]`, so lax ints; serving_chat.py `_process_messages` then renders
      nothing). vLLM's chat model has no such field: it ignores it.
    - vLLM (0.32+, renderers/online_renderer.py `_reused_prompt_token_ids`): the prefill's ids
      a disaggregated decode reuses, `kv_transfer_params.prompt_token_ids`, unless null, `echo`
      is set or a message holds more than text (those are rendered); ints and nothing else.
      SGLang's chat model has no `kv_transfer_params`.

    Raises ChatRequestError when the field is no list, or `echo` no boolean."""
    if engine is Engine.SGLANG:
        ids = body.get("input_ids")
        if ids is None:
            return None
        param, token_id = "input_ids", lax_int
    else:
        transfer = body.get("kv_transfer_params")
        ids = transfer.get("prompt_token_ids") if type(transfer) is dict else None
        if (
            ids is None
            or lax_bool_field(body, "echo", False, ChatRequestError)
            or _vllm_has_media(body.get("messages"))
        ):
            return None
        param, token_id = "kv_transfer_params.prompt_token_ids", _exact_int
    if type(ids) is not list:
        raise ChatRequestError(f"'{param}' must be a list of token ids", param)
    return GivenIds(ids, param, token_id)


def template_tools(body: dict[str, Any], engine: Engine) -> list[dict[str, Any]] | None:
    """The tools the engine hands transformers when it picks among a model's named templates
    (`tool_use` when not None): vLLM the request's, SGLang those left after `tool_choice`.
    Raises ChatRequestError for malformed tools."""
    tools = _checked_tools(body.get("tools"))
    if engine is Engine.SGLANG:
        with _wrong_shapes_refused():
            return _sglang_tools(tools, body.get("tool_choice"))
    return tools


# --- what the router renders on its event loop --------------------------------------------


def within_counts(body: dict[str, Any]) -> None:
    """Unrenderable past MAX_CHAT_MESSAGES messages, MAX_CHAT_TOOLS tools or MAX_CHAT_PARTS
    content parts and tool calls: checked before anything walks them (such a body is
    forwarded unchecked; the engine validates it)."""
    for key, bound in (("messages", MAX_CHAT_MESSAGES), ("tools", MAX_CHAT_TOOLS)):
        value = body.get(key)
        if type(value) is list and len(value) > bound:
            raise Unrenderable("too_large", f"more than {bound} {key} ({len(value)})")
    messages = body.get("messages")
    parts = sum(
        len(value)
        for m in (messages if type(messages) is list else ())
        if type(m) is dict
        for value in (m.get("content"), m.get("tool_calls"))
        if type(value) is list
    )
    if parts > MAX_CHAT_PARTS:
        raise Unrenderable(
            "too_large", f"more than {MAX_CHAT_PARTS} content parts and tool calls ({parts})"
        )


def within_text(call: RenderCall) -> None:
    """Unrenderable when the strings `call` gives the template, keys included, hold more than
    MAX_CHAT_CHARS characters: checked before rendering. A stack, not recursion: a message's
    other fields nest as deep as the client wrote them."""
    left = MAX_CHAT_CHARS
    stack: list[Any] = [call.conversation, call.tools, list(call.kwargs.values())]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            left -= len(value)
            if left < 0:
                raise Unrenderable("too_large", f"more than {MAX_CHAT_CHARS} characters of text")
        elif kind is dict:
            stack.extend(value)
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)


def _within_nesting(call: RenderCall) -> None:
    """Unrenderable when what the template may dump as JSON nests past MAX_TOOL_NESTING or
    holds more than MAX_DUMPED_VALUES values: the tools (the request's, or those
    `chat_template_kwargs` brings), the other template variables, and the messages' tool
    calls (arguments parsed) and tools."""
    dumped: list[Any] = [call.tools, list(call.kwargs.values())]
    for message in call.conversation:
        dumped.extend(message[k] for k in ("tool_calls", "tools") if message.get(k))
    _within_dump_bounds(dumped, MAX_TOOL_NESTING + 1, MAX_DUMPED_VALUES)  # one level of its own


# --- validation shared by both engines (their request models refuse these) -----------------


def _within_dump_bounds(value: Any, levels: int, budget: int) -> int:
    """The values left of `budget` once those in `value` are counted; Unrenderable where lists
    and objects nest deeper than `levels` or hold more than `budget` (stops there).
    Recursive, with exact type checks: a third of the cost of an explicit stack (10 us for
    an agent's 8 tools), and `levels` bounds the recursion."""
    if type(value) is dict:
        value = value.values()
    elif type(value) is not list:
        return budget
    if levels <= 0:
        raise Unrenderable("deep_tools", f"the JSON to render nests past {MAX_TOOL_NESTING} levels")
    budget -= len(value)
    if budget < 0:
        raise Unrenderable(
            "too_large", f"the JSON to render holds more than {MAX_DUMPED_VALUES} values"
        )
    for item in value:
        kind = type(item)
        if kind is dict or kind is list:
            budget = _within_dump_bounds(item, levels - 1, budget)
    return budget


def _parsed_arguments(text: str, **hooks: Callable[[str], Any]) -> Any:
    """Tool-call arguments as vLLM parses them (`json.loads`, with SGLang's `hooks`: ValueError
    when they are not JSON); nested past Python's recursion limit they are Unrenderable, not a
    crash."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise Unrenderable("tool_arguments", "tool-call arguments nested too deeply") from None


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatRequestError(f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str):
            raise ChatRequestError(f"messages[{i}].role must be a string")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ChatRequestError(f"messages[{i}].content must be a string, a list or null")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, str | dict):
                    raise ChatRequestError(f"messages[{i}].content[{j}] must be an object")
                if isinstance(part, dict) and not isinstance(part.get("text", ""), str | None):
                    raise ChatRequestError(f"messages[{i}].content[{j}].text must be a string")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ChatRequestError(f"messages[{i}].tool_calls must be a list")
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                    raise ChatRequestError(
                        f"messages[{i}].tool_calls[{j}] must be an object with a 'function' object"
                    )
    return messages


def _checked_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatRequestError(f"tools[{i}] must be an object with a function.name", "tools")
    return tools


def _checked_object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ChatRequestError(f"'{param}' must be an object", param)
    return value


# --- vLLM -----------------------------------------------------------------------------------

_TEXT_PART_KEYS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}  # part type -> its key
# The text part types vLLM drops when they hold no text; the others it keeps as a null text.
_VLLM_SKIPPED_WITHOUT_TEXT: Final = frozenset({"text", "refusal"})
# Fields of the OpenAI content-part shapes; anything else on a text part rides along (vLLM keeps
# a part's unknown keys when the template takes parts).
_KNOWN_PART_FIELDS: Final = frozenset(
    {
        "type",
        "text",
        "refusal",
        "thinking",
        "closed",
        "uuid",
        "image_url",
        "input_audio",
        "audio_url",
        "video_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "data",
        "image_pil",
        "name",
        "file",
        "detail",
    }
)


def _vllm_call(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    continue_final: bool,
    traits: TemplateTraits,
) -> RenderCall:
    conversation = [_vllm_message(m, traits) for m in messages]
    tool_dicts = None if tools is None else [_vllm_tool(t) for t in tools]
    # The request's chat_template_kwargs first, the request's own fields over them (unset ones
    # do not count), then only what the template or apply_chat_template accepts.
    merged = dict(template_kwargs)
    effort = _vllm_reasoning_effort(body)
    explicit = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final,
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in template_kwargs:
        explicit["enable_thinking"] = effort != "none"
    merged.update({k: v for k, v in explicit.items() if v is not None and v != "auto"})
    if "tools" in merged:  # a `tools` inside chat_template_kwargs wins over the request's
        tool_dicts = merged.pop("tools")
    if {"chat_template", "tokenize"} & merged.keys():
        raise Unrenderable("render", "chat_template_kwargs may not set chat_template or tokenize")
    kwargs = {k: v for k, v in merged.items() if k in traits.accepted_kwargs}
    return RenderCall(conversation, tool_dicts, kwargs)


# vLLM's `has_non_text_content`: part types read as text, and keys that make a part media
# whatever its type (`MM_PARSER_MAP`'s other names).
_VLLM_TEXT_PARTS: Final = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
_VLLM_MEDIA_KEYS: Final = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


def _vllm_has_media(messages: Any) -> bool:
    """Whether a message holds more than text: a part of another type or with a media key, or
    reasoning given as prompt embeddings (vLLM renders such chats whatever ids they bring)."""
    for message in messages if type(messages) is list else ():
        if type(message) is not dict:
            continue
        for key in ("reasoning", "reasoning_content"):
            reasoning = message.get(key)
            if type(reasoning) is dict and reasoning.get("type") == "prompt_embeds":
                return True
        content = message.get("content")
        for part in content if type(content) is list else ():
            if type(part) is not dict:
                continue
            kind = part.get("type", "text")
            if type(kind) is not str or kind not in _VLLM_TEXT_PARTS:
                return True
            if not _VLLM_MEDIA_KEYS.isdisjoint(part):
                return True
    return False


def _exact_int(value: Any) -> int:
    """An id as vLLM checks forwarded ids: an int, not a bool, a float or a string."""
    if type(value) is int:
        return value
    raise ValueError(f"{shown(value)} is not an integer")


_VLLM_EFFORTS: Final = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


def _vllm_reasoning_effort(body: dict[str, Any]) -> str | None:
    """vLLM's `reasoning_effort`: a Literal of its words, exactly, or null."""
    effort = body.get("reasoning_effort")
    if effort is None or (type(effort) is str and effort in _VLLM_EFFORTS):
        return effort
    raise ChatRequestError(
        f"'reasoning_effort' must be one of {sorted(_VLLM_EFFORTS)}, not {shown(effort)}",
        "reasoning_effort",
    )


def _vllm_message(message: dict[str, Any], traits: TemplateTraits) -> dict[str, Any]:
    role = message["role"]
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    if role == "system":
        content = _without_billing_header(content)
    if isinstance(content, str) and not traits.content_as_parts:
        out["content"] = content  # the common case, without building parts
    else:
        texts, parts = _vllm_parts(content)
        out["content"] = parts if traits.content_as_parts else "\n".join(texts)
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            calls = [_vllm_tool_call(c) for c in calls]
            if calls:  # an empty list would send templates down their tool-call path
                out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:  # vLLM renames the deprecated field before anything reads it
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        parts = out["content"]
        # Most templates expect a tool result as a string: text-only part lists are joined.
        if isinstance(parts, list) and all(p.get("type") == "text" for p in parts):
            out["content"] = "\n".join(p["text"] for p in out["content"])
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        if traits.names_developer:
            out["tools"] = message.get("tools")
        else:
            out["role"] = "system"
    return out


# The line Claude Code puts first in its system prompt; its `cch=` changes on every request.
_CLAUDE_CODE_BILLING_HEADER: Final = "x-anthropic-billing-header"


def _without_billing_header(content: Any) -> Any:
    """A system message's content as vLLM 0.32+ reads it (`_strip_claude_code_billing_header`):
    a text part, or the string, that starts with Claude Code's billing header loses its first
    line, and is gone when nothing follows (gateways translating Anthropic requests keep the
    line, and from it on nothing would be cached)."""
    if isinstance(content, str):
        if not content.startswith(_CLAUDE_CODE_BILLING_HEADER):
            return content
        content = [content]
    if not isinstance(content, list):
        return content
    kept: list[Any] = []
    for part in content:
        if isinstance(part, str):
            text = part
        elif part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _vllm_parts(content: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The texts vLLM joins into a string (empty ones left out), and the parts as the template
    sees them (openai format)."""
    if content is None:
        return [], []
    if isinstance(content, str):
        return [content], [{"type": "text", "text": content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content:
        # vLLM keeps what a part parses to unless it is falsy: an empty text is left out of
        # the string it joins (`Hello\nworld`, not `Hello\n\nworld`), but kept as a part.
        if isinstance(part, str):
            if part:
                texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        if part.get("type") == "tool_reference":
            # A deferred tool's name, for the template to expand (GLM's look it up in `tools`);
            # as a string, the name joined like a text.
            name = part.get("name")
            if name:
                texts.append(name)
            parts.append({"type": "tool_reference", "name": name})
            continue
        key = _TEXT_PART_KEYS.get(part.get("type"))  # type: ignore[arg-type]
        if key is None:
            raise Unrenderable("content", f"a {part.get('type')!r} content part is not text")
        text = part.get(key)
        if text is None and part["type"] in _VLLM_SKIPPED_WITHOUT_TEXT:
            continue
        # A thinking, input_text or output_text part without text stays a part, its text
        # null (`PART_TYPES_TO_SKIP_NONE_CONTENT` holds text and refusal alone).
        if text:
            texts.append(text)
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        parts.append({"type": "text", "text": text, **extra})
    return texts, parts


def _vllm_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    if call.get("type", "function") != "function":
        raise ChatRequestError("assistant tool_calls must be of type 'function'", "tool_calls")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            parsed = _parsed_arguments(arguments)
        except ValueError:
            parsed = {}  # vLLM coerces malformed history so the conversation can go on
        function["arguments"] = parsed if isinstance(parsed, dict) else {}
    elif not isinstance(arguments, dict):
        function["arguments"] = {}
    return {**call, "function": function}


def _vllm_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's request models dump it (0.27+, `ChatCompletionToolsParam` and
    `FunctionDefinition`): their declared fields alone, in order, unknown keys dropped; a
    missing description or parameters is `null`, a null `strict` or `defer_loading` is left
    out, and the tool's `defer_loading` is its function's too unless that has its own.
    (0.24-0.26 dumped the unknown keys after the declared ones; 0.22-0.23 had no `strict`.)"""
    if tool.get("type", "function") != "function":
        raise Unrenderable("tools", f"vLLM accepts function tools only, not {tool.get('type')!r}")
    fn = tool["function"]
    function = {
        "name": fn["name"],
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }
    strict = _tool_flag(fn, "strict")
    if strict is not None:
        function["strict"] = strict
    deferred = _tool_flag(tool, "defer_loading")
    own = _tool_flag(fn, "defer_loading")
    if own is not None or deferred is not None:
        function["defer_loading"] = deferred if own is None else own
    out: dict[str, Any] = {"type": "function", "function": function}
    if deferred is not None:
        out["defer_loading"] = deferred
    return out


def _tool_flag(holder: dict[str, Any], key: str) -> bool | None:
    """A `bool | None` field of the engines' tool models (`_optional_flag`)."""
    return _optional_flag(holder, key, "a tool's", "tools")


def _optional_flag(holder: dict[str, Any], key: str, whose: str, param: str) -> bool | None:
    """A `bool | None` field of the engines' request models, read as pydantic reads it: null
    or absent is None; what it cannot read as a boolean is a 400 naming `param`."""
    value = holder.get(key)
    if value is None:
        return None
    try:
        return lax_bool(value)
    except ValueError:
        raise ChatRequestError(f"{whose} '{key}' must be a boolean", param) from None


# --- SGLang ---------------------------------------------------------------------------------

# The roles of 0.5.23's generic message model, taken in any case and rendered lower-cased
# (`root` among them, as MiniMax M3's templates name it). `user` is not one: its own model
# takes it exactly, so a `User` fits neither and is a 400.
_SGLANG_GENERIC_ROLES: Final = frozenset(
    {"system", "assistant", "tool", "function", "developer", "latest_reminder", "root"}
)
# The content part types SGLang's request model takes (`ChatCompletionMessageContentPart`):
# any other part, an `input_text` or a bare string too, is a 400 there.
_SGLANG_PART_TYPES: Final = frozenset(
    {
        "text",
        "thinking",
        "reasoning",
        "image_url",
        "video_url",
        "audio_url",
        "input_audio",
        "tool_reference",
    }
)
_SGLANG_MEDIA: Final = frozenset({"image_url", "video_url", "audio_url", "input_audio"})
_SGLANG_THINKING_PARTS: Final = frozenset({"thinking", "reasoning"})


def _sglang_call(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    continue_final: bool,
    traits: TemplateTraits,
) -> RenderCall:
    conversation = [_sglang_message(m, traits.content_as_parts_sglang) for m in messages]
    suffix = ""
    last = conversation[-1]
    if last["role"] == "assistant" and isinstance(last.get("content"), str):
        if continue_final:
            suffix = last["content"]
            conversation.pop()
        else:
            conversation[-1] = {"role": "user", "content": last["content"]}
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    effort, template_kwargs = _sglang_reasoning(body)
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    kwargs.update(template_kwargs)
    tool_dicts = _sglang_tools(tools, body.get("tool_choice"))
    return RenderCall(conversation, tool_dicts, kwargs, suffix, retry_with_bare_tools=True)


_SGLANG_EFFORTS: Final = frozenset(
    {"none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"}
)
_SGLANG_MOST_EFFORT: Final = 0.99  # a number is an effort in [0, 0.99]
_SGLANG_ENABLED_WORDS: Final = frozenset({"1", "true", "yes", "y", "on"})


def _sglang_reasoning(body: dict[str, Any]) -> tuple[str | float | None, dict[str, Any]]:
    """SGLang's reasoning effort and the chat_template_kwargs it renders with (0.5.23).

    Its request model reads the effort from `reasoning_effort`, or from a `reasoning` object
    (`effort`, else `reasoning_effort`) over it; any effort, or `reasoning.enabled` (else
    `enable`) true, sets `thinking` and `enable_thinking` in chat_template_kwargs unless they
    are there (kwargs that are not an object are then replaced, not refused). Its chat server
    then takes `chat_template_kwargs.reasoning_effort`, unchecked, over the effort."""
    effort = body.get("reasoning_effort")
    thinking = None
    reasoning = body.get("reasoning")
    if type(reasoning) is dict:
        given = reasoning.get("effort")
        if given is None:
            given = reasoning.get("reasoning_effort")
        if given is not None:
            effort = given  # read below like the field (a number string is a number)
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if type(enabled) is str:
            enabled = enabled.strip().lower() in _SGLANG_ENABLED_WORDS
        if enabled:
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    raw = body.get("chat_template_kwargs")
    if thinking is not None:
        template_kwargs = dict(raw) if isinstance(raw, dict) else {}
        template_kwargs.setdefault("thinking", thinking)
        template_kwargs.setdefault("enable_thinking", thinking)
    else:
        template_kwargs = dict(_checked_object(raw, "chat_template_kwargs"))
    effort = _sglang_effort(effort)
    given = template_kwargs.pop("reasoning_effort", None)
    return (effort if given is None else given), template_kwargs


def _sglang_effort(effort: Any) -> str | float | None:
    """SGLang's `reasoning_effort` field: null, one of its words, or a number (a number string
    too, read as pydantic reads a float) in [0, 0.99]; never a boolean."""
    if effort is None or (type(effort) is str and effort in _SGLANG_EFFORTS):
        return effort  # type: ignore[no-any-return]
    try:
        if type(effort) is bool:
            raise ValueError("a boolean")
        number = lax_float(effort)
    except ValueError:
        number = math.nan
    if not 0.0 <= number <= _SGLANG_MOST_EFFORT:  # nan and inf fail it too
        raise ChatRequestError(
            f"'reasoning_effort' must be one of {sorted(_SGLANG_EFFORTS)} or a number in "
            f"[0, {_SGLANG_MOST_EFFORT}], not {shown(effort)}",
            "reasoning_effort",
        )
    return number


def _sglang_message(message: dict[str, Any], as_parts: bool) -> dict[str, Any]:
    role = message["role"]
    if role != "user" and (role := role.lower()) not in _SGLANG_GENERIC_ROLES:
        raise Unrenderable("role", f"SGLang refuses the role {message['role']!r}")
    if role == "user":
        dumped: dict[str, Any] = {"role": role, "content": message.get("content")}
    else:
        dumped = {"role": role, "content": message.get("content")}
        for key in ("tool_call_id", "name"):
            dumped[key] = _sglang_optional_str(message.get(key), f"a message's '{key}'")
        dumped["phase"] = _sglang_phase(message.get("phase"))
        dumped["reasoning_content"] = message.get("reasoning_content")
        calls = message.get("tool_calls")
        dumped["tool_calls"] = None if calls is None else [_sglang_tool_call(c) for c in calls]
        tools = message.get("tools")
        dumped["tools"] = None if tools is None else [_sglang_tool_dump(t) for t in tools]
        dumped["prefix"] = _optional_flag(message, "prefix", "a message's", "messages")
    if dumped["content"] is None:
        dumped["content"] = ""
    content = dumped["content"]
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _SGLANG_PART_TYPES:
                raise Unrenderable("content", f"SGLang refuses a content part of type {kind!r}")
            if kind in _SGLANG_THINKING_PARTS:
                _sglang_check_thinking_part(part, role)
        if as_parts:
            dumped["content"] = _sglang_parts(content)
        else:
            dumped["content"] = " ".join(p["text"] for p in content if p["type"] == "text")
        if (
            role == "tool"
            and isinstance(dumped["content"], list)
            and all(p.get("type") == "text" for p in dumped["content"])
        ):
            dumped["content"] = " ".join(p["text"] for p in dumped["content"])
    return {k: v for k, v in dumped.items() if v is not None}


_SGLANG_PHASES: Final = ("commentary", "final_answer")


def _sglang_phase(phase: Any) -> str | None:
    """A message's `phase` (0.5.23, the Responses API's): null or one of its two words, which
    the template sees."""
    if phase is not None and phase not in _SGLANG_PHASES:
        raise ChatRequestError(
            f"a message's 'phase' must be one of {list(_SGLANG_PHASES)}, not {shown(phase)}"
        )
    return phase  # type: ignore[no-any-return]


def _sglang_check_thinking_part(part: dict[str, Any], role: str) -> None:
    """SGLang's request models (`ChatCompletionMessageContentThinkingPart` and the messages'
    validators) take a thinking part in an assistant message alone, holding exactly one of a
    string `thinking` or `text`: any other is its 400, routed as a miss like a part it refuses
    (the template never sees the part either way)."""
    if role != "assistant":
        raise Unrenderable("content", "SGLang takes thinking parts in assistant messages alone")
    given = [part.get(key) for key in ("thinking", "text") if part.get(key) is not None]
    if len(given) != 1 or type(given[0]) is not str:
        raise Unrenderable("content", "an SGLang thinking part holds one of thinking or text")


def _sglang_parts(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parts a template taking parts sees (a thinking part is left out)."""
    parts = []
    for part in content:
        kind = part["type"]
        if kind == "text":
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "tool_reference":
            parts.append({"type": "tool_reference", "name": part["name"]})
        elif kind in _SGLANG_MEDIA:
            raise Unrenderable("content", f"a {kind!r} content part is not text")
    return parts


def _sglang_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call as SGLang's `ToolCall` dumps it and
    `normalize_assistant_tool_call_arguments` parses it: arguments null, an object, or a
    string of a JSON object; anything else is its 400 (routed as a miss)."""
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = _sglang_parsed_arguments(arguments)
        except ValueError:
            raise Unrenderable("tool_arguments", "tool-call arguments are not JSON") from None
        if not isinstance(arguments, dict):
            raise Unrenderable("tool_arguments", "tool-call arguments are not a JSON object")
    elif arguments is not None and not isinstance(arguments, dict):
        raise Unrenderable("tool_arguments", "tool-call arguments are no string or object")
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": "function",
        "function": {
            "name": _sglang_optional_str(function.get("name"), "a tool call's function 'name'"),
            "arguments": arguments,
        },
    }


def _sglang_optional_str(value: Any, what: str) -> str | None:
    """A field SGLang's models declare `Optional[str]`: pydantic takes no number for it."""
    if value is not None and not isinstance(value, str):
        raise ChatRequestError(f"{what} must be a string, not {shown(value)}")
    return value


_U64_END: Final = 1 << 64
_I64_START: Final = -(1 << 63)
# A JSON escape of a UTF-16 surrogate: only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _sglang_parsed_arguments(text: str) -> Any:
    """Tool-call arguments as SGLang parses them (`orjson.loads`, 3.x), where that differs
    from `json.loads`: NaN, Infinity, a number past a double's range and a lone surrogate are
    not JSON (ValueError), and an integer outside [-2**63, 2**64) is read as a float (so the
    template dumps `1.2345678901234568e+29`, not its digits)."""
    if _has_surrogate(text):
        raise ValueError("a lone surrogate")
    parsed = _parsed_arguments(
        text, parse_constant=_not_json, parse_float=_finite, parse_int=_orjson_int
    )
    if _SURROGATE_ESCAPE.search(text) and _holds_surrogate(parsed):
        raise ValueError("a lone surrogate")
    return parsed


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError("a number past a double's range")
    return number


def _orjson_int(text: str) -> int | float:
    number = int(text)
    return number if _I64_START <= number < _U64_END else _finite(text)


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _holds_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return _has_surrogate(value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _holds_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_surrogate(v) for v in value)
    return False


def _sglang_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    if not tools or choice == "none":
        return None
    dumped = [_sglang_tool_dump(t) for t in tools]
    if isinstance(choice, dict):
        function = choice.get("function") or {}
        if not isinstance(function, dict):
            raise ChatRequestError("'tool_choice.function' must be an object", "tool_choice")
        dumped = [t for t in dumped if t["function"]["name"] == function.get("name")]
    return dumped


def _sglang_tool_dump(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as SGLang 0.5.23's request models dump it (`Tool`, `Function`): the flags read as
    pydantic reads them, the tool's `defer_loading` its function's too unless that has one, a
    function's null `strict` or `defer_loading` left out, and its declared fields in the order
    the client wrote them, those it left out after (a missing description is `null`). (0.5.22
    and older dumped `strict` as false when unset, fields in their declared order.)"""
    fn = tool["function"]
    deferred = _tool_flag(tool, "defer_loading")
    own = _tool_flag(fn, "defer_loading")
    declared: dict[str, Any] = {
        "description": fn.get("description"),
        "name": fn["name"],
        "parameters": fn.get("parameters"),
        "strict": _tool_flag(fn, "strict"),
        "defer_loading": deferred if own is None else own,
    }
    order = [*(k for k in fn if k in declared), *(k for k in declared if k not in fn)]
    function = {
        k: declared[k]
        for k in order
        if declared[k] is not None or k not in ("strict", "defer_loading")
    }
    return {"type": tool.get("type", "function"), "function": function, "defer_loading": deferred}


def bare_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """SGLang's second attempt: tools without the OpenAI wrapper (some templates want that)."""
    return None if tools is None else [t.get("function", t) for t in tools]
