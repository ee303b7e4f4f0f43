"""Which workers a request naming a model may go to (`router.model_servers`), and the model a
request asks for as each engine reads it (`routing.model_asked`): the rules as tables."""

from __future__ import annotations

from typing import Any

import pytest

from router.dataplane.routing import CHAT, GENERATE, model_asked
from router.model_servers import EVERY, ModelAsk, model_servers
from router.tokenize import Engine
from router.workers import ServedModels

COMPLETIONS = b"/v1/completions"
A, B, C = "http://a", "http://b", "http://c"


def listing(*bases: str, adapters: tuple[str, ...] = ()) -> ServedModels:
    return ServedModels("vllm", bases, adapters, listed=True)


UNKNOWN = ServedModels()  # its /v1/models unreadable

MIXED = [(A, listing("m1", adapters=("ad1",))), (B, listing("m2"))]


@pytest.mark.parametrize(
    ("workers", "ask", "servers"),
    [
        # The common fleet, one model everywhere: nothing is filtered.
        ([(A, listing("m1")), (B, listing("m1"))], ("m1", True), EVERY),
        # Two models: each name to its own worker; an adapter to the worker it is loaded on.
        (MIXED, ("m1", True), frozenset({A})),
        (MIXED, ("m2", True), frozenset({B})),
        (MIXED, ("ad1", True), frozenset({A})),
        # A name no worker lists: any worker, whose engine answers (vLLM's 404, or its
        # resolver loading the adapter; SGLang serves any `model`).
        (MIXED, ("m3", True), frozenset({A, B})),
        (MIXED, ("m3", False), EVERY),
        # No model named: any worker.
        (MIXED, None, EVERY),
        # A worker whose listing is unknown serves any name, a listed one or not.
        ([*MIXED, (C, UNKNOWN)], ("m1", True), frozenset({A, C})),
        ([*MIXED, (C, UNKNOWN)], ("m3", True), frozenset({C})),
        ([(A, UNKNOWN), (B, UNKNOWN)], ("m3", True), EVERY),
        ([(A, listing("m1")), (B, UNKNOWN)], ("m1", True), EVERY),
        # A model both serve, one with an adapter the other lacks.
        ([(A, listing("m1", adapters=("ad1",))), (B, listing("m1"))], ("m1", True), EVERY),
        (
            [(A, listing("m1", adapters=("ad1",))), (B, listing("m1"))],
            ("ad1", True),
            frozenset({A}),
        ),
    ],
)
def test_a_model_goes_to_the_workers_listing_it_or_whose_listing_is_unknown(
    workers: list[tuple[str, ServedModels]], ask: ModelAsk | None, servers: frozenset[str] | None
) -> None:
    assert model_servers(workers).workers_for(ask) == servers


@pytest.mark.parametrize(
    ("workers", "ask", "unheard"),
    [
        # A strict name no listing holds: an adapter loaded since, or a name served nowhere.
        (MIXED, ("m3", True), True),
        ([*MIXED, (C, UNKNOWN)], ("m3", True), True),
        # Listed somewhere, or SGLang's `model`, which it serves whatever it names.
        (MIXED, ("ad1", True), False),
        (MIXED, ("m3", False), False),
        # No listing known: reading them again tells nothing new.
        ([(A, UNKNOWN), (B, UNKNOWN)], ("m3", True), False),
        ((), ("m3", True), False),
    ],
)
def test_a_strict_name_no_listing_holds_is_unheard_while_some_listing_is_known(
    workers: list[tuple[str, ServedModels]], ask: ModelAsk, unheard: bool
) -> None:
    table = model_servers(workers)
    assert table.unheard(table.workers_for(ask)) is unheard


def test_no_routable_worker_filters_nothing() -> None:
    """The router's 503 for no healthy worker comes first, not a 404 for every name."""
    assert model_servers(()).workers_for(("m1", True)) is EVERY


SERVED = frozenset({"m1", "org/m:v2"})


@pytest.mark.parametrize(
    ("engine", "route", "body", "ask"),
    [
        (Engine.VLLM, COMPLETIONS, {"model": "m1"}, ("m1", True)),
        (Engine.VLLM, CHAT, {"model": "ad1"}, ("ad1", True)),
        (Engine.VLLM, COMPLETIONS, {}, None),
        (Engine.VLLM, COMPLETIONS, {"model": ""}, None),
        (Engine.VLLM, COMPLETIONS, {"model": 5}, None),
        # SGLang serves any `model`; an adapter it must have loaded.
        (Engine.SGLANG, COMPLETIONS, {"model": "m2"}, ("m2", False)),
        (Engine.SGLANG, COMPLETIONS, {"model": "m1:ad1"}, ("ad1", True)),
        (Engine.SGLANG, CHAT, {"model": "m1", "lora_path": "ad1"}, ("ad1", True)),
        (Engine.SGLANG, COMPLETIONS, {"model": "org/m:v2"}, ("org/m:v2", False)),
        # /generate has no `model` (SGLang drops it unread): `lora_path` alone.
        (Engine.SGLANG, GENERATE, {"model": "m2", "lora_path": ["ad1"]}, ("ad1", True)),
        (Engine.VLLM, GENERATE, {"model": "m2"}, None),
    ],
)
def test_the_model_a_request_asks_for_is_read_as_its_engine_reads_it(
    engine: Engine, route: bytes, body: dict[str, Any], ask: ModelAsk | None
) -> None:
    assert model_asked(route, body, SERVED, engine) == ask
