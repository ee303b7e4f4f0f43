"""Request tokenizers: the bytes one, model directories loaded as the engines load them, errors."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Final

import pytest

from router.tokenize import (
    BytesTokenizer,
    ChatRequestError,
    RequestTokenizer,
    load_tokenizer,
    render_chat_plain,
)
from router.tokenize.chat_rules import (
    Engine,
    TemplateTraits,
    Unrenderable,
    render_call,
    template_tools,
)
from router.tokenize.lax import sglang_token_id
from tests.support.chat_shapes import SHAPES, WEATHER_TOOL
from tests.support.model_dirs import build_fixture_model, build_model_dir, fixture_template

MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "hello world"},
]


def chat(messages: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": messages, **extra}


# --- bytes ----------------------------------------------------------------------------------


def test_the_bytes_tokenizer_matches_the_fake_workers() -> None:
    tok = load_tokenizer("bytes")
    assert tok.name == "bytes"
    # The request path gets the ids as bytes, one a byte (what block_keys reads fastest).
    assert isinstance(tok.encode_prompt("héllo"), bytes)
    assert (
        list(tok.encode_prompt("héllo"))
        == BytesTokenizer().encode("héllo")
        == [b + 3 for b in "héllo".encode()]
    )
    assert list(tok.encode_chat_request(chat(MESSAGES)).ids) == BytesTokenizer().encode(
        render_chat_plain(MESSAGES)
    )


# --- token id prompts -----------------------------------------------------------------------


def test_token_id_prompts_are_used_as_they_are() -> None:
    prompt = [0, 5, 2**32 - 1]
    assert load_tokenizer("bytes").encode_prompt(prompt) is prompt


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ([], "empty"),
        ([1, -1], "within"),
        ([1, 2**32], "within"),
        ([1, 2.5], "integers"),
        ([1, "two"], "integers"),
        ([1, None], "integers"),
        ([1.0, -1.0], "within"),
        ({"ids": [1]}, "string or a list"),
        (None, "string or a list"),
        (7, "string or a list"),
    ],
)
def test_bad_prompts_raise_value_error_with_a_reason(prompt: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        load_tokenizer("bytes").encode_prompt(prompt)


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [
        ([1.0, 2.0], [1, 2]),
        ([1, "2", " 3 ", "4.0", "1_0"], [1, 2, 3, 4, 10]),
        ([True, False, 7], [1, 0, 7]),
    ],
)
def test_token_ids_the_engine_coerces_are_the_ids_it_coerces_them_to(
    prompt: list[Any], ids: list[int]
) -> None:
    # vLLM's and SGLang's OpenAI request models read `prompt` in pydantic's lax mode.
    assert list(load_tokenizer("bytes").encode_prompt(prompt)) == ids


def test_generate_ids_are_read_as_sglang_reads_them_bools_yes_floats_and_text_no() -> None:
    tok = load_tokenizer("bytes")
    assert list(tok.encode_prompt([True, 5], token_id=sglang_token_id)) == [1, 5]
    for prompt in ([1.0, 2.0], [1, "2"]):
        with pytest.raises(ValueError, match="integers"):
            tok.encode_prompt(prompt, token_id=sglang_token_id)


@pytest.mark.parametrize("engine", list(Engine))
def test_chat_flags_are_read_as_the_engines_lax_request_models_read_them(engine: Engine) -> None:
    traits = TemplateTraits(False, False, False, frozenset(_FLAGS))
    final = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    lax = render_call(
        chat(final, add_generation_prompt="off", continue_final_message="Yes"), traits, engine
    )
    strict = render_call(
        chat(final, add_generation_prompt=False, continue_final_message=True), traits, engine
    )
    assert (lax.kwargs, lax.suffix) == (strict.kwargs, strict.suffix)


def test_sglang_ignores_add_generation_prompt_as_its_request_model_has_no_such_field() -> None:
    traits = TemplateTraits(False, False, False, frozenset(_FLAGS))
    call = render_call(chat(MESSAGES, add_generation_prompt="maybe"), traits, Engine.SGLANG)
    assert call.kwargs["add_generation_prompt"] is True


_FLAGS = ("add_generation_prompt", "continue_final_message")

VLLM, SGLANG = Engine.VLLM, Engine.SGLANG
_THINKING = ("reasoning_effort", "enable_thinking", "thinking")
_ON = {"thinking": True, "enable_thinking": True}  # what SGLang derives (vLLM: the second)
_OFF = {"thinking": False, "enable_thinking": False}


@pytest.mark.parametrize(
    ("engine", "fields", "expected"),
    [
        # vLLM 0.22+: entrypoints/openai/chat_completion/protocol.py `build_chat_params` (the
        # request's fields merged over chat_template_kwargs by renderers/params.py
        # `merge_kwargs`), the same in 0.33. 0.20 passed the effort alone.
        (VLLM, {"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
        (
            VLLM,
            {"reasoning_effort": "none"},
            {"reasoning_effort": "none", "enable_thinking": False},
        ),
        (
            VLLM,
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            {"reasoning_effort": "none", "enable_thinking": True},
        ),
        (
            VLLM,
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
            {"reasoning_effort": "low", "enable_thinking": True},
        ),
        (VLLM, {"chat_template_kwargs": {"reasoning_effort": "max"}}, {"reasoning_effort": "max"}),
        (VLLM, {"reasoning": {"effort": "none"}}, {}),  # no such field in vLLM's model
        # SGLang 0.5.23: entrypoints/openai/protocol.py `normalize_reasoning_inputs` and the
        # field's type; serving_chat.py `_convert_to_internal_request`, `_apply_jinja_template`.
        (SGLANG, {"reasoning_effort": "high"}, {"reasoning_effort": "high", **_ON}),
        (SGLANG, {"reasoning_effort": "none"}, {"reasoning_effort": "none", **_OFF}),
        (SGLANG, {"reasoning_effort": " 0.5 "}, {"reasoning_effort": 0.5, **_ON}),
        (SGLANG, {"reasoning_effort": 0}, {"reasoning_effort": 0.0, **_ON}),
        (
            SGLANG,
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
            {"reasoning_effort": "max", **_ON},
        ),
        (
            SGLANG,
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            {"reasoning_effort": "none", "thinking": False, "enable_thinking": True},
        ),
        (
            SGLANG,
            {"reasoning_effort": "none", "reasoning": {"effort": "ultra"}},
            {"reasoning_effort": "ultra", **_ON},
        ),
        (SGLANG, {"reasoning": {"reasoning_effort": "0.25"}}, {"reasoning_effort": 0.25, **_ON}),
        (SGLANG, {"reasoning": {"enabled": "Yes"}}, _ON),
        (SGLANG, {"reasoning": {"enabled": None, "enable": 1}}, _ON),
        (SGLANG, {"reasoning": {"enabled": "no"}}, {}),
        (
            SGLANG,
            {"reasoning_effort": "none", "chat_template_kwargs": ["replaced, not refused"]},
            {"reasoning_effort": "none", **_OFF},
        ),
    ],
)
def test_the_reasoning_effort_reaches_the_template_as_each_engine_passes_it(
    engine: Engine, fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    traits = TemplateTraits(False, False, False, frozenset(_THINKING))
    body = chat(MESSAGES, **fields)
    call = render_call(body, traits, engine)
    assert {k: v for k, v in call.kwargs.items() if k in _THINKING} == expected
    assert body == chat(MESSAGES, **fields)  # the body forwarded is never edited


@pytest.mark.parametrize(
    ("engine", "fields"),
    [
        (VLLM, {"reasoning_effort": "ultra"}),  # SGLang's word, not vLLM's
        (VLLM, {"reasoning_effort": 0.5}),
        (VLLM, {"reasoning_effort": "High"}),
        (VLLM, {"reasoning_effort": True}),
        (SGLANG, {"reasoning_effort": "High"}),
        (SGLANG, {"reasoning_effort": True}),
        (SGLANG, {"reasoning_effort": 1}),  # past 0.99
        (SGLANG, {"reasoning_effort": "nan"}),
        (SGLANG, {"reasoning_effort": {}}),
        (SGLANG, {"reasoning": {"effort": "bogus"}}),
        (SGLANG, {"reasoning": {"effort": False}}),
    ],
)
def test_a_reasoning_effort_the_engine_refuses_is_a_400_naming_it(
    engine: Engine, fields: dict[str, Any]
) -> None:
    tok = load_tokenizer("bytes")
    tok.follow_engine(engine)
    with pytest.raises(ChatRequestError, match="reasoning_effort") as caught:
        tok.encode_chat_request(chat(MESSAGES, **fields))
    assert caught.value.param == "reasoning_effort"


@pytest.mark.parametrize(
    ("engine", "fields"),
    [
        (SGLANG, {"reasoning_effort": 0.5}),
        (SGLANG, {"add_generation_prompt": "maybe"}),  # a field SGLang's model does not have
        (VLLM, {"reasoning_effort": "max"}),
    ],
)
def test_the_bytes_tokenizer_refuses_only_what_its_engine_refuses(
    engine: Engine, fields: dict[str, Any]
) -> None:
    tok = load_tokenizer("bytes")
    tok.follow_engine(engine)
    served = tok.encode_chat_request(chat(MESSAGES, **fields))
    assert served.ids == tok.encode_chat_request(chat(MESSAGES)).ids


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        (chat([]), "messages", "non-empty list"),
        (chat("hello"), "messages", "non-empty list"),
        (chat(["hello"]), "messages", r"messages\[0\] must be an object"),
        (chat([{"content": "hi"}]), "messages", r"messages\[0\].role"),
        (chat([{"role": "user", "content": "hi"}, {"role": 3}]), "messages", r"\[1\].role"),
        (chat([{"role": "user", "content": 5}]), "messages", "string, a list or null"),
        (chat([{"role": "user", "content": [7]}]), "messages", r"content\[0\] must be an obj"),
        (chat([{"role": "assistant", "tool_calls": [{"id": "x"}]}]), "messages", "'function'"),
        (chat(MESSAGES, tools=[{"type": "function"}]), "tools", "function.name"),
        (chat(MESSAGES, tools={"a": 1}), "tools", "must be a list"),
        (chat(MESSAGES, chat_template_kwargs=[1]), "chat_template_kwargs", "an object"),
        (chat(MESSAGES, add_generation_prompt="maybe"), "add_generation_prompt", "boolean"),
        (chat(MESSAGES, add_generation_prompt=None), "add_generation_prompt", "boolean"),
        (chat(MESSAGES, continue_final_message=2), "continue_final_message", "boolean"),
        (
            chat(MESSAGES, continue_final_message=True),
            "continue_final_message",
            "cannot set both",
        ),
    ],
)
def test_a_body_the_engine_refuses_is_a_chat_request_error_naming_the_field(
    body: dict[str, Any], param: str, reason: str
) -> None:
    with pytest.raises(ChatRequestError, match=reason) as caught:
        load_tokenizer("bytes").encode_chat_request(body)
    assert caught.value.param == param


_FUNCTION_CALL = [{"function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize(
    ("body", "refused_by", "param"),
    [
        (chat([{"role": "user", "content": [{"type": "text", "text": 5}]}]), "both", "messages"),
        (
            chat([{"role": "user", "content": [{"type": "input_text", "text": ["a"]}]}]),
            "both",
            "messages",
        ),
        # vLLM skips a text part without text (or with null); SGLang's model requires it.
        (
            chat([{"role": "user", "content": [{"type": "text"}]}], tools=[WEATHER_TOOL]),
            "sglang",
            "messages",
        ),
        (
            chat([{"role": "tool", "content": [{"type": "text", "text": None}]}]),
            "sglang",
            "messages",
        ),
        # A message's own `tools` and a tool_choice object: fields only SGLang's rules read.
        (chat([{"role": "assistant", "content": "x", "tools": "x"}]), "sglang", "messages"),
        (chat([{"role": "assistant", "content": "x", "tools": [3]}]), "sglang", "messages"),
        (
            chat([{"role": "assistant", "tool_calls": _FUNCTION_CALL, "tools": [{}]}]),
            "sglang",
            "messages",
        ),
        (
            chat(MESSAGES, tools=[WEATHER_TOOL], tool_choice={"function": 3}),
            "sglang",
            "tool_choice",
        ),
        # SGLang's models declare these Optional[str], which takes no number; vLLM's passes
        # them on as they are.
        (chat([{"role": "tool", "content": "x", "tool_call_id": 7}]), "sglang", "messages"),
        (chat([{"role": "assistant", "content": "x", "name": 7}]), "sglang", "messages"),
        (
            chat([{"role": "assistant", "tool_calls": [{"function": {"name": 7}}]}]),
            "sglang",
            "messages",
        ),
    ],
)
def test_a_field_of_the_wrong_shape_is_a_chat_request_error_never_a_crash(
    body: dict[str, Any], refused_by: str, param: str
) -> None:
    """Found by a fuzz of 60,000 bodies through both engines' rules: each raised a
    TypeError, KeyError or AttributeError, which left the client of a live replica waiting
    for an answer that never came. The engines' request models refuse each with a 400,
    naming the field."""
    traits = TemplateTraits(False, True, True, frozenset())
    for engine in Engine:
        if refused_by in ("both", engine.value):
            with pytest.raises(ChatRequestError) as refused:
                render_call(body, traits, engine)
            assert refused.value.param == param
        else:
            assert render_call(body, traits, engine).conversation


_BARE = {"name": "f", "description": None, "parameters": None}


VLLM_TOOL_DUMPS: Final = [
    # vLLM 0.27+ (generate/base/protocol.py FunctionDefinition, chat_completion/protocol.py
    # ChatCompletionToolsParam), the same in 0.34: declared fields alone, in their order.
    (
        {"function": {"parameters": {}, "description": "d", "name": "f"}},
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}},
    ),
    (
        {"type": "function", "defer_loading": True, "function": {"name": "f"}},
        {
            "type": "function",
            "function": {**_BARE, "defer_loading": True},
            "defer_loading": True,
        },
    ),
    (
        {"defer_loading": "on", "function": {"name": "f", "defer_loading": False}},
        {
            "type": "function",
            "function": {**_BARE, "defer_loading": False},
            "defer_loading": True,
        },
    ),
    (
        {
            "defer_loading": None,
            "function": {"name": "f", "strict": None, "defer_loading": None},
        },
        {"type": "function", "function": _BARE},
    ),
    (
        {"cache_control": {"type": "ephemeral"}, "function": {"name": "f", "examples": [1]}},
        {"type": "function", "function": _BARE},
    ),
    (
        {"function": {"strict": "yes", "name": "f"}},
        {"type": "function", "function": {**_BARE, "strict": True}},
    ),
]


def sglang_dump(function: dict[str, Any], defer_loading: bool | None = None) -> dict[str, Any]:
    return {"type": "function", "function": function, "defer_loading": defer_loading}


SGLANG_TOOL_DUMPS: Final = [
    # SGLang 0.5.23 (entrypoints/openai/protocol.py Tool, Function): the function's declared
    # fields in the client's order, those it left out after; null flags left out.
    (
        {"function": {"parameters": {}, "description": "d", "name": "f"}},
        sglang_dump({"parameters": {}, "description": "d", "name": "f"}),
    ),
    ({"function": {"name": "f", "strict": None, "examples": [1]}}, sglang_dump(_BARE)),
    (
        {"function": {"strict": "yes", "name": "f"}},
        sglang_dump({"strict": True, "name": "f", "description": None, "parameters": None}),
    ),
    (
        {"defer_loading": "on", "function": {"name": "f"}},
        sglang_dump({**_BARE, "defer_loading": True}, defer_loading=True),
    ),
    (
        {"defer_loading": 1, "function": {"defer_loading": "n", "name": "f"}},
        sglang_dump(
            {"defer_loading": False, "name": "f", "description": None, "parameters": None},
            defer_loading=True,
        ),
    ),
]


@pytest.mark.parametrize(
    ("engine", "tool", "dumped"),
    [(Engine.VLLM, *case) for case in VLLM_TOOL_DUMPS]
    + [(Engine.SGLANG, *case) for case in SGLANG_TOOL_DUMPS],
)
def test_each_engine_dumps_a_tool_as_its_request_models_do(
    engine: Engine, tool: dict[str, Any], dumped: dict[str, Any]
) -> None:
    traits = TemplateTraits(False, False, False, frozenset())
    call = render_call(chat(MESSAGES, tools=[tool]), traits, engine)
    assert json.dumps(call.tools) == json.dumps([dumped])  # in the order a template dumps


@pytest.mark.parametrize("engine", list(Engine))
@pytest.mark.parametrize(
    "tool",
    [
        {"function": {"name": "f", "strict": "maybe"}},
        {"function": {"name": "f", "defer_loading": []}},
        {"function": {"name": "f"}, "defer_loading": 2},
    ],
)
def test_a_tool_flag_the_engine_cannot_read_as_a_boolean_is_a_400_naming_tools(
    tool: dict[str, Any], engine: Engine
) -> None:
    traits = TemplateTraits(False, False, False, frozenset())
    with pytest.raises(ChatRequestError) as refused:
        render_call(chat(MESSAGES, tools=[tool]), traits, engine)
    assert refused.value.param == "tools"


def test_vllm_keeps_a_thinking_input_or_output_text_part_without_text_as_a_null_text() -> None:
    content = [
        {"type": "text", "text": "a"},
        {"type": "thinking"},
        {"type": "input_text", "text": None},
        {"type": "output_text", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": None},
        {"type": "refusal"},
    ]
    body = chat([{"role": "user", "content": content}])
    as_parts = render_call(body, TemplateTraits(False, True, True, frozenset()), Engine.VLLM)
    null: dict[str, Any] = {"type": "text", "text": None}
    assert as_parts.conversation[0]["content"] == [
        {"type": "text", "text": "a"},
        null,
        null,
        {**null, "cache_control": {"type": "ephemeral"}},
    ]
    as_string = render_call(body, TemplateTraits(False, False, False, frozenset()), Engine.VLLM)
    assert as_string.conversation[0]["content"] == "a"


@pytest.mark.parametrize("as_parts", [True, False])
@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_text", "text": "in Paris?"},
        {"type": "output_text", "text": "in Paris?"},
        {"type": "refusal", "refusal": "no"},
        "in Paris?",
    ],
)
def test_a_content_part_sglang_refuses_is_routed_as_a_miss_where_vllm_renders_it(
    part: Any, as_parts: bool
) -> None:
    """SGLang's request model takes text, thinking, media and tool_reference parts alone; any
    other is its 400. Like a role SGLang refuses, the router routes such a chat as a miss."""
    traits = TemplateTraits(False, as_parts, as_parts, frozenset())
    body = chat([{"role": "user", "content": [{"type": "text", "text": "Weather"}, part]}])
    with pytest.raises(Unrenderable) as caught:
        render_call(body, traits, Engine.SGLANG)
    assert caught.value.reason == "content"
    assert render_call(body, traits, Engine.VLLM).conversation


@pytest.mark.parametrize(
    ("role", "part"),
    [
        ("user", {"type": "thinking", "thinking": "short"}),
        ("system", {"type": "reasoning", "text": "short"}),
        ("tool", {"type": "thinking", "thinking": "short"}),
        ("assistant", {"type": "thinking"}),
        ("assistant", {"type": "thinking", "thinking": "short", "text": "short"}),
        ("assistant", {"type": "reasoning", "thinking": 3}),
    ],
)
def test_sglang_routes_a_thinking_part_its_request_model_refuses_as_a_miss(
    role: str, part: dict[str, Any]
) -> None:
    """SGLang takes a thinking part in an assistant message alone, with exactly one of a
    string thinking or text; the router dropped every one and rendered what SGLang answers
    400 for."""
    traits = TemplateTraits(False, False, False, frozenset())
    body = chat([{"role": role, "content": [part, {"type": "text", "text": "Weather"}]}])
    with pytest.raises(Unrenderable) as caught:
        render_call(body, traits, Engine.SGLANG)
    assert caught.value.reason == "content"


@pytest.mark.parametrize("as_parts", [True, False])
def test_sglang_leaves_an_assistants_thinking_part_out_of_what_the_template_sees(
    as_parts: bool,
) -> None:
    traits = TemplateTraits(False, as_parts, as_parts, frozenset())
    body = chat(
        [
            MESSAGES[1],
            {
                "role": "Assistant",
                "content": [
                    {"type": "reasoning", "text": "sun"},
                    {"type": "text", "text": "Sunny."},
                ],
            },
            MESSAGES[1],
        ]
    )
    content = render_call(body, traits, Engine.SGLANG).conversation[1]["content"]
    assert content == ([{"type": "text", "text": "Sunny."}] if as_parts else "Sunny.")


def test_sglang_gives_the_template_a_non_user_messages_phase_and_prefix() -> None:
    traits = TemplateTraits(False, False, False, frozenset())
    body = chat(
        [
            {**MESSAGES[0], "phase": "commentary", "prefix": "on"},
            {**MESSAGES[1], "phase": "commentary", "prefix": True},
        ]
    )
    system, user = render_call(body, traits, Engine.SGLANG).conversation
    assert (system["phase"], system["prefix"]) == ("commentary", True)
    assert "phase" not in user and "prefix" not in user
    assert "phase" not in render_call(body, traits, Engine.VLLM).conversation[0]


@pytest.mark.parametrize(("key", "value"), [("phase", "analysis"), ("prefix", "maybe")])
def test_sglang_refuses_a_phase_or_prefix_its_request_model_cannot_read(
    key: str, value: str
) -> None:
    traits = TemplateTraits(False, False, False, frozenset())
    with pytest.raises(ChatRequestError):
        render_call(chat([{**MESSAGES[0], key: value}, MESSAGES[1]]), traits, Engine.SGLANG)


def sglang_call_arguments(arguments: Any) -> Any:
    """The arguments of a history tool call as SGLang's rules hand them to the template."""
    traits = TemplateTraits(False, False, False, frozenset())
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = chat([{"role": "assistant", "content": None, "tool_calls": [call]}, MESSAGES[1]])
    conversation = render_call(body, traits, Engine.SGLANG).conversation
    return conversation[0]["tool_calls"][0]["function"]["arguments"]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"days": NaN}',
        '{"days": -Infinity}',
        '{"days": 1e400}',
        '{"city": "Paris\\udc00"}',
        '{"\\ud800": 1}',
        '{"city": "Paris\ud800"}',
        ["Paris"],
        3,
        True,
    ],
)
def test_sglang_routes_tool_call_arguments_orjson_or_its_model_refuses_as_a_miss(
    arguments: Any,
) -> None:
    """SGLang parses a history call's arguments with orjson, which refuses what json.loads
    reads (NaN, Infinity, overflowing numbers, lone surrogates), and its request model takes
    a string, an object or null alone: each is its 400, which the router rendered."""
    with pytest.raises(Unrenderable) as caught:
        sglang_call_arguments(arguments)
    assert caught.value.reason == "tool_arguments"


def test_sglang_reads_an_integer_past_64_bits_in_tool_call_arguments_as_a_float() -> None:
    parsed = sglang_call_arguments(
        '{"big": 123456789012345678901, "u64": 18446744073709551615, '
        '"low": -9223372036854775809, "pair": "\\ud83d\\ude00", "null": null}'
    )
    assert parsed == {
        "big": 1.2345678901234568e20,
        "u64": 18446744073709551615,
        "low": -9.223372036854776e18,
        "pair": "\U0001f600",
        "null": None,
    }
    assert type(parsed["big"]) is float and type(parsed["u64"]) is int
    assert sglang_call_arguments(None) is None
    assert sglang_call_arguments({"days": 2}) == {"days": 2}


def test_sglang_renders_a_root_message_under_its_own_role() -> None:
    traits = TemplateTraits(False, False, False, frozenset())
    body = chat([{"role": "Root", "content": "You are terse."}, MESSAGES[1]])
    call = render_call(body, traits, Engine.SGLANG)
    assert call.conversation[0] == {"role": "root", "content": "You are terse."}


def test_sglang_routes_a_capitalised_user_role_as_a_miss_and_takes_other_roles_in_any_case() -> (
    None
):
    """SGLang's user model takes `user` exactly and its generic model lower-cases the others:
    a `User` fits neither and is its 400, which the router rendered as a user turn."""
    traits = TemplateTraits(False, False, False, frozenset())
    with pytest.raises(Unrenderable) as caught:
        render_call(chat([{"role": "User", "content": "hi"}]), traits, Engine.SGLANG)
    assert caught.value.reason == "role"
    body = chat([{"role": "SYSTEM", "content": "You are terse."}, MESSAGES[1]])
    assert render_call(body, traits, Engine.SGLANG).conversation[0]["role"] == "system"
    user = chat([{"role": "User", "content": "hi"}])
    assert render_call(user, traits, Engine.VLLM).conversation[0]["role"] == "User"


def test_a_tool_choice_of_the_wrong_shape_is_refused_where_sglang_picks_a_template() -> None:
    body = chat(MESSAGES, tools=[WEATHER_TOOL], tool_choice={"function": 3})
    with pytest.raises(ChatRequestError):
        template_tools(body, Engine.SGLANG)
    assert template_tools(body, Engine.VLLM) == [WEATHER_TOOL]  # vLLM hands over the tools


# --- model directories ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fixture_model(tmp_path_factory.mktemp("qwen"), "qwen3.jinja")


def test_a_tokenizer_json_path_means_its_model_directory(qwen: Path) -> None:
    by_dir = load_tokenizer(str(qwen))
    by_file = load_tokenizer(str(qwen / "tokenizer.json"))
    assert by_file.name == by_dir.name == f"hf:{qwen}"
    body = SHAPES["tools"]
    assert (
        list(by_file.encode_chat_request(body).ids)
        == list(by_dir.encode_chat_request(body).ids)
        != []
    )


def test_chat_template_jinja_is_used_over_the_config_template(tmp_path: Path) -> None:
    directory = build_model_dir(tmp_path, "qwen", fixture_template("qwen3.jinja"))
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = load_tokenizer(str(directory))
    assert list(tok.encode_chat_request(chat(MESSAGES)).ids) == tok.encode_prompt(
        MESSAGES[0]["content"]
    )


def test_named_templates_give_tool_use_to_requests_with_tools(tmp_path: Path) -> None:
    directory = build_model_dir(tmp_path, "qwen", None)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain chat"},
        {"name": "tool_use", "template": "chat with tools"},
    ]
    config_path.write_text(json.dumps(config))
    tok = load_tokenizer(str(directory))
    assert list(tok.encode_chat_request(chat(MESSAGES)).ids) == tok.encode_prompt("plain chat")
    with_tools = tok.encode_chat_request(chat(MESSAGES, tools=[WEATHER_TOOL]))
    assert list(with_tools.ids) == tok.encode_prompt("chat with tools")


def test_sglang_picks_the_named_template_by_the_tools_left_after_tool_choice(
    tmp_path: Path,
) -> None:
    # SGLang drops the tools for tool_choice "none" before transformers picks the template;
    # vLLM hands them over whatever the choice (the Hermes 3 pair of templates showed it).
    directory = build_model_dir(tmp_path, "qwen", None)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain chat"},
        {"name": "tool_use", "template": "{{ 'chat with tools' if tools else 'no tools' }}"},
    ]
    config_path.write_text(json.dumps(config))
    body = chat(MESSAGES, tools=[WEATHER_TOOL], tool_choice="none")
    sglang = load_tokenizer(str(directory), engine="sglang")
    assert list(sglang.encode_chat_request(body).ids) == sglang.encode_prompt("plain chat")
    vllm = load_tokenizer(str(directory), engine="vllm")
    assert list(vllm.encode_chat_request(body).ids) == vllm.encode_prompt("chat with tools")
    named = chat(MESSAGES, tools=[WEATHER_TOOL], tool_choice={"function": {"name": "nope"}})
    assert list(sglang.encode_chat_request(named).ids) == sglang.encode_prompt("no tools")


def failures_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot render" in r.getMessage()]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "content",
        ),
        (chat(MESSAGES, chat_template="{{ 'mine' }}"), "request_template"),
        (chat(MESSAGES, chat_template_kwargs={"tokenize": True}), "render"),
    ],
)
def test_what_the_router_cannot_render_is_routed_as_a_miss_and_logged_once(
    qwen: Path, caplog: pytest.LogCaptureFixture, body: dict[str, Any], reason: str
) -> None:
    tok = load_tokenizer(str(qwen))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert tok.encode_chat_request(body) == tok.encode_chat_request(body)
            assert tok.encode_chat_request(body).failure == reason
            assert tok.encode_chat_request(body).ids == []
    logged = failures_logged(caplog)
    assert len(logged) == 1 and reason in logged[0]


def test_a_template_that_raises_is_a_render_failure_and_cannot_touch_the_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = build_model_dir(tmp_path, "qwen", "{{ messages.append(1) }}")
    tok = load_tokenizer(str(directory))
    body = chat([{"role": "user", "content": "hi"}])
    assert tok.encode_chat_request(body).failure == "render"
    assert body == chat([{"role": "user", "content": "hi"}])


# Templates probing the sandbox: attribute access on message dicts (present, absent, a dict
# method's name, an item shadowing a method), methods of str and list, str.format, namespaces.
SANDBOX_PROBES = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.missing is defined }}{% endfor %}",
    "{{ messages[0].items() | list | length }} {{ messages[0].keys is defined }}",
    "{{ messages[0].content.upper().split('A') | join('-') }} {{ '{}!'.format('x') }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }} {{ (messages | map(attribute='role') | list)[-1] }}",
    "{{ {'items': 'shadowed'}.items is defined }} {{ messages[0].get('role') }}",
    # withheld (rendered as nothing), not refused
    "[{{ messages[0].content.__class__ }}][{{ ''.format.__globals__ }}][{{ messages[0]._x }}]",
)
SANDBOX_REFUSALS = (
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages[0].__class__.__mro__ }}",
    "{{ messages[0].content.__class__.__name__ }}",
)


@pytest.mark.parametrize("template", SANDBOX_PROBES + SANDBOX_REFUSALS)
def test_the_memoized_sandbox_renders_and_refuses_exactly_as_transformers_sandbox(
    tmp_path: Path, template: str
) -> None:
    # The router renders with a copy of transformers' environment whose safety checks are
    # memoized (router/tokenize/hf.py); rendered twice, so the second pass runs on the memo.
    from transformers import AutoTokenizer

    directory = build_model_dir(tmp_path, "qwen", template)
    reference = AutoTokenizer.from_pretrained(str(directory))
    tok = load_tokenizer(str(directory))
    messages = [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": "a hat"}]
    try:
        expected = reference.encode(
            reference.apply_chat_template(messages, tokenize=False), add_special_tokens=False
        )
    except Exception:
        expected = None
    for _ in range(2):
        got = tok.encode_chat_request(chat(messages))
        assert (got.failure, list(got.ids)) == (
            ("render", []) if expected is None else (None, expected)
        )
    assert (expected is None) == (template in SANDBOX_REFUSALS)


def test_a_model_without_a_chat_template_routes_chats_as_misses(tmp_path: Path) -> None:
    tok = load_tokenizer(str(build_model_dir(tmp_path, "qwen", None)))
    assert tok.encode_chat_request(chat(MESSAGES)).failure == "no_template"
    assert tok.encode_prompt("hello")  # completions still tokenize


def test_the_segment_cache_is_exposed_for_metrics_and_can_be_turned_off(qwen: Path) -> None:
    cached = load_tokenizer(str(qwen))
    cached.encode_chat_request(SHAPES["multi_turn"])
    cached.encode_chat_request(SHAPES["multi_turn"])
    cache = cached.segment_cache
    assert cache is not None and cache.hits > 0 and cache.bytes > 0
    off = load_tokenizer(str(qwen), cache_mb=0)
    assert off.segment_cache is None
    assert off.encode_chat_request(SHAPES["multi_turn"]).ids == list(
        cached.encode_chat_request(SHAPES["multi_turn"]).ids
    )
    assert load_tokenizer("bytes").segment_cache is None


# --- loading errors -------------------------------------------------------------------------


def test_loading_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such model directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(broken))
    with pytest.raises(ValueError, match="engine must be one of"):
        load_tokenizer("bytes", engine="tgi")
    with pytest.raises(ValueError, match=">= 0"):
        load_tokenizer("bytes", cache_mb=-1)


def test_a_missing_hf_extra_says_how_to_install_it(
    qwen: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "transformers", None)  # type: ignore[arg-type]
    with pytest.raises(ImportError, match=r"pip install 'kvrouter\[hf\]'"):
        load_tokenizer(str(qwen))


def test_repr_names_the_tokenizer() -> None:
    assert repr(load_tokenizer("bytes")) == "RequestTokenizer('bytes')"
    assert isinstance(load_tokenizer("bytes"), RequestTokenizer)


def test_a_prompt_past_the_encoding_bound_is_routed_by_its_first_blocks(qwen: Path) -> None:
    """Text past `MAX_ENCODED_CHARS` is not encoded (it held the loop for seconds): the ids
    are the full encoding's first ones, up to a margin before the cut; a shorter prompt's
    ids are all of them."""
    from router.tokenize.hf import CUT_MARGIN_TOKENS, MAX_ENCODED_CHARS

    tok = load_tokenizer(str(qwen))
    model = tok.model
    words = " ".join(f"word{i % 977} and {i}" for i in range(MAX_ENCODED_CHARS // 8))
    assert len(words) > MAX_ENCODED_CHARS + 1000
    full = model._encode(words, True)  # the whole text, as the engine encodes it
    ids = tok.encode_prompt(words)
    assert list(ids) == full[: len(ids)]
    cut = model._encode(words[:MAX_ENCODED_CHARS], True)
    assert len(ids) == len(cut) - CUT_MARGIN_TOKENS
    short = words[:1000]
    assert list(tok.encode_prompt(short)) == model._encode(short, True)
    chat_ids = tok.encode_chat_request(chat([{"role": "user", "content": words}])).ids
    assert 0 < len(chat_ids) <= len(cut)


def nested_parameters(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


@pytest.mark.parametrize("engine", list(Engine))
def test_tools_nested_past_the_bound_are_not_rendered_on_the_loop(engine: Engine) -> None:
    """Templates dump tools with `tojson(indent=...)`, quadratic in their depth: a 20 KB
    body nested 480 levels rendered for a second. Past `MAX_TOOL_NESTING` the chat is
    routed by load, as the engine's rendering cannot be followed in time."""
    from router.tokenize.chat_rules import MAX_TOOL_NESTING, Unrenderable

    traits = TemplateTraits(False, True, True, frozenset())
    deep = chat(MESSAGES, tools=[nested_parameters(MAX_TOOL_NESTING)])
    with pytest.raises(Unrenderable) as caught:
        render_call(deep, traits, engine)
    assert caught.value.reason == "deep_tools"
    usual = chat(MESSAGES, tools=[nested_parameters(10)])
    assert render_call(usual, traits, engine).conversation


def deep_value(levels: int) -> Any:
    """A JSON object nested `levels` deep: an object of lists around an object."""
    value: Any = {"leaf": 1}
    for _ in range(levels - 2):
        value = [value]
    return {"x": value}


@pytest.mark.parametrize("engine", list(Engine))
def test_json_a_template_dumps_is_held_to_the_nesting_bound_wherever_it_comes_from(
    engine: Engine,
) -> None:
    """Not only the request's `tools`: the tools `chat_template_kwargs` brings (which win over
    the request's), its other values, a developer message's tools and an assistant's tool-call
    arguments (a dict, or a JSON string the rules parse) all reach the template's `tojson`. A
    2.5 MB chat whose tools came through the kwargs, 300 levels deep, held the loop 7.6 s."""
    from router.tokenize.chat_rules import MAX_TOOL_NESTING, Unrenderable

    traits = TemplateTraits(True, False, False, frozenset({"tools", "extra"}))
    deep = deep_value(MAX_TOOL_NESTING)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    as_text = {**call, "function": {"name": "f", "arguments": json.dumps(deep)}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "done"}
    bodies = {
        "kwargs tools": chat(MESSAGES, chat_template_kwargs={"tools": [nested_parameters(64)]}),
        "kwargs value": chat(MESSAGES, chat_template_kwargs={"extra": deep}),
        "developer tools": chat(
            [{"role": "developer", "content": "x", "tools": [nested_parameters(64)]}, *MESSAGES]
        ),
        # A tool result after the call: SGLang makes a last assistant message a user turn.
        "call arguments": chat([*MESSAGES, {"role": "assistant", "tool_calls": [call]}, result]),
        "call arguments as text": chat(
            [*MESSAGES, {"role": "assistant", "tool_calls": [as_text]}, result]
        ),
    }
    if engine is Engine.SGLANG:  # SGLang passes no `tools` kwarg over the request's own
        del bodies["kwargs tools"]
    for name, body in bodies.items():
        with pytest.raises(Unrenderable) as caught:
            render_call(body, traits, engine)
        assert caught.value.reason == "deep_tools", name
    shallow = deep_value(MAX_TOOL_NESTING - 8)
    fine = chat(
        [
            *MESSAGES,
            {
                "role": "assistant",
                "tool_calls": [{**call, "function": {"name": "f", "arguments": shallow}}],
            },
        ],
        chat_template_kwargs={"extra": shallow},
    )
    assert render_call(fine, traits, engine).conversation


@pytest.mark.parametrize("engine", list(Engine))
def test_chats_past_the_message_or_tool_count_are_routed_by_load_unwalked(engine: Engine) -> None:
    """A million empty messages held the loop 3.6 s in the rules and the render; past the
    bounds the chat is Unrenderable (`too_large`) before anything walks it, so even a
    malformed message past the bound costs nothing (the engine validates what it is sent)."""
    from router.tokenize.chat_rules import MAX_CHAT_MESSAGES, MAX_CHAT_TOOLS, Unrenderable

    traits = TemplateTraits(False, False, False, frozenset())
    user = {"role": "user", "content": "hi"}
    at_bound = chat([user] * MAX_CHAT_MESSAGES, tools=[WEATHER_TOOL] * MAX_CHAT_TOOLS)
    assert len(render_call(at_bound, traits, engine).conversation) == MAX_CHAT_MESSAGES
    for body in (
        chat([user] * MAX_CHAT_MESSAGES + ["not a message"]),
        chat(MESSAGES, tools=[WEATHER_TOOL] * (MAX_CHAT_TOOLS + 1)),
    ):
        with pytest.raises(Unrenderable) as caught:
            render_call(body, traits, engine)
        assert caught.value.reason == "too_large"


@pytest.mark.parametrize("engine", list(Engine))
def test_chats_past_the_part_count_or_the_json_to_dump_are_routed_by_load_unwalked(
    engine: Engine,
) -> None:
    """A million empty content parts in one message held the loop 2.7 s, one tool of 500,000
    properties 2.4 s: past `MAX_CHAT_PARTS` content parts and tool calls (all messages
    together) or `MAX_DUMPED_VALUES` values for the template to dump, the chat is `too_large`;
    at the bounds it renders."""
    from router.tokenize.chat_rules import MAX_CHAT_PARTS, MAX_DUMPED_VALUES, Unrenderable

    traits = TemplateTraits(False, True, True, frozenset())
    part = {"type": "text", "text": "a"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def tool(properties: int) -> dict[str, Any]:
        schema = {"type": "object", "properties": {f"p{i}": {} for i in range(properties)}}
        return {"type": "function", "function": {"name": "f", "parameters": schema}}

    half = MAX_CHAT_PARTS // 2
    at_bounds = [
        chat([{"role": "user", "content": [part] * MAX_CHAT_PARTS}]),
        chat(MESSAGES, tools=[tool(MAX_DUMPED_VALUES - 100)]),
    ]
    for body in at_bounds:
        assert render_call(body, traits, engine).conversation
    past = [
        chat([{"role": "user", "content": [part] * (MAX_CHAT_PARTS + 1)}]),
        chat(
            [
                {"role": "user", "content": [part] * half},
                {"role": "assistant", "tool_calls": [call] * (half + 1)},
                *MESSAGES,
            ]
        ),
        # Past the bound, even malformed parts are not walked: the engine validates them.
        chat([{"role": "user", "content": [None] * (MAX_CHAT_PARTS + 1)}]),
        chat(MESSAGES, tools=[tool(MAX_DUMPED_VALUES + 1)]),
    ]
    for body in past:
        with pytest.raises(Unrenderable) as caught:
            render_call(body, traits, engine)
        assert caught.value.reason == "too_large"


def test_the_bytes_tokenizer_keeps_to_the_bounds_on_what_the_loop_walks() -> None:
    """The plain format renders any chat, and used to render one of a million messages (the
    rules' `too_large` was let by with what it cannot render) and key every byte of a 30 MiB
    prompt (0.9 s): past the counts a chat is `too_large`; a text is keyed by its first
    `MAX_ENCODED_CHARS`, which are exactly the engine's first ids (one a byte)."""
    from router.tokenize.chat_rules import MAX_CHAT_MESSAGES, MAX_CHAT_PARTS
    from router.tokenize.params import MAX_ENCODED_CHARS, TokenizeParams

    tok = load_tokenizer("bytes")
    user = {"role": "user", "content": "hi"}
    for body in (
        chat([user] * (MAX_CHAT_MESSAGES + 1)),
        chat([{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CHAT_PARTS + 1)}]),
    ):
        assert tok.encode_chat_request(body).failure == "too_large"
    text = "héllo " * (MAX_ENCODED_CHARS // 4)
    assert bytes(tok.encode_prompt(text)) == BytesTokenizer().encode_bytes(text[:MAX_ENCODED_CHARS])
    long_chat = chat([{"role": "user", "content": text}])
    rendered = render_chat_plain(long_chat["messages"])
    ids = tok.encode_chat_request(long_chat).ids
    assert bytes(ids) == BytesTokenizer().encode_bytes(rendered[:MAX_ENCODED_CHARS])
    # A cut that keeps the first ids is known; one that keeps the last is not: a miss.
    first = TokenizeParams(add_special_tokens=True, keep=100, side="right")
    assert bytes(tok.encode_prompt(text, first)) == BytesTokenizer().encode_bytes(text)[:100]
    last = TokenizeParams(add_special_tokens=True, keep=100, side="left")
    assert len(tok.encode_prompt(text, last)) == 0
    assert len(tok.encode_prompt(text[:1000], last)) == 100


# --- token ids a chat brings for the engine to take as they are ----------------------------

IDS = [5, 6, 7, 8]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
WITH_IMAGE = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}]


def reused(ids: Any) -> dict[str, Any]:
    """vLLM's field for a disaggregated decode reusing its prefill's ids."""
    return {"kv_transfer_params": {"do_remote_prefill": True, "prompt_token_ids": ids}}


@pytest.mark.parametrize(
    ("engine", "body", "ids"),
    [
        # SGLang 0.5.23: ChatCompletionRequest.input_ids (a lax List[int]); serving_chat.py
        # _process_messages renders nothing for them, media parts included.
        (SGLANG, chat(MESSAGES, input_ids=IDS), IDS),
        (SGLANG, chat(MESSAGES, input_ids=[5, "6", 7.0, True]), [5, 6, 7, 1]),
        (SGLANG, chat(WITH_IMAGE, input_ids=IDS), IDS),
        (SGLANG, chat(MESSAGES, **reused(IDS)), None),  # no such field in SGLang's model
        # vLLM 0.32+: renderers/online_renderer.py _reused_prompt_token_ids, unless echo or
        # a part that is not text; its chat model has no input_ids.
        (VLLM, chat(MESSAGES, **reused(IDS)), IDS),
        (VLLM, chat(MESSAGES, echo="true", **reused(IDS)), None),
        (VLLM, chat(MESSAGES, **reused(None)), None),
        (VLLM, chat(MESSAGES, input_ids=IDS), None),
    ],
)
def test_a_chat_bringing_token_ids_is_keyed_by_them_where_the_engine_takes_them(
    qwen: Path, engine: Engine, body: dict[str, Any], ids: list[int] | None
) -> None:
    tok = load_tokenizer(str(qwen), engine=engine.value)
    rendered = tok.encode_chat_request(chat(MESSAGES))
    got = tok.encode_chat_request(body)
    assert got.failure is None
    assert list(got.ids) == (list(rendered.ids) if ids is None else ids)


def test_a_vllm_chat_with_media_is_rendered_whatever_ids_it_brings(qwen: Path) -> None:
    tok = load_tokenizer(str(qwen), engine="vllm")
    assert tok.encode_chat_request(chat(WITH_IMAGE, **reused(IDS))).failure == "content"


@pytest.mark.parametrize(
    ("engine", "body", "param"),
    [
        (SGLANG, chat(MESSAGES, input_ids="5 6 7"), "input_ids"),
        (SGLANG, chat(MESSAGES, input_ids=[]), "input_ids"),
        (SGLANG, chat(MESSAGES, input_ids=[5, 6.5]), "input_ids"),
        (SGLANG, chat(MESSAGES, input_ids=[5, -1]), "input_ids"),
        (SGLANG, chat([{"content": "no role"}], input_ids=IDS), "messages"),
        (VLLM, chat(MESSAGES, **reused([5, "6"])), "kv_transfer_params.prompt_token_ids"),
        (VLLM, chat(MESSAGES, **reused([5, True])), "kv_transfer_params.prompt_token_ids"),
        (VLLM, chat(MESSAGES, **reused([])), "kv_transfer_params.prompt_token_ids"),
        (VLLM, chat(MESSAGES, **reused(7)), "kv_transfer_params.prompt_token_ids"),
        (VLLM, chat(MESSAGES, echo="maybe", **reused(IDS)), "echo"),
    ],
)
def test_token_ids_a_chat_brings_that_the_engine_refuses_are_a_400_naming_them(
    engine: Engine, body: dict[str, Any], param: str
) -> None:
    tok = load_tokenizer("bytes")
    tok.follow_engine(engine)
    with pytest.raises(ChatRequestError) as caught:
        tok.encode_chat_request(body)
    assert caught.value.param == param
