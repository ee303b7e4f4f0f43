"""What the router reads of a generation request: the body, the prompt, the key namespace."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest

from router.dataplane.routing import (
    MAX_BODY_KEYS,
    MAX_BODY_VALUES,
    BadRequest,
    decode_body,
    embeds_only,
    messages_of,
    model_asked,
    namespace_for,
    param_of,
    past_bounds,
    prompt_of,
)
from router.tokenize.chat_rules import Engine
from router.tokenize.params import BadField, chat_params, completion_params, kept
from tests.support.body_shapes import HOSTILE, REAL


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply"),
        (b"[" * 100_000, "nested too deeply"),
        (b'"a string"', "must be a JSON object"),
        (b'{"prompt": "\xff"}', "not valid JSON"),  # invalid UTF-8
        (b"", "not valid JSON"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_bad_requests(raw: bytes, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        decode_body(raw)


@pytest.mark.parametrize("name", HOSTILE)
def test_bodies_holding_more_values_or_keys_than_any_real_request_are_past_the_bounds(
    name: str,
) -> None:
    """Decoding and walking them held the loop for seconds: the router does not decode them."""
    assert past_bounds(HOSTILE[name][1]) is not None


def test_every_mark_counts_toward_the_bounds_and_a_body_at_them_is_read() -> None:
    values = b"[" + b"0," * (MAX_BODY_VALUES - 1) + b"0]"  # one [ and the commas: at the bound
    assert past_bounds(values) is None
    past = f"up to {MAX_BODY_VALUES + 1} JSON values (bound {MAX_BODY_VALUES})"
    assert past_bounds(values[:-1] + b",0]") == past
    nested = b"[" + b"[[]]," * (MAX_BODY_VALUES // 2) + b"[]]"  # brackets count as commas do
    assert past_bounds(nested) is not None
    objects = b"[" + b"{}," * (MAX_BODY_VALUES // 2) + b"{}]"
    assert past_bounds(objects) is not None
    keys = b"{" + b",".join(b'"k%d":0' % i for i in range(MAX_BODY_KEYS)) + b"}"
    assert past_bounds(keys) is None
    assert past_bounds(keys[:-1] + b',"one more":0}') == (
        f"up to {MAX_BODY_KEYS + 1} object keys (bound {MAX_BODY_KEYS})"
    )


@pytest.mark.parametrize("name", REAL)
def test_the_largest_real_requests_are_within_the_bounds(name: str) -> None:
    assert past_bounds(msgspec.json.encode(REAL[name][1])) is None


def test_large_bodies_of_few_values_are_within_the_bounds() -> None:
    """Bytes are not what costs: a 30 MiB text prompt or image is one string to decode."""
    text = b'{"prompt":"' + b"a" * 30_000_000 + b'"}'
    image = b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"'
    image += b"data:image/png;base64," + b"QUJD" * 7_000_000 + b'"}}]}]}'
    assert past_bounds(text) is None
    assert past_bounds(image) is None


@pytest.mark.parametrize(
    ("route", "body", "prompt"),
    [
        (b"/v1/completions", {"prompt": "hi"}, "hi"),
        (
            b"/v1/completions",
            {"prompt": ["first", "second"]},
            "first",
        ),  # batch: routed by the first
        (b"/v1/completions", {"prompt": [1, 2, 3]}, [1, 2, 3]),
        (b"/v1/completions", {"prompt": [[4, 5], [6]]}, [4, 5]),
        # Not all strings: token ids, as the engine's lax union reads them.
        (b"/v1/completions", {"prompt": ["1", 2]}, ["1", 2]),
        (b"/generate", {"input_ids": ["1", "2"]}, ["1", "2"]),  # ids, which SGLang refuses
        (b"/generate", {"text": "t"}, "t"),
        (b"/generate", {"input_ids": [7, 8], "text": "ignored"}, [7, 8]),
        (b"/generate", {"input_ids": None, "text": "t"}, "t"),  # null is absent, as SGLang reads it
        (b"/generate", {"input_ids": [[7], [8]]}, [7]),
    ],
)
def test_the_prompt_a_route_carries(route: bytes, body: dict[str, Any], prompt: Any) -> None:
    assert prompt_of(route, body) == prompt


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (b"/v1/completions", {"max_tokens": 3}, "prompt"),
        (b"/v1/completions", {"prompt": 5}, "prompt"),
        (b"/v1/completions", {"prompt": None}, "prompt"),
        (b"/generate", {"sampling_params": {}}, "text"),
        (b"/generate", {"input_ids": None, "text": None}, "text"),
        (b"/generate", {"input_ids": {"a": 1}}, "input_ids"),
        (b"/generate", {"input_ids": "not ids", "text": "t"}, "input_ids"),
    ],
)
def test_a_missing_or_mistyped_prompt_names_its_field(
    route: bytes, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        prompt_of(route, body)
    assert caught.value.param == param


def test_chat_messages_must_be_a_non_empty_list() -> None:
    assert messages_of({"messages": [{"role": "user", "content": "x"}]})
    for body in ({}, {"messages": []}, {"messages": "x"}):
        with pytest.raises(BadRequest) as caught:
            messages_of(body)
        assert caught.value.param == "messages"
    assert param_of(b"/v1/chat/completions") == "messages"


COMPLETIONS = b"/v1/completions"
CHAT = b"/v1/chat/completions"
ADAPTERS = frozenset({"sql", "chat-v2"})  # names learned (events, snapshots, /v1/models)
SERVED = frozenset({"base-model", "s3://bucket/base"})  # the workers' /v1/models' base names


def keyed_in(
    route: bytes, body: dict[str, Any], engine: Engine, served: frozenset[str] = SERVED
) -> str | None:
    """A request's key namespace as the router reads it: from what it asks for."""
    ask = model_asked(route, body, served, engine)
    return namespace_for(route, body, ask, ADAPTERS, served, engine)


@pytest.mark.parametrize(
    ("body", "engine", "namespace"),
    [
        ({}, Engine.VLLM, None),
        ({"model": "base-model"}, Engine.VLLM, None),
        # vLLM picks an adapter by `model`, learned or not: any name not served is one's
        # (or nothing vLLM serves, which it refuses), never the base model.
        ({"model": "sql"}, Engine.VLLM, "sql"),
        ({"model": "sql", "cache_salt": "s"}, Engine.VLLM, "sql\x00s"),
        ({"model": "unseen-adapter"}, Engine.VLLM, "unseen-adapter"),
        ({"model": "base-model", "lora_path": "sql"}, Engine.VLLM, None),  # not vLLM's field
        ({"model": "base-model", "lora_name": "sql"}, Engine.VLLM, None),  # neither engine's
        ({"model": 5}, Engine.VLLM, None),  # no name: vLLM refuses it
        # SGLang: `model` as "base:adapter" (after a served name, colons and all), else
        # `lora_path` (the first of a batch); learned or not.
        ({"model": "base", "lora_path": "sql"}, Engine.SGLANG, "sql"),
        ({"model": "base", "lora_path": "unseen"}, Engine.SGLANG, "unseen"),
        ({"lora_path": ["chat-v2", "sql"]}, Engine.SGLANG, "chat-v2"),
        ({"lora_path": [None, "sql"]}, Engine.SGLANG, None),
        ({"model": "base:sql"}, Engine.SGLANG, "sql"),
        ({"model": "base: unseen "}, Engine.SGLANG, "unseen"),
        ({"model": "base:sql", "lora_path": "chat-v2"}, Engine.SGLANG, "sql"),  # model first
        ({"model": "base:", "lora_path": "chat-v2"}, Engine.SGLANG, "chat-v2"),
        ({"model": "s3://bucket/base"}, Engine.SGLANG, None),  # a served name, not s3 + adapter
        ({"model": "s3://bucket/base:sql"}, Engine.SGLANG, "sql"),
        ({"model": "sql"}, Engine.SGLANG, None),
        ({"cache_salt": "s"}, Engine.SGLANG, "\x00s"),
        ({"model": "base:sql", "cache_salt": "s"}, Engine.SGLANG, "sql\x00s"),
        ({"lora_path": "", "cache_salt": 5}, Engine.SGLANG, None),  # empty, not a string: none
    ],
)
def test_the_key_namespace_of_a_request_is_the_one_its_blocks_are_published_under(
    body: dict[str, Any], engine: Engine, namespace: str | None
) -> None:
    assert keyed_in(COMPLETIONS, body, engine) == namespace
    assert keyed_in(CHAT, body, engine) == namespace


class ReadCounting(dict[str, Any]):
    """A request body that counts the reads of each field."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.reads: Counter[str] = Counter()

    def get(self, key: str, default: Any = None) -> Any:
        self.reads[key] += 1
        return super().get(key, default)


@pytest.mark.parametrize(
    ("fields", "reads"),
    [
        ({"model": "base-model:sql"}, {"model": 1, "cache_salt": 1}),
        (
            {"model": "base-model", "lora_path": ["sql"]},
            {"model": 1, "lora_path": 1, "cache_salt": 1},
        ),
    ],
)
def test_an_sglang_requests_adapter_is_read_once_for_its_servers_and_its_keys(
    fields: dict[str, Any], reads: dict[str, int]
) -> None:
    """`model_asked` and `namespace_for` each read the adapter from the body: `model` and
    `lora_path` twice per request, "base:adapter" split against every served name twice."""
    body = ReadCounting(fields)
    assert keyed_in(CHAT, body, Engine.SGLANG) == "sql"
    assert body.reads == reads


@pytest.mark.parametrize(
    ("body", "namespace"),
    [
        ({"lora_path": "sql"}, "sql"),
        ({"lora_path": "unseen"}, "unseen"),  # learned or not, as on SGLang's OpenAI routes
        ({"lora_path": ["chat-v2", "sql"]}, "chat-v2"),  # a batch: its first
        ({"lora_path": [None, "sql"]}, None),
        ({"lora_path": ""}, None),
        # GenerateReqInput has no `model`: SGLang drops it unread, "base:adapter" or not.
        ({"model": "base:sql"}, None),
        ({"model": "base-model:sql"}, None),
        ({"model": "base:sql", "lora_path": "chat-v2"}, "chat-v2"),
        ({"model": "sql"}, None),
        ({"model": "base:sql", "cache_salt": "s"}, "\x00s"),
        ({"lora_path": "sql", "cache_salt": "s"}, "sql\x00s"),
    ],
)
@pytest.mark.parametrize("engine", [Engine.SGLANG, Engine.VLLM])
def test_a_generate_request_names_its_adapter_by_lora_path_alone_as_sglang_reads_it(
    body: dict[str, Any], namespace: str | None, engine: Engine
) -> None:
    """`/generate` is SGLang's native API, whichever engine the fleet runs (vLLM serves no
    such route). Read as an OpenAI route's, "base:sql" keyed the request in adapter sql's
    namespace while SGLang served it as the base model: a false hit on sql's blocks, a miss
    on the base model's."""
    assert keyed_in(b"/generate", body, engine) == namespace


@pytest.mark.parametrize(
    ("model", "namespace"), [("sql", "sql"), ("base-model", None), ("unseen-adapter", None)]
)
def test_with_no_served_name_known_only_a_learned_adapter_keys_a_vllm_request_apart(
    model: str, namespace: str | None
) -> None:
    """No worker's /v1/models was readable (a vLLM behind --api-key): names cannot be told
    apart, and keying every named model apart would make every request a miss."""
    body = {"model": model}
    assert keyed_in(COMPLETIONS, body, Engine.VLLM, frozenset()) == namespace


@pytest.mark.parametrize(
    ("read", "body", "engine", "special"),
    [
        # vLLM: a completion defaults to true, a chat to false; lax values as its model reads.
        (completion_params, {}, Engine.VLLM, True),
        (completion_params, {"add_special_tokens": False}, Engine.VLLM, False),
        (completion_params, {"add_special_tokens": "off"}, Engine.VLLM, False),
        (chat_params, {}, Engine.VLLM, False),
        (chat_params, {"add_special_tokens": 1}, Engine.VLLM, True),
        # SGLang's models have no such field: the engine's own choice, whatever the body says.
        (completion_params, {"add_special_tokens": False}, Engine.SGLANG, True),
        (chat_params, {"add_special_tokens": True}, Engine.SGLANG, False),
        (chat_params, {"add_special_tokens": "maybe"}, Engine.SGLANG, False),
    ],
)
def test_add_special_tokens_is_read_as_each_engine_reads_it(
    read: Any, body: dict[str, Any], engine: Engine, special: bool
) -> None:
    assert read(body, engine).add_special_tokens is special


@pytest.mark.parametrize("value", [None, "maybe", 2, []])
def test_an_add_special_tokens_vllm_refuses_names_the_field(value: Any) -> None:
    for read in (completion_params, chat_params):
        with pytest.raises(BadField) as caught:
            read({"add_special_tokens": value}, Engine.VLLM)
        assert caught.value.param == "add_special_tokens"


@pytest.mark.parametrize(
    ("route", "body", "embeds"),
    [
        (b"/v1/completions", {"prompt_embeds": "AAAA"}, True),
        (b"/v1/completions", {"prompt_embeds": ["AAAA", "BBBB"], "prompt": None}, True),
        (b"/v1/completions", {"prompt_embeds": "AAAA", "prompt": "text too"}, False),
        (b"/v1/completions", {"prompt_embeds": []}, False),  # vLLM refuses an empty list
        (b"/v1/completions", {"prompt_embeds": [1.0]}, False),  # not base64 text
        (b"/generate", {"input_embeds": [[0.1, 0.2]]}, True),
        (b"/generate", {"input_embeds": [[0.1]], "input_ids": None, "text": None}, True),
        (b"/generate", {"input_embeds": [[0.1]], "text": "t"}, False),  # SGLang reads text
        (b"/generate", {"input_embeds": []}, False),
    ],
)
def test_a_prompt_given_as_embeddings_alone_is_told_apart(
    route: bytes, body: dict[str, Any], embeds: bool
) -> None:
    assert embeds_only(route, body) is embeds


@pytest.mark.parametrize(
    ("body", "engine", "keep", "side"),
    [
        ({"truncate_prompt_tokens": 8}, Engine.VLLM, 8, None),
        ({"truncate_prompt_tokens": "8", "truncation_side": "right"}, Engine.VLLM, 8, "right"),
        ({"truncate_prompt_tokens": 8.0, "truncation_side": "left"}, Engine.VLLM, 8, "left"),
        ({"truncate_prompt_tokens": 0}, Engine.VLLM, 0, None),
        # The context less max_tokens, unknown here: read as no cut (params.py says why).
        ({"truncate_prompt_tokens": -1}, Engine.VLLM, None, None),
        ({"truncate_prompt_tokens": None, "truncation_side": None}, Engine.VLLM, None, None),
        ({"truncate_prompt_tokens": 8, "truncation_side": "up"}, Engine.SGLANG, None, None),
    ],
)
def test_truncation_is_read_as_each_engine_reads_it(
    body: dict[str, Any], engine: Engine, keep: int | None, side: str | None
) -> None:
    for read in (completion_params, chat_params):
        params = read(body, engine)
        assert (params.keep, params.side) == (keep, side)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": "all"}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2**63}, "truncate_prompt_tokens"),
        ({"truncation_side": "LEFT"}, "truncation_side"),  # a Literal: exact strings only
        ({"truncation_side": 1}, "truncation_side"),
    ],
)
def test_a_truncation_vllm_refuses_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadField) as caught:
        completion_params(body, Engine.VLLM)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("ids", "keep", "side", "left"),
    [
        ([1, 2, 3, 4], 2, None, [3, 4]),  # the tokenizer's side: left
        ([1, 2, 3, 4], 2, "left", [3, 4]),
        ([1, 2, 3, 4], 2, "right", [1, 2]),
        ([1, 2, 3, 4], 9, "right", [1, 2, 3, 4]),
        ([1, 2, 3, 4], 0, None, []),
        ([1, 2, 3, 4], None, "right", [1, 2, 3, 4]),
    ],
)
def test_a_cut_keeps_the_ids_vllm_keeps(
    ids: list[int], keep: int | None, side: str | None, left: list[int]
) -> None:
    assert list(kept(ids, keep, side)) == left
