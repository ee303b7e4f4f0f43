"""Which workers a request naming a model may go to, as plain code.

A fleet may serve several models, and adapters loaded on some workers only: a request goes
only to a worker whose `/v1/models` lists the name it asks for (`WorkerRegistry`'s
`Worker.models`: base model ids and LoRA adapter names). Sent elsewhere, vLLM answers 404 and
SGLang, which does not check `model`, answers with the wrong model; a prompt cached under one
model drew another model's requests to its rank.

- A worker whose listing is unknown (its `/v1/models` unreadable, or naming no base model)
  serves any name: it is never filtered out because the router could not read it.
- A name no listing holds goes to those workers alone; with none, to any worker, whose engine
  answers: its 404 for a name it does not serve, or a LoRA resolver's adapter loaded on its
  first request. Refused by the router, an adapter loaded at run time (vLLM's
  `/v1/load_lora_adapter`, a resolver) was a 404 until its worker registered again.
- Such a name is `unheard` when the engine serves only the names it lists (`ModelAsk`'s
  `strict`: vLLM's `model`, an adapter's name; not SGLang's `model` outside an adapter's,
  which it serves whatever it names) and some listing is known: the listings may be stale,
  and the replica reads them again (`WorkerRegistry.reread_listings`, at most once per
  `MODELS_REREAD_S`), after which an adapter loaded since goes to its workers alone.
- A request naming no model goes to any worker.

The table is made once per change of the routable workers or their listings; a request costs
a dict lookup. In the common fleet, one model on every
worker, each name maps to `EVERY`, and nothing is filtered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from router.workers import ServedModels

# The model a request asks for, and whether its engine serves only the names it lists
# (`strict`: then a name no worker lists goes only to the workers whose listing is unknown,
# and is `unheard`). A plain tuple: made per request, and a NamedTuple's or a dataclass's
# constructor costs ~20 times a tuple's.
ModelAsk = tuple[str, bool]


EVERY: Final = None  # `ModelServers.workers_for`: every routable worker, nothing filtered
# What `workers_for` reads for a name no listing holds: one lookup, told apart by identity.
_UNLISTED: Final[frozenset[str]] = frozenset({"\x00"})


@dataclass(frozen=True, slots=True)
class ModelServers:
    """Per model name, the worker URLs serving it (`EVERY`: all the routable ones)."""

    by_name: dict[str, frozenset[str] | None]
    # Where a strict name no listing holds goes: the workers whose listing is unknown, or
    # every one when there are none (by name: an object no name maps to, which `unheard`
    # tells apart), or when there are only those (`EVERY`).
    unlisted: frozenset[str] | None
    listed: bool  # some worker's listing is known

    def workers_for(self, ask: ModelAsk | None) -> frozenset[str] | None:
        """The workers a request asking `ask` may go to: never none."""
        if ask is None:
            return EVERY
        name, strict = ask
        servers = self.by_name.get(name, _UNLISTED)
        if servers is not _UNLISTED:
            return servers
        return self.unlisted if strict else EVERY

    def unheard(self, servers: frozenset[str] | None) -> bool:
        """Whether `servers`, what `workers_for` answered, is its answer to a strict name no
        listing holds while some listing is known: an adapter loaded since the listings were
        read, or a name no worker serves. Told by identity: no lookup more per request."""
        return servers is self.unlisted and self.listed


def model_servers(workers: Iterable[tuple[str, ServedModels]]) -> ModelServers:
    """The table for the routable workers, each given by its URL and its listing."""
    every: set[str] = set()
    unlisted: set[str] = set()
    serving: dict[str, set[str]] = {}
    for url, models in workers:
        every.add(url)
        if not models.listed:
            unlisted.add(url)
            continue
        for name in (*models.bases, *models.adapters):
            serving.setdefault(name, set()).add(url)
    by_name: dict[str, frozenset[str] | None] = {}
    for name, urls in serving.items():
        urls |= unlisted
        by_name[name] = EVERY if urls == every else frozenset(urls)
    if unlisted == every:
        return ModelServers(by_name, EVERY, False)
    return ModelServers(by_name, frozenset(unlisted or every), True)
