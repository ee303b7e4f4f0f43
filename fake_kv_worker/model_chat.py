"""The fake engine on a real model directory: its tokenizer and chat rendering, as the engines do.

`--tokenizer DIR` loads the directory with transformers' AutoTokenizer (what vLLM and SGLang
call) and turns a chat request into prompt ids the way each engine's OpenAI server does:

- vLLM: parse every message (content parts to a string joined with newlines, or kept as
  `{"type": "text"}` parts when the template loops over a message's content; `developer` sent
  as `system` unless the template names it; the deprecated `reasoning_content` read as
  `reasoning`; Claude Code's billing-header line dropped from system text), parse tool-call
  arguments, dump the tools as its request model does, resolve the template kwargs (request
  fields over chat_template_kwargs, `enable_thinking` from `reasoning_effort` when the kwargs
  do not set it, filtered to the template's variables and apply_chat_template's parameters),
  render with `apply_chat_template(tokenize=False)` and encode without special tokens.
- SGLang: dump the messages as its request models do, flatten content with spaces, turn a
  trailing assistant message into a user turn (or append it after the generation prompt with
  `continue_final_message`), read the reasoning effort as its request model does (also from
  a `reasoning` object; `thinking` and `enable_thinking` set from it unless given;
  `chat_template_kwargs.reasoning_effort` over it), render with `add_generation_prompt=True`
  and retry with bare function tools when the template refuses the wrapped ones.

A multimodal model's processor has a template of its own (its `chat_template.json`): vLLM
renders a request without tools by it, SGLang every request.

Both take the prompt's ids as they are, the template skipped, when a chat brings them: SGLang's
`input_ids`, vLLM's `kv_transfer_params.prompt_token_ids` (`given_chat_ids`).

This is the engine's side of the bargain, written from the engines' code, independently of the
router (which must not be imported here): the tests hold the router's ids against these, so a
rule the router gets wrong shows up as a mismatch. A request the engine refuses raises
RequestError (400), as the engine answers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from fake_kv_worker.protocol import (
    RequestError,
    lax_bool,
    lax_token_ids,
    token_ids,
    truncation_fields,
)


class ModelChat:
    """A model directory's tokenizer and chat template, behind one engine's chat rules."""

    def __init__(self, directory: str, engine: str, max_model_len: int | None = None) -> None:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # torch is not needed
        from transformers import AutoTokenizer, logging

        logging.set_verbosity_error()
        # vLLM loads a generation model's tokenizer with truncation_side="left".
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(Path(directory)),
            local_files_only=True,
            trust_remote_code=False,
            truncation_side="left",
        )
        self.engine = engine
        self.max_model_len = max_model_len  # what truncate_prompt_tokens=-1 reaches for
        self.processor_template = _processor_template(directory)
        if engine == "sglang" and self.processor_template:
            # SGLang's template manager puts a multimodal model's processor template in
            # place of the tokenizer's.
            self.tokenizer.chat_template = self.processor_template
        self._apply_params = _apply_params(self.tokenizer)

    def encode(
        self, text: str, add_special_tokens: bool = True, truncation: Truncation = (None, None)
    ) -> list[int]:
        """A completion prompt: the tokenizer adds its special tokens (BOS), unless a vLLM
        request says `"add_special_tokens": false` (SGLang's model has no such field); cut as
        `truncation` (vLLM's `truncate_prompt_tokens`, `truncation_side`) says."""
        if self.engine == "sglang":
            return list(self.tokenizer.encode(text, add_special_tokens=True))
        return self._vllm_encode(text, add_special_tokens, truncation)

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        given = given_chat_ids(body, self.engine)
        if given is not None:
            return given
        if self.engine == "sglang":
            # apply_chat_template(tokenize=True) encodes without special tokens.
            text = self._sglang_prompt(body)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        # vLLM's chat model: false by default; true adds them on top of the template's.
        text = self._vllm_prompt(body)
        special = _with_lax_bools(body, ("add_special_tokens",)).get("add_special_tokens", False)
        output = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        return self._vllm_encode(text, special, self.truncation(body, output))

    def truncation(self, body: dict[str, Any], max_tokens: int) -> Truncation:
        """vLLM's `truncate_prompt_tokens` (-1: the context less max_tokens) and side."""
        if self.engine == "sglang":
            return None, None  # SGLang's models have no such fields
        keep, side = truncation_fields(body)
        if keep == -1:
            keep = None if self.max_model_len is None else self.max_model_len - max_tokens
        return keep, side

    def _vllm_encode(self, text: str, special: bool, truncation: Truncation) -> list[int]:
        keep, side = truncation
        if keep is None:
            return list(self.tokenizer.encode(text, add_special_tokens=special))
        if side is None:  # the tokenizer cuts, on its own side, keeping room for BOS
            ids = self.tokenizer.encode(
                text, add_special_tokens=special, truncation=True, max_length=keep
            )
            return vllm_cut(list(ids), truncation)
        return vllm_cut(list(self.tokenizer.encode(text, add_special_tokens=special)), truncation)

    # --- vLLM ---------------------------------------------------------------------------

    def _vllm_prompt(self, body: dict[str, Any]) -> str:
        body = _with_lax_bools(body, ("add_generation_prompt", "continue_final_message"))
        if body.get("continue_final_message") and body.get("add_generation_prompt", True):
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        tools = body.get("tools")
        tool_dicts = None if tools is None else [_vllm_dump_tool(t) for t in tools]
        template = self._template(tool_dicts)
        parts_format = _loops_over_message_content(template)
        conversation = []
        for message in body["messages"]:
            message = _vllm_renamed_reasoning(message)
            conversation.append(_vllm_parse_message(message, parts_format, template))
        for message in conversation:
            _vllm_fix_tool_calls(message)
        chat_kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in VLLM_EFFORTS:
            raise RequestError("Input should be one of the reasoning efforts", "reasoning_effort")
        for name, default in (
            ("add_generation_prompt", True),
            ("continue_final_message", False),
            ("documents", None),
            ("reasoning_effort", None),
        ):
            value = body.get(name, default)
            if value is not None and value != "auto":
                chat_kwargs[name] = value
        if effort is not None and "enable_thinking" not in (body.get("chat_template_kwargs") or {}):
            chat_kwargs["enable_thinking"] = effort != "none"
        if "tools" in chat_kwargs:
            tool_dicts = chat_kwargs.pop("tools")
        if "chat_template" in chat_kwargs or "tokenize" in chat_kwargs:
            raise RequestError("Found unexpected chat template kwargs from request", "messages")
        accepted = _template_variables(template) | self._apply_params
        resolved = {k: v for k, v in chat_kwargs.items() if k in accepted}
        try:
            return self.tokenizer.apply_chat_template(  # type: ignore[no-any-return]
                conversation,
                tools=tool_dicts,
                chat_template=template,
                tokenize=False,
                **resolved,
            )
        except Exception as exc:
            raise RequestError(str(exc), "messages") from None

    def _template(self, tools: Any) -> str:
        # vLLM's resolve_chat_template: the processor's template for a request without tools.
        if self.engine == "vllm" and tools is None and self.processor_template is not None:
            return self.processor_template
        try:
            return self.tokenizer.get_chat_template(None, tools)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from None

    # --- SGLang -------------------------------------------------------------------------

    def _sglang_prompt(self, body: dict[str, Any]) -> str:
        body = _with_lax_bools(body, ("continue_final_message",))
        tools = None
        if body.get("tools") and body.get("tool_choice", "auto") != "none":
            tools = [_sglang_dump_tool(t) for t in body["tools"]]
            choice = body.get("tool_choice")
            if isinstance(choice, dict):
                tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        template = self._template(tools)
        keyword_parts = any(w in template for w in ("image", "audio", "video", "vision"))
        parts_format = keyword_parts or _loops_over_fixed_names(template)
        messages = []
        for message in body["messages"]:
            dumped = _sglang_dump_message(message)
            if dumped["content"] is None:
                dumped["content"] = ""
            messages.append(_sglang_content(dumped, parts_format))
        prefix = None
        if messages[-1]["role"] == "assistant" and isinstance(messages[-1].get("content"), str):
            if body.get("continue_final_message"):
                prefix = messages.pop()["content"]
            else:
                messages[-1] = {"role": "user", "content": messages[-1]["content"]}
        effort, template_kwargs = _sglang_reasoning_inputs(body)
        given = template_kwargs.pop("reasoning_effort", None)
        if given is not None:
            effort = given
        extra: dict[str, Any] = {}
        if effort is not None:
            extra["reasoning_effort"] = effort
        extra.update(template_kwargs)
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                tools=tools,
                return_dict=False,
                **extra,
            )
        except Exception:
            flat = [t.get("function", t) for t in tools] if tools else None
            try:
                rendered = self.tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=True,
                    tools=flat,
                    return_dict=False,
                    **extra,
                )
            except Exception as exc:
                raise RequestError(str(exc), "messages") from None
        return rendered + (prefix or "")


Truncation = tuple[int | None, str | None]  # truncate_prompt_tokens, truncation_side


def _processor_template(directory: str) -> Any:
    """The chat template of the directory's AutoProcessor when it is a processor (a multimodal
    model's; a text model's AutoProcessor is its tokenizer), as vLLM and SGLang load it. One
    that fails to load has none: vLLM then renders by the tokenizer's template."""
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(
            str(Path(directory)), local_files_only=True, trust_remote_code=False
        )
    except Exception:
        return None
    return processor.chat_template if isinstance(processor, ProcessorMixin) else None


def given_chat_ids(body: Mapping[str, Any], engine: str) -> list[int] | None:
    """The ids a chat brings for the engine to take as they are, or None to render it.

    SGLang 0.5.23: `input_ids` (a pydantic List[int]; serving_chat.py `_process_messages`
    skips the template for them; an empty list is refused). vLLM 0.32+: the decode side of a
    disaggregated pair reuses `kv_transfer_params.prompt_token_ids` unless `echo` is set or a
    message has non-text content (renderers/online_renderer.py `_reused_prompt_token_ids`)."""
    if engine == "sglang":
        ids = body.get("input_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids cannot be empty.", "input_ids")
        return lax_token_ids(ids, "input_ids")
    transfer = body.get("kv_transfer_params")
    if not isinstance(transfer, dict) or transfer.get("prompt_token_ids") is None:
        return None
    if lax_bool(body.get("echo", False), "echo") or _vllm_non_text(body.get("messages")):
        return None
    param = "kv_transfer_params.prompt_token_ids"
    ids = token_ids(transfer["prompt_token_ids"], param)
    if not ids:
        raise RequestError(f"'{param}' must be a non-empty list of token ids", param)
    return ids


_VLLM_TEXT_PART_TYPES = {"text", "input_text", "output_text", "refusal", "thinking"}
_VLLM_MEDIA_KEYS = {
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


def _vllm_non_text(messages: Any) -> bool:
    """vLLM's has_non_text_content."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            continue
        for field in ("reasoning", "reasoning_content"):
            reasoning = message.get(field)
            if isinstance(reasoning, dict) and reasoning.get("type") == "prompt_embeds":
                return True
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type", "text")
                if any(key in part for key in _VLLM_MEDIA_KEYS) or not isinstance(kind, str):
                    return True
                if kind not in _VLLM_TEXT_PART_TYPES | {"tool_reference"}:
                    return True
    return False


def vllm_cut(ids: list[int], truncation: Truncation) -> list[int]:
    """vLLM's `_token_truncation` of encoded ids (the tokenizer's side is left)."""
    keep, side = truncation
    if keep is None or keep >= len(ids):
        return ids
    if keep == 0:
        return []
    return ids[:keep] if side == "right" else ids[-keep:]


def _with_lax_bools(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The body with these fields as the request model holds them (pydantic's lax bools; a
    field given as null is refused, as the models' plain `bool` fields refuse it)."""
    return {**body, **{name: lax_bool(body[name], name) for name in names if name in body}}


# vLLM 0.22+'s ChatCompletionRequest.reasoning_effort Literal.
VLLM_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# SGLang 0.5.23's ReasoningEffortTier; a float in [0, 0.99] is an effort too.
SGLANG_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")


def _sglang_reasoning_inputs(body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """SGLang's ChatCompletionRequest.normalize_reasoning_inputs, then its reasoning_effort
    field's validation: the effort and the chat_template_kwargs the request ends up with."""
    reasoning = body.get("reasoning")
    effort = body.get("reasoning_effort")
    thinking = None
    if isinstance(reasoning, dict):
        given = reasoning.get("effort")
        if given is None:
            given = reasoning.get("reasoning_effort")
        if isinstance(given, str) and given in SGLANG_EFFORTS:
            effort = given
        elif isinstance(given, int | float) and not isinstance(given, bool):
            effort = float(given)
        elif isinstance(given, str):
            try:
                effort = float(given)
            except ValueError:
                raise RequestError("invalid reasoning effort", "reasoning_effort") from None
        elif given is not None:
            raise RequestError("invalid reasoning effort", "reasoning_effort")
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in {"1", "true", "yes", "y", "on"}
        if enabled:
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    template_kwargs = body.get("chat_template_kwargs")
    if thinking is not None:
        template_kwargs = dict(template_kwargs) if isinstance(template_kwargs, dict) else {}
        template_kwargs.setdefault("thinking", thinking)
        template_kwargs.setdefault("enable_thinking", thinking)
    elif template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise RequestError("chat_template_kwargs must be a dict", "chat_template_kwargs")
    return _sglang_effort(effort), dict(template_kwargs or {})


def _sglang_effort(effort: Any) -> Any:
    if effort is None or (isinstance(effort, str) and effort in SGLANG_EFFORTS):
        return effort
    try:
        if isinstance(effort, bool) or not isinstance(effort, int | float | str):
            raise ValueError(effort)
        number = float(effort)  # a string: pydantic's lax float, close enough for a mirror
    except ValueError:
        raise RequestError("reasoning_effort is no tier nor float", "reasoning_effort") from None
    if not 0.0 <= number <= 0.99:
        raise RequestError("reasoning_effort must be in [0, 0.99]", "reasoning_effort")
    return number


# --- vLLM helpers ---------------------------------------------------------------------------

_TEXT_TYPES = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_PART_FIELDS = {
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


def _vllm_renamed_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """ChatCompletionRequest._normalize_messages_before (vLLM 0.22+): the deprecated
    `reasoning_content` is taken away, and becomes `reasoning` unless that is set."""
    message = dict(message)
    legacy = message.pop("reasoning_content", None)
    if legacy is not None and message.get("reasoning") is None:
        message["reasoning"] = legacy
    return message


def _vllm_strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM 0.32+ `_strip_claude_code_billing_header`: a system text part starting with Claude
    Code's `x-anthropic-billing-header` loses its first line, and goes if that was all of it."""
    out = []
    for part in parts:
        is_text_dict = isinstance(part, dict) and part.get("type") == "text"
        text = part if isinstance(part, str) else part.get("text") if is_text_dict else None
        if isinstance(text, str) and text.startswith("x-anthropic-billing-header"):
            rest = text.split("\n", 1)[1] if "\n" in text else ""
            if not rest:
                continue
            part = {**part, "text": rest} if is_text_dict else rest
        out.append(part)
    return out


def _vllm_parse_part(part: Any, parts_format: bool) -> Any:
    """parse_chat_message_content_part for a text model: a dict in the openai format, else the
    text itself; None for a part without text, but for a thinking, input_text or output_text
    part in the openai format (`{"type": "text", "text": None}`)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if parts_format else part
    kind = part.get("type")
    if kind == "tool_reference":  # vLLM 0.22+: passed through for the template to expand
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if parts_format else name
    if kind not in _TEXT_TYPES:
        raise RequestError(f"unsupported content part {kind!r} for a text model", "messages")
    text = part.get(_TEXT_TYPES[kind])
    if text is None and (kind in ("text", "refusal") or not parts_format):
        return None  # PART_TYPES_TO_SKIP_NONE_CONTENT; the other text types stay, text null
    if parts_format:
        extra = {k: v for k, v in part.items() if k not in _PART_FIELDS}
        return {"type": "text", "text": text, **extra}
    return text


def _vllm_parse_message(message: dict[str, Any], parts_format: bool, template: str) -> dict:
    role = message["role"]
    content = message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if role == "system":
        content = _vllm_strip_billing_header(content)
    pieces: list[Any] = []
    for part in content:
        piece = _vllm_parse_part(part, parts_format)
        if piece:  # parse_chat_message_content_parts: `if parse_res:` ("" too, in strings)
            pieces.append(piece)
    result: dict[str, Any] = {
        "role": role,
        "content": pieces if parts_format else "\n".join(pieces),
    }
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = [
                {**c, "function": dict(c["function"])} for c in message["tool_calls"]
            ]
        if message.get("reasoning") is not None:
            result["reasoning"] = message["reasoning"]
            result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list):
            if any(isinstance(p, dict) and p.get("type") != "text" for p in result["content"]):
                pass
            else:
                texts = [p.get("text", "") for p in result["content"]]
                result["content"] = "\n".join(texts) if texts else ""
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        if "developer" in template:
            result["tools"] = message.get("tools")
        else:
            result["role"] = "system"
    return result


def _vllm_fix_tool_calls(message: dict[str, Any]) -> None:
    if message["role"] != "assistant" or "tool_calls" not in message:
        return
    calls = message["tool_calls"]
    if len(calls) == 0:
        del message["tool_calls"]
        return
    for call in calls:
        if call.get("type", "function") != "function":
            raise RequestError("only function tool calls are supported", "tool_calls")
        function = call["function"]
        raw = function.get("arguments")
        if not raw:
            function["arguments"] = {}
            continue
        if isinstance(raw, dict):
            continue
        if isinstance(raw, str):
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = None
            except RecursionError:  # a RuntimeError: vLLM's chat handler answers it 400
                raise RequestError("function.arguments nest too deeply", "messages") from None
        else:
            parsed = raw
        function["arguments"] = parsed if isinstance(parsed, dict) else {}


def _vllm_dump_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """ChatCompletionToolsParam(**tool).model_dump() in vLLM 0.27+: the declared fields only,
    `strict` and `defer_loading` left out when null, and a tool-level `defer_loading` copied
    into a function that has none (`_propagate_defer_loading`)."""
    if tool.get("type", "function") != "function":
        raise RequestError("tools must be of type 'function'", "tools")

    def flag(holder: dict[str, Any], key: str) -> bool | None:
        return None if holder.get(key) is None else lax_bool(holder[key], key)

    function = tool["function"]
    tool_defer = flag(tool, "defer_loading")
    fn_defer = flag(function, "defer_loading")
    if fn_defer is None:
        fn_defer = tool_defer
    dumped_fn = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        "strict": flag(function, "strict"),
        "defer_loading": fn_defer,
    }
    for optional in ("strict", "defer_loading"):
        if dumped_fn[optional] is None:
            del dumped_fn[optional]
    dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
    if tool_defer is not None:
        dumped["defer_loading"] = tool_defer
    return dumped


@lru_cache(maxsize=16)  # a model has a template or a few: parse each once
def _jinja_ast(template: str) -> Any:
    from transformers.utils import chat_template_utils

    compiled = chat_template_utils._compile_jinja_template(template)
    return compiled.environment.parse(template)


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(_jinja_ast(template)))


def _apply_params(tokenizer: Any) -> set[str]:
    import inspect

    from transformers import PreTrainedTokenizerBase

    names = set()
    for fn in (tokenizer.apply_chat_template, PreTrainedTokenizerBase.apply_chat_template):
        for p in inspect.signature(fn).parameters.values():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                names.add(p.name)
    return names - {"self"}


def _is_access(node: Any, name: str, key: str | None) -> bool:
    import jinja2.nodes as n

    while isinstance(node, n.Filter | n.Test) or (
        isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice)
    ):
        node = node.node
        if node is None:
            return False
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, n.Getattr):
        return node.attr == key and _is_access(node.node, name, None)
    if isinstance(node, n.Getitem):
        return (
            isinstance(node.arg, n.Const)
            and node.arg.value == key
            and _is_access(node.node, name, None)
        )
    return False


@lru_cache(maxsize=16)
def _loops_over_message_content(template: str) -> bool:
    """vLLM: a loop over `<message>['content']`, where `<message>` loops over `messages` or a
    variable assigned from it."""
    import jinja2.nodes as n

    ast = _jinja_ast(template)
    names = ["messages"]
    pending = ["messages"]
    while pending:
        current = pending.pop(0)
        for assign in ast.find_all(n.Assign):
            if _is_access(assign.node, current, None) and isinstance(assign.target, n.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    message_vars = [
        loop.target.name
        for loop in ast.find_all(n.For)
        if isinstance(loop.target, n.Name) and any(_is_access(loop.iter, v, None) for v in names)
    ]
    return any(
        _is_access(loop.iter, v, "content") for loop in ast.find_all(n.For) for v in message_vars
    )


# --- SGLang helpers -------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _loops_over_fixed_names(template: str) -> bool:
    import jinja2.nodes as n

    return any(
        _is_access(loop.iter, name, "content")
        for loop in _jinja_ast(template).find_all(n.For)
        for name in ("message", "msg", "m")
    )


# SGLang 0.5.23's ChatCompletionMessageContentPart union, by its `type` literals.
_SGLANG_PART_TYPES = (
    "text",
    "thinking",
    "reasoning",
    "image_url",
    "video_url",
    "audio_url",
    "input_audio",
    "tool_reference",
)


def _sglang_dump_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    for chunk in content if isinstance(content, list) else ():
        kind = chunk.get("type") if isinstance(chunk, dict) else None
        if kind not in _SGLANG_PART_TYPES:
            raise RequestError("Input tag does not match any of the expected tags", "messages")
        if kind == "text" and not isinstance(chunk.get("text"), str):
            raise RequestError("a text part's 'text' must be a string", "messages")
        if kind in ("thinking", "reasoning"):
            if message["role"].lower() != "assistant":
                raise RequestError(
                    "thinking content parts are only valid in assistant messages", "messages"
                )
            payload = [chunk[k] for k in ("thinking", "text") if chunk.get(k) is not None]
            if len(payload) != 1 or not isinstance(payload[0], str):
                raise RequestError(
                    "thinking parts require exactly one of 'thinking' or 'text'", "messages"
                )
    if message["role"] == "user":
        return {"role": "user", "content": content}
    # The generic message model lower-cases its roles; the user model's Literal takes "user"
    # exactly, so "User" fits neither.
    role = message["role"].lower()
    allowed = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
    if role not in allowed:
        raise RequestError(f"'role' must be one of {allowed}", "messages")
    calls = None
    if message.get("tool_calls") is not None:
        calls = []
        for call in message["tool_calls"]:
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = _orjson_loads(arguments)
                except (ValueError, RecursionError):
                    raise RequestError(
                        "function.arguments must be valid JSON", "messages"
                    ) from None
                if not isinstance(arguments, dict):
                    raise RequestError("function.arguments must be a JSON object", "messages")
            elif arguments is not None and not isinstance(arguments, dict):
                raise RequestError("function.arguments: str or dict", "messages")
            calls.append(
                {
                    "id": call.get("id"),
                    "index": call.get("index"),
                    "type": "function",
                    "function": {
                        "name": _optional_str(call["function"].get("name")),
                        "arguments": arguments,
                    },
                }
            )
    tools = message.get("tools")
    phase = message.get("phase")
    if phase not in (None, "commentary", "final_answer"):
        raise RequestError("'phase' must be 'commentary' or 'final_answer'", "messages")
    prefix = message.get("prefix")
    return {
        "role": role,
        "content": message.get("content"),
        "tool_call_id": _optional_str(message.get("tool_call_id")),
        "name": _optional_str(message.get("name")),
        "phase": phase,
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": calls,
        "tools": None if tools is None else [_sglang_dump_tool(t) for t in tools],
        "prefix": None if prefix is None else lax_bool(prefix, "prefix"),
    }


def _optional_str(value: Any) -> str | None:
    # pydantic's str takes no number (SGLang sets no coerce_numbers_to_str).
    if value is not None and not isinstance(value, str):
        raise RequestError("Input should be a valid string", "messages")
    return value


def _orjson_loads(text: str) -> Any:
    """orjson.loads (3.x), which SGLang parses tool-call arguments with: strict JSON (no NaN or
    Infinity, no number overflowing a double, valid UTF-8 strings), integers past the i64/u64
    range read as floats."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise ValueError("str is not valid UTF-8: surrogates not allowed")

    def refuse(word: str) -> Any:
        raise ValueError(f"unexpected character: {word}")

    def settle(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            if -(2**63) <= value <= 2**64 - 1:
                return value
            try:
                return float(value)
            except OverflowError:
                raise ValueError("number is infinity when parsed as double") from None
        if isinstance(value, float):
            if value in (math.inf, -math.inf):
                raise ValueError("number is infinity when parsed as double")
            return value
        if isinstance(value, str):
            value.encode("utf-8")  # a lone surrogate from an escape: UnicodeEncodeError
            return value
        if isinstance(value, list):
            return [settle(v) for v in value]
        if isinstance(value, dict):
            return {settle(k): settle(v) for k, v in value.items()}
        return value

    return settle(json.loads(text, parse_constant=refuse))


def _sglang_content(message: dict[str, Any], parts_format: bool) -> dict[str, Any]:
    content = message["content"]
    if not isinstance(content, list):
        return {k: v for k, v in message.items() if v is not None}
    if parts_format:
        parts = []
        for chunk in content:
            kind = chunk.get("type") if isinstance(chunk, dict) else None
            if kind in ("text", "input_text"):
                parts.append({"type": "text", "text": chunk["text"]})
            elif kind == "tool_reference":  # the part as its model dumps it
                parts.append({"type": "tool_reference", "name": chunk["name"]})
            elif kind in ("image_url", "input_image", "video_url", "audio_url"):
                raise RequestError("this model serves text only", "messages")
        out = {k: v for k, v in message.items() if v is not None and k != "content"}
        out["content"] = parts
    else:
        texts = [
            c["text"]
            for c in content
            if isinstance(c, dict) and c.get("type") in ("text", "input_text")
        ]
        out = {k: v for k, v in {**message, "content": " ".join(texts)}.items() if v is not None}
    parts = out["content"]
    if (
        out["role"] == "tool"
        and isinstance(parts, list)
        and all(isinstance(p, dict) and p.get("type") == "text" for p in parts)
    ):
        out["content"] = " ".join(p.get("text", "") for p in out["content"])
    return out


def _sglang_dump_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """Tool(**tool).model_dump() in SGLang 0.5.23: pydantic's bools, `_propagate_defer_loading`,
    then Function's serializer: null `strict`/`defer_loading` popped, the client's key order
    first (`key_order`), the fields it did not send after."""

    def flag(holder: dict[str, Any], key: str) -> bool | None:
        return None if holder.get(key) is None else lax_bool(holder[key], key)

    function = tool["function"]
    tool_defer = flag(tool, "defer_loading")
    data: dict[str, Any] = {
        "description": function.get("description"),
        "name": function["name"],
        "parameters": function.get("parameters"),
        "strict": flag(function, "strict"),
        "defer_loading": flag(function, "defer_loading"),
    }
    if data["defer_loading"] is None:
        data["defer_loading"] = tool_defer
    for optional in ("defer_loading", "strict"):
        if data[optional] is None:
            data.pop(optional)
    key_order = list(function.keys())
    rest = [k for k in data if k not in key_order]
    dumped_fn = {k: data[k] for k in key_order + rest if k in data}
    return {
        "type": tool.get("type", "function"),
        "function": dumped_fn,
        "defer_loading": tool_defer,
    }
