"""The router's chat token ids equal the engine's, for every request shape and fixture template.

The engine is the fake worker's model path (`fake_kv_worker/model_chat.py`): transformers'
AutoTokenizer and apply_chat_template driven the way vLLM's and SGLang's OpenAI servers drive
them, written independently of the router. The models are small tokenizers of each family built
in tests/support/model_dirs.py and saved as the hub ships them. For each (template, shape,
engine): when the engine serves the request, the router computes exactly its ids and does not
fail; when the engine refuses it, the router still routes it (no exception).

A few tests pin the engine mirror itself to what the engines are known to do (the issue's table),
so a bug shared by both sides cannot pass as agreement.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")

from tokenizers import Tokenizer

from fake_kv_worker.model_chat import ModelChat, vllm_cut
from fake_kv_worker.protocol import RequestError
from router.tokenize import ChatRequestError, RequestTokenizer, load_tokenizer
from router.tokenize.chat_rules import Engine
from router.tokenize.params import chat_params, completion_params
from tests.support.chat_shapes import SHAPES
from tests.support.model_dirs import (
    FIXTURE_TEMPLATES,
    HOLDOUT_TEMPLATES,
    build_fixture_model,
    build_holdout_model,
    build_model_dir,
    build_multimodal_model_dir,
    holdout_dir,
)

ENGINE_NAMES = ("vllm", "sglang")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_fixture_model(root / name, name) for name in FIXTURE_TEMPLATES}


@pytest.fixture(scope="module")
def pairs(models: dict[str, Path]) -> dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]]:
    return {
        (name, engine): (load_tokenizer(str(path), engine=engine), ModelChat(str(path), engine))
        for name, path in models.items()
        for engine in ENGINE_NAMES
    }


def engine_ids(engine: ModelChat, body: dict[str, Any]) -> list[int] | None:
    try:
        return engine.chat_ids(copy.deepcopy(body))
    except RequestError:
        return None


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("template", sorted(FIXTURE_TEMPLATES))
def test_router_ids_equal_the_engines_for_every_shape_the_engine_serves(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
    template: str,
    shape: str,
    engine: str,
) -> None:
    router, worker = pairs[(template, engine)]
    assert_router_matches_engine(router, worker, SHAPES[shape])


def assert_router_matches_engine(
    router: RequestTokenizer, worker: ModelChat, body: dict[str, Any]
) -> None:
    untouched = copy.deepcopy(body)
    expected = engine_ids(worker, body)
    try:
        got = router.encode_chat_request(body, chat_params(body, router.engine))
    except ChatRequestError as refused:
        assert expected is None, f"the router refused ({refused}) what the engine serves"
        return  # both answer 400
    assert body == untouched  # the router never edits the body it forwards
    if expected is None:
        # The engine answers 400; the router still routed it (no exception), as a miss.
        assert got.failure is not None, "the router rendered what the engine refuses"
        return
    assert got.failure is None, f"the router failed ({got.failure}) where the engine serves"
    assert list(got.ids) == expected


def test_most_comparisons_are_served_by_the_engine(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    # Guards the test above against passing vacuously because the engine refused everything.
    served = sum(
        engine_ids(worker, body) is not None
        for (_, _), (_, worker) in pairs.items()
        for body in SHAPES.values()
    )
    assert served >= 0.7 * len(pairs) * len(SHAPES)


# --- hold-out templates: real ones the router was not written against ----------------------

HOLDOUT_DIR = holdout_dir()
needs_holdouts = pytest.mark.skipif(
    HOLDOUT_DIR is None,
    reason="the hold-out templates are not here: set KVROUTER_HOLDOUT_TEMPLATES to their "
    "directory (see tests/support/model_dirs.py HOLDOUT_TEMPLATES)",
)


@pytest.fixture(scope="module")
def holdout_pairs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]]:
    assert HOLDOUT_DIR is not None
    root = tmp_path_factory.mktemp("holdouts")
    out = {}
    for i, name in enumerate(HOLDOUT_TEMPLATES):
        path = build_holdout_model(root / str(i), name, HOLDOUT_DIR)
        for engine in ENGINE_NAMES:
            out[(name, engine)] = (
                load_tokenizer(str(path), engine=engine),
                ModelChat(str(path), engine),
            )
    return out


@needs_holdouts
@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("template", sorted(HOLDOUT_TEMPLATES))
def test_router_ids_equal_the_engines_on_hold_out_templates(
    holdout_pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
    template: str,
    shape: str,
    engine: str,
) -> None:
    router, worker = holdout_pairs[(template, engine)]
    assert_router_matches_engine(router, worker, SHAPES[shape])


@needs_holdouts
def test_most_hold_out_comparisons_are_served_by_the_engine(
    holdout_pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    served = sum(
        engine_ids(worker, body) is not None
        for (_, _), (_, worker) in holdout_pairs.items()
        for body in SHAPES.values()
    )
    assert served >= 0.6 * len(holdout_pairs) * len(SHAPES)


# --- the engine mirror holds what the engines are known to do -----------------------------


def rendered(worker: ModelChat, body: dict[str, Any]) -> str:
    return worker.tokenizer.decode(worker.chat_ids(copy.deepcopy(body)))


def test_tools_reach_the_template_as_the_request_model_dumps_them(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("qwen3.jinja", "vllm")]
    _, sglang = pairs[("qwen3.jinja", "sglang")]
    body = SHAPES["tools"]
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Get' in (
        rendered(vllm, body)
    )
    # SGLang 0.5.23 keeps the client's order and leaves an unset strict out.
    as_sglang = rendered(sglang, body)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Get' in (
        as_sglang
    )
    assert '"name": "search", "parameters": {"type": "object", "properties": {}}, "desc' in (
        as_sglang
    )
    assert "strict" not in as_sglang


def test_both_engines_read_a_tools_flags_as_booleans(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    for engine in ENGINE_NAMES:
        _, worker = pairs[("qwen3.jinja", engine)]
        text = rendered(worker, SHAPES["tools_with_lax_flags"])
        assert '"strict": true' in text and '"defer_loading": true' in text
        assert '"defer_loading": false' in text
        assert '"true"' not in text and '"off"' not in text


def test_vllm_keeps_a_part_without_text_as_a_null_text_unless_it_is_a_text_or_refusal(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, as_parts = pairs[("gemma3.jinja", "vllm")]  # gemma3 loops over a message's parts
    _, as_string = pairs[("chatml.jinja", "vllm")]
    body = SHAPES["textless_parts"]
    # The thinking, input_text and output_text parts, their text null (Jinja prints None).
    assert "What is the weatherNoneNoneNonein Paris?" in rendered(as_parts, body)
    assert "What is the weather\nin Paris?" in rendered(as_string, body)


def test_sglang_renders_a_root_message_under_its_own_role(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, sglang = pairs[("chatml.jinja", "sglang")]
    assert "<|im_start|>root\nYou are terse." in rendered(sglang, SHAPES["root"])


def test_sglang_refuses_a_capitalised_user_role_and_lower_cases_the_others(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, sglang = pairs[("chatml.jinja", "sglang")]
    with pytest.raises(RequestError):
        sglang.chat_ids(copy.deepcopy(SHAPES["capitalised_roles"]))
    body = {
        "messages": [{"role": "System", "content": "You are terse."}, SHAPES["root"]["messages"][1]]
    }
    assert "<|im_start|>system\nYou are terse." in rendered(sglang, body)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "tool_call_id": 7, "content": "Sunny."},
        {"role": "assistant", "name": 7, "content": "It is sunny."},
        {"role": "assistant", "tool_calls": [{"function": {"name": 7, "arguments": "{}"}}]},
    ],
)
def test_sglang_refuses_a_name_or_tool_call_id_that_is_not_a_string(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], message: dict[str, Any]
) -> None:
    _, sglang = pairs[("chatml.jinja", "sglang")]
    with pytest.raises(RequestError):
        sglang.chat_ids({"messages": [SHAPES["root"]["messages"][1], message]})


def test_sglang_refuses_an_input_text_part_that_vllm_reads_as_text(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("chatml.jinja", "vllm")]
    _, sglang = pairs[("chatml.jinja", "sglang")]
    assert "What is the weather\nin Paris?" in rendered(vllm, SHAPES["input_text_parts"])
    with pytest.raises(RequestError):
        sglang.chat_ids(copy.deepcopy(SHAPES["input_text_parts"]))


def test_vllm_dumps_a_tools_declared_fields_alone_with_its_defer_loading_copied_in(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("qwen3.jinja", "vllm")]
    text = rendered(vllm, SHAPES["tools_with_undeclared_keys"])
    assert '"required": ["city"]}, "defer_loading": true}, "defer_loading": true}' in text
    assert '{"name": "search", "description": null, "parameters": {' in text
    for dropped in ("cache_control", "examples", "strict"):
        assert dropped not in text


def test_a_developer_message_is_a_system_message_unless_the_template_names_developer(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("qwen3.jinja", "vllm")]
    text = rendered(vllm, SHAPES["developer"])
    assert text.startswith("<|im_start|>system\nYou are terse.")


def test_text_parts_are_joined_with_newlines_by_vllm_and_spaces_by_sglang(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("chatml.jinja", "vllm")]
    _, sglang = pairs[("chatml.jinja", "sglang")]
    assert "What is the weather\nin Paris?" in rendered(vllm, SHAPES["text_parts"])
    assert "What is the weather in Paris?" in rendered(sglang, SHAPES["text_parts"])


@pytest.mark.parametrize("shape", ["empty_text_parts", "empty_string_parts"])
def test_vllm_leaves_empty_texts_out_of_the_string_it_joins_and_sglang_keeps_them(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], shape: str
) -> None:
    _, vllm = pairs[("chatml.jinja", "vllm")]
    _, sglang = pairs[("chatml.jinja", "sglang")]
    assert "What is the weather\nin Paris?" in rendered(vllm, SHAPES[shape])
    if shape == "empty_text_parts":  # SGLang's model refuses bare strings as parts
        assert "What is the weather  in Paris?" in rendered(sglang, SHAPES[shape])


# Renders each part of a message's content, a tool_reference as the tool it names (as GLM's
# templates expand one); both engines hand it parts (it loops over `message.content`).
EXPANDS_TOOL_REFERENCES = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'tool_reference' %}"
    "{% for tool in tools if tool.function.name == part.name %}"
    "[{{ tool.function | tojson }}]{% endfor %}"
    "{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_tool_reference_reaches_a_template_that_expands_it_as_each_engine_passes_it(
    tmp_path: Path, engine: str
) -> None:
    path = build_model_dir(tmp_path, "qwen", EXPANDS_TOOL_REFERENCES)
    router, worker = load_tokenizer(str(path), engine=engine), ModelChat(str(path), engine)
    body = SHAPES["tool_reference"]
    got = router.encode_chat_request(body, chat_params(body, router.engine))
    assert got.failure is None
    assert list(got.ids) == worker.chat_ids(copy.deepcopy(body))
    assert 'Use the tool I found:[{"' in worker.tokenizer.decode(got.ids)


# Renders what templates of the Responses API (phase) and DeepSeek's (prefix) read.
SHOWS_PHASE_AND_PREFIX = (
    "{% for message in messages %}<|im_start|>{{ message.role }}"
    "{% if message.phase is defined %} phase={{ message.phase }}{% endif %}"
    "{% if message.prefix is defined %} prefix={{ message.prefix }}{% endif %}"
    ": {{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_messages_phase_and_prefix_reach_the_template_as_each_engine_passes_them(
    tmp_path: Path, engine: str
) -> None:
    path = build_model_dir(tmp_path, "qwen", SHOWS_PHASE_AND_PREFIX)
    router, worker = load_tokenizer(str(path), engine=engine), ModelChat(str(path), engine)
    body = SHAPES["phase_and_prefix"]
    got = router.encode_chat_request(body, chat_params(body, router.engine))
    assert got.failure is None
    assert list(got.ids) == worker.chat_ids(copy.deepcopy(body))
    text = worker.tokenizer.decode(got.ids)
    if engine == "sglang":  # a user message's are not its model's fields
        assert "<|im_start|>user: " in text
        assert "<|im_start|>assistant phase=commentary prefix=True: " in text
    else:
        assert "phase=" not in text


def test_vllm_joins_a_tool_references_name_like_a_text_when_the_template_takes_strings(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("chatml.jinja", "vllm")]
    _, sglang = pairs[("chatml.jinja", "sglang")]
    assert "Use the tool I found:\nget_weather<|im_end|>" in rendered(
        vllm, SHAPES["tool_reference"]
    )
    assert "Use the tool I found:<|im_end|>" in rendered(sglang, SHAPES["tool_reference"])


def test_null_content_and_string_arguments_render_as_empty_text_and_a_json_object(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    _, vllm = pairs[("qwen3.jinja", "vllm")]
    text = rendered(vllm, SHAPES["tool_call_history"])
    assert "None" not in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_an_assistants_reasoning_content_reaches_the_template_under_both_engines(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], engine: str
) -> None:
    # vLLM renames the deprecated field to `reasoning` (and gives the template both); SGLang
    # reads it as it is. Qwen3 renders the reasoning of the turns after the last user message.
    _, worker = pairs[("qwen3.jinja", engine)]
    text = rendered(worker, SHAPES["reasoning_content_in_a_tool_loop"])
    assert "<think>\nThe user wants the weather: call get_weather.\n</think>" in text


@pytest.mark.parametrize("shape", ["claude_code_billing_header", "claude_code_billing_header_line"])
def test_claude_codes_billing_header_is_dropped_by_vllm_so_its_per_request_value_keys_nothing(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], shape: str
) -> None:
    router, vllm = pairs[("qwen3.jinja", "vllm")]
    _, sglang = pairs[("qwen3.jinja", "sglang")]
    body = SHAPES[shape]
    next_request = json.loads(json.dumps(body).replace("cch=a1b2c", "cch=ffee9"))
    assert "billing" not in rendered(vllm, body)
    assert "You are Claude Code" in rendered(vllm, body)
    assert router.encode_chat_request(body).ids == router.encode_chat_request(next_request).ids
    assert "x-anthropic-billing-header: cc_version=2.1.3.e4f" in rendered(sglang, body)


def test_chat_template_kwargs_reach_the_template(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    router, vllm = pairs[("qwen3.jinja", "vllm")]
    thinking_off = rendered(vllm, SHAPES["thinking_off"])
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert router.encode_chat_request(SHAPES["thinking_off"]).ids != (
        router.encode_chat_request(SHAPES["plain"]).ids
    )


EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # qwen3.jinja, thinking off


@pytest.mark.parametrize(
    ("engine", "fields", "thinks"),
    [
        # vLLM 0.22+ (entrypoints/openai/chat_completion/protocol.py build_chat_params):
        # enable_thinking = effort != "none", unless chat_template_kwargs has enable_thinking.
        ("vllm", {"reasoning_effort": "none"}, False),
        ("vllm", {"reasoning_effort": "low"}, True),
        (
            "vllm",
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": 1}},
            True,
        ),
        ("vllm", {"reasoning": {"effort": "none"}}, True),  # not a field of vLLM's model
        # SGLang 0.5.23 (entrypoints/openai/protocol.py normalize_reasoning_inputs): the same,
        # the effort also read from a `reasoning` object, which wins over the field.
        ("sglang", {"reasoning_effort": "none"}, False),
        ("sglang", {"reasoning": {"effort": "none"}}, False),
        ("sglang", {"reasoning_effort": "none", "reasoning": {"effort": "high"}}, True),
        ("sglang", {"reasoning_effort": 0.5}, True),
    ],
)
def test_the_reasoning_effort_turns_a_templates_thinking_on_or_off_as_the_engine_does(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
    engine: str,
    fields: dict[str, Any],
    thinks: bool,
) -> None:
    router, worker = pairs[("qwen3.jinja", engine)]
    body = {"messages": SHAPES["plain"]["messages"], **fields}
    ids = router.encode_chat_request(body, chat_params(body, router.engine)).ids
    assert worker.tokenizer.decode(ids).endswith(EMPTY_THINK) is not thinks
    assert list(ids) == worker.chat_ids(copy.deepcopy(body))


def test_a_legacy_sentencepiece_json_is_rebuilt_as_transformers_loads_it(
    models: dict[str, Path], pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]]
) -> None:
    router, vllm = pairs[("chatml.jinja", "vllm")]
    as_written = Tokenizer.from_file(str(models["chatml.jinja"] / "tokenizer.json"))
    text = vllm.tokenizer.apply_chat_template(
        SHAPES["plain"]["messages"], tokenize=False, add_generation_prompt=True
    )
    ids = list(router.encode_chat_request(SHAPES["plain"]).ids)
    assert ids == vllm.chat_ids(SHAPES["plain"])
    assert ids != as_written.encode(text, add_special_tokens=False).ids  # the json as written


def test_a_completion_prompt_gets_the_tokenizers_special_tokens(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    for (template, engine), (router, worker) in pairs.items():
        text = "You are a helpful assistant. The weather in Paris is sunny."
        assert router.encode_prompt(text) == worker.encode(text), (template, engine)
    router, _ = pairs[("llama3.1_instruct.jinja", "vllm")]
    bos = router.model._backend.token_to_id("<|begin_of_text|>")  # type: ignore[attr-defined]
    assert router.encode_prompt("hello")[0] == bos


@pytest.mark.parametrize("flag", [False, "false", 0])
def test_a_completion_without_special_tokens_is_encoded_as_the_engine_encodes_it(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], flag: object
) -> None:
    text = "You are a helpful assistant. The weather in Paris is sunny."
    body = {"prompt": text, "add_special_tokens": flag}
    for (template, engine), (router, worker) in pairs.items():
        params = completion_params(body, Engine(engine))
        # vLLM leaves BOS out; SGLang's model has no such field and adds it all the same.
        expected = worker.encode(text, add_special_tokens=False)
        assert router.encode_prompt(text, params) == expected, (template, engine)
    router, worker = pairs[("llama3.1_instruct.jinja", "vllm")]
    bos = router.model._backend.token_to_id("<|begin_of_text|>")  # type: ignore[attr-defined]
    assert router.encode_prompt(text, completion_params(body, Engine.VLLM))[0] != bos
    router, _ = pairs[("llama3.1_instruct.jinja", "sglang")]
    assert router.encode_prompt(text, completion_params(body, Engine.SGLANG))[0] == bos


TRUNCATIONS = [
    {"truncate_prompt_tokens": 7},
    {"truncate_prompt_tokens": 7, "add_special_tokens": False},
    {"truncate_prompt_tokens": 7, "truncation_side": "left"},
    {"truncate_prompt_tokens": 7, "truncation_side": "right"},
    {"truncate_prompt_tokens": 7.0, "truncation_side": "right", "add_special_tokens": "no"},
    {"truncate_prompt_tokens": 500},  # longer than the prompt: nothing cut
    {"truncate_prompt_tokens": -1},  # the context less max_tokens: past this prompt
]


@pytest.mark.parametrize("fields", TRUNCATIONS)
def test_a_truncated_completion_is_cut_as_the_engine_cuts_it(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]], fields: dict[str, Any]
) -> None:
    text = "You are a helpful assistant. The weather in Paris is sunny, and tomorrow too."
    ids = list(range(100, 130))
    for (template, engine), (router, worker) in pairs.items():
        params = completion_params(fields, Engine(engine))
        truncation = worker.truncation(fields, 16)
        special = fields.get("add_special_tokens", True) not in (False, "no")
        expected = worker.encode(text, special, truncation)
        assert router.encode_prompt(text, params) == expected, (template, engine)
        assert list(router.encode_prompt(ids, params)) == vllm_cut(ids, truncation)
    router, _ = pairs[("llama3.1_instruct.jinja", "vllm")]
    bos = router.model._backend.token_to_id("<|begin_of_text|>")  # type: ignore[attr-defined]
    cut = router.encode_prompt(text, completion_params(TRUNCATIONS[0], Engine.VLLM))
    assert len(cut) == 7 and cut[0] == bos  # room kept for BOS, the text's last six after it


def test_a_vllm_chat_with_special_tokens_gets_bos_on_top_of_the_templates(
    pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]],
) -> None:
    router, _ = pairs[("llama3.1_instruct.jinja", "vllm")]
    body = SHAPES["add_special_tokens"]
    ids = router.encode_chat_request(body, chat_params(body, Engine.VLLM)).ids
    bos = router.model._backend.token_to_id("<|begin_of_text|>")  # type: ignore[attr-defined]
    assert list(ids[:2]) == [bos, bos]


def test_shapes_file_is_valid_json() -> None:
    # The shapes are plain JSON bodies (a client could send each one as it is).
    for body in SHAPES.values():
        assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_the_engine_mirror_refuses_arguments_nested_past_pythons_limit_with_a_400(
    engine: str, pairs: dict[tuple[str, str], tuple[RequestTokenizer, ModelChat]]
) -> None:
    """json.loads raises RecursionError (a RuntimeError) on them, which both engines' chat
    handlers answer with a 400; the mirror raised it through, a 500."""
    _, mirror = pairs[("qwen3.jinja", engine)]
    call = {"id": "c1", "type": "function", "function": {"name": "f"}}
    call["function"]["arguments"] = "[" * 100_000 + "]" * 100_000
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
    }
    with pytest.raises(RequestError):
        mirror.chat_ids(body)


def marked_template(mark: str) -> str:
    return (
        mark + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("tokenizer_template", [None, marked_template("TOKENIZER ")])
def test_a_multimodal_models_processor_template_is_rendered_where_the_engine_renders_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engine: str, tokenizer_template: str | None
) -> None:
    # vLLM renders a request without tools by the processor's template (chat_template.json),
    # one with tools by the tokenizer's; SGLang loads the processor's in place of the
    # tokenizer's. The router read only the tokenizer's: no template at all, every chat a
    # no_template miss, or the other template's ids.
    directory = build_multimodal_model_dir(tmp_path, tokenizer_template, marked_template("PROC "))
    with caplog.at_level(logging.WARNING):
        router = load_tokenizer(str(directory), engine=engine)
    assert "no chat template" not in caplog.text
    worker = ModelChat(str(directory), engine)
    plain = SHAPES["plain"]
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    tools_mark = "PROC " if engine == "sglang" else tokenizer_template and "TOKENIZER "
    for body, mark in ((plain, "PROC "), (with_tools, tools_mark)):
        expected = engine_ids(worker, body)
        got = router.encode_chat_request(copy.deepcopy(body), chat_params(body, router.engine))
        if not mark:  # vLLM: no template for a request with tools; the engine refuses it
            assert (expected, got.failure) == (None, "no_template")
            continue
        assert expected is not None and worker.tokenizer.decode(expected).startswith(mark)
        assert (got.failure, list(got.ids)) == (None, expected)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_text_models_chat_template_json_is_not_rendered_as_no_processor_reads_it(
    tmp_path: Path, engine: str
) -> None:
    # A text model's AutoProcessor is its tokenizer, which never reads chat_template.json: the
    # engines render by the tokenizer's template. Read as a processor's, the router rendered
    # the file's other template, and every chat's ids differed from the engine's.
    directory = build_model_dir(tmp_path / "text", "qwen", marked_template("TOKENIZER "))
    (directory / "chat_template.json").write_text(
        json.dumps({"chat_template": marked_template("PROC ")}), encoding="utf-8"
    )
    router = load_tokenizer(str(directory), engine=engine)
    worker = ModelChat(str(directory), engine)
    body = SHAPES["plain"]
    expected = engine_ids(worker, body)
    assert expected is not None and worker.tokenizer.decode(expected).startswith("TOKENIZER ")
    got = router.encode_chat_request(copy.deepcopy(body), chat_params(body, router.engine))
    assert (got.failure, list(got.ids)) == (None, expected)
