"""Request parsing: malformed input is refused with the offending field named."""

from __future__ import annotations

from typing import Any

import pytest

from fake_kv_worker.__main__ import parse_args
from fake_kv_worker.protocol import (
    RequestError,
    dp_rank_of,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_object,
    token_chains,
)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 2**32]}, "prompt"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "stream": "maybe"}, "stream"),
        ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_completion_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_completion(body, 16)
    assert err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens"),
    ],
)
def test_chat_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat(body, 16)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": ["x"]}, "input_ids"),
        ({"text": "a", "sampling_params": []}, "sampling_params"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -3}},
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_generate_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_generate(body, 16)
    assert err.value.param == param


def test_valid_requests_parse() -> None:
    req = parse_completion({"prompt": [5, 6], "stream": True}, 16)
    assert (req.prompt, req.max_tokens, req.stream) == ([5, 6], 16, True)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, 16)
    assert chat.prompt == "<|user|>hi\n<|assistant|>"
    assert chat.max_tokens == 2
    gen = parse_generate({"text": "x", "sampling_params": {"max_new_tokens": 0}}, 16)
    assert (gen.prompt, gen.max_tokens) == ("x", 0)


def test_body_and_dp_rank_and_chain_errors() -> None:
    for raw in (b"{", b"[1]"):
        with pytest.raises(RequestError):
            parse_json_object(raw)
    assert dp_rank_of(None, 2, "h") == 0
    assert dp_rank_of(" 1 ", 2, "h") == 1
    for bad in ("2", "x", -1, True):
        with pytest.raises(RequestError) as err:
            dp_rank_of(bad, 2, "X-Data-Parallel-Rank")
        assert err.value.param == "X-Data-Parallel-Rank"
    with pytest.raises(RequestError) as err:
        token_chains({"token_chains": [[1], "x"]})
    assert err.value.param == "token_chains"


def test_command_line_maps_onto_the_config() -> None:
    cfg, log_level = parse_args(
        [
            "--port",
            "0",
            "--kv-port-base",
            "6000",
            "--dp-size",
            "2",
            "--wire",
            "sglang-legacy",
            "--replay-port-base",
            "6100",
            "--serve-kv-snapshot",
            "--fail-first",
            "2",
            "--max-concurrency",
            "3",
            "--topic",
            "kv@x",
            "--model",
            "m",
        ]
    )
    assert (cfg.port, cfg.kv_port_base, cfg.dp_size, cfg.wire) == (0, 6000, 2, "sglang-legacy")
    assert (cfg.replay_port_base, cfg.serve_kv_snapshot, cfg.fail_first) == (6100, True, 2)
    assert (cfg.max_concurrency, cfg.topic, cfg.model) == (3, "kv@x", "m")
    assert cfg.metrics_engine == "sglang"
    assert log_level == "INFO"


def test_command_line_refuses_overlapping_ports() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--kv-port-base", "6000", "--dp-size", "2", "--replay-port-base", "6001"])
