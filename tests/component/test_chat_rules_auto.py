"""`--chat-rules auto` (the default): chats render by the rules of the engine the workers run,
as their `/v1/models` names it (vLLM's and SGLang's ModelCard `owned_by`)."""

from __future__ import annotations

import logging

import pytest

from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process


async def test_the_first_worker_to_name_its_engine_sets_the_chat_rules() -> None:
    async with (
        fake_worker_in_process(wire="sglang") as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        assert rt.replica.tokenizer.engine == "sglang"
        _, listing = await rt.get("/workers")
        assert [w["engine"] for w in listing["workers"]] == ["sglang"]


async def test_a_worker_naming_another_engine_is_logged_and_not_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        fake_worker_in_process(wire="vllm") as first,
        fake_worker_in_process(wire="sglang") as second,
        router_in_process(workers=[first.url]) as rt,
    ):
        assert rt.replica.tokenizer.engine == "vllm"
        with caplog.at_level(logging.WARNING, logger="router.replica"):
            status, _, _ = await rt.post("/workers", {"url": second.url})
        assert status == 200
        assert rt.replica.tokenizer.engine == "vllm"
        assert any("a mixed fleet" in r.getMessage() for r in caplog.records)


async def test_a_fixed_chat_rules_flag_is_never_overridden_by_the_workers() -> None:
    async with (
        fake_worker_in_process(wire="sglang") as fw,
        router_in_process(workers=[fw.url], chat_rules="vllm") as rt,
    ):
        assert rt.replica.tokenizer.engine == "vllm"


async def test_a_refused_worker_never_sets_the_chat_rules() -> None:
    """An SGLang worker refused for its block size registered first: the vLLM fleet's first
    admitted worker decides, and its chats render by vLLM's rules."""
    async with (
        fake_worker_in_process(wire="sglang", block_size=32) as refused,
        fake_worker_in_process(wire="vllm") as admitted,
        router_in_process(block_size=16) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": refused.url})
        assert status == 409 and body["worker"]["state"] == "refused", body
        status, body, _ = await rt.post("/workers", {"url": admitted.url})
        assert status == 200, body
        assert rt.replica.tokenizer.engine == "vllm"
