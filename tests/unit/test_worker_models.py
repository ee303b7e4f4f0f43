"""What the router reads of a worker's `/v1/models` (`router.workers.parse_models`): vLLM's and
SGLang's ModelCards list the served base model(s) without a `parent` and each loaded LoRA
adapter with the base model as its `parent`; and how often they are read again."""

from __future__ import annotations

from typing import Any

import pytest

from cachetree.keys import MAX_ADAPTER_NAMES
from router.workers import MAX_SERVED_NAMES, ListingRereads, ServedModels, parse_models


def card(name: Any, parent: Any = None, owner: str = "vllm") -> dict[str, Any]:
    return {"id": name, "object": "model", "owned_by": owner, "root": name, "parent": parent}


def test_base_models_and_adapters_are_told_apart_by_their_parent() -> None:
    body = {"object": "list", "data": [card("llama"), card("llama-2"), card("sql", "llama")]}
    models = ServedModels("vllm", ("llama", "llama-2"), ("sql",), listed=True)
    assert parse_models(body) == models


@pytest.mark.parametrize(
    "body",
    [None, [], {"data": None}, {"data": {}}, {"data": ["llama"]}, {"object": "list"}],
)
def test_an_answer_that_lists_no_card_names_nothing(body: Any) -> None:
    assert parse_models(body) == ServedModels()


def test_a_card_no_adapter_could_be_named_by_is_skipped() -> None:
    data = [card("llama", owner="sglang"), card(""), card(7), card("a\x00b", "llama")]
    data += [card("sql", 5), card("chat", "llama")]  # a parent that is no name: not a base
    expected = ServedModels("sglang", ("llama",), ("chat",), listed=True)
    assert parse_models({"data": data}) == expected


def test_an_engine_neither_vllm_nor_sglang_is_none() -> None:
    assert parse_models({"data": [card("llama", owner="someone")]}).engine is None


def test_the_names_read_are_bounded_and_a_listing_past_them_is_taken_as_unknown() -> None:
    """A name left out would read as one the worker does not serve: requests naming it
    would be kept from it (`router.model_servers`)."""
    data = [card(f"b{i}") for i in range(MAX_SERVED_NAMES + 5)]
    data += [card(f"a{i}", "b0") for i in range(MAX_ADAPTER_NAMES + 5)]
    models = parse_models({"data": data})
    assert len(models.bases) == MAX_SERVED_NAMES and models.bases[-1] == "b63"
    assert len(models.adapters) == MAX_ADAPTER_NAMES
    assert not models.listed
    assert parse_models({"data": data[:MAX_SERVED_NAMES]}).listed
    adapters_past = data[:1] + data[-MAX_ADAPTER_NAMES - 1 :]
    assert not parse_models({"data": adapters_past}).listed


def test_listings_are_read_again_one_read_at_a_time_at_most_once_per_interval() -> None:
    """`WorkerRegistry.reread_listings`' pacing: a flood of requests naming a model no listing
    holds begins one read per interval, never a second while one runs."""
    rereads = ListingRereads(5.0, 30.0, next_refresh=130.0)
    assert rereads.unheard(100.0)  # the first, at once
    assert not rereads.unheard(100.0) and not rereads.unheard(106.0)  # one at a time
    rereads.ended()
    assert not rereads.unheard(104.9)
    assert rereads.unheard(105.0)


def test_the_health_loop_reads_the_listings_every_refresh_interval() -> None:
    """From the registrations' reads on, every `refresh_s`; a read for a request naming a
    model no listing holds counts as one."""
    rereads = ListingRereads(5.0, 30.0, next_refresh=30.0)
    assert not rereads.refresh(29.9)
    assert rereads.refresh(30.0)
    rereads.ended()
    assert not rereads.refresh(59.9)
    assert rereads.unheard(50.0)  # the next refresh is 30 s after this one
    rereads.ended()
    assert not rereads.refresh(79.9)
    assert rereads.refresh(80.0)
    assert not rereads.refresh(200.0)  # one at a time
    assert not ListingRereads(5.0, 0.0, next_refresh=0.0).refresh(1e9)  # 0: never
