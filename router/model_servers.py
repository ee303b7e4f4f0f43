"""Which workers a request naming a model may go to, as plain code.

A fleet may serve several models, and adapters loaded on some workers only: a request goes
only to a worker whose `/v1/models` lists the name it asks for (`WorkerRegistry`'s
`Worker.models`: base model ids and LoRA adapter names). Sent elsewhere, vLLM answers 404 and
SGLang, which does not check `model`, answers with the wrong model; a prompt cached under one
model drew another model's requests to its rank.

- A worker whose listing is unknown (its `/v1/models` unreadable, or naming no base model)
  serves any name: it is never filtered out because the router could not read it.
- A name no listing holds goes to those workers alone; with none, the request is refused
  (`strict`: a 404 in vLLM's shape) unless the engine serves any name there (SGLang's
  `model` outside an adapter's: `ModelAsk`'s `strict` False), when it goes to any worker.
- A request naming no model goes to any worker.

The table is made once per change of the routable workers or their listings; a request costs
a dict lookup. In the common fleet, one model on every worker, each name maps to `EVERY`, and
nothing is filtered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from router.workers import ServedModels

# The model a request asks for, and whether a name no worker lists is refused (`strict`). A
# plain tuple: made per request, and a NamedTuple's or a dataclass's constructor costs ~20
# times a tuple's.
ModelAsk = tuple[str, bool]


EVERY: Final = None  # `ModelServers.workers_for`: every routable worker, nothing filtered
# What `workers_for` reads for a name no listing holds: one lookup, told apart by identity.
_UNLISTED: Final[frozenset[str]] = frozenset({"\x00"})


@dataclass(frozen=True, slots=True)
class ModelServers:
    """Per model name, the worker URLs serving it (`EVERY`: all the routable ones)."""

    by_name: dict[str, frozenset[str] | None]
    unlisted: frozenset[str] | None  # the workers whose listing is unknown (`EVERY`: all)

    def workers_for(self, ask: ModelAsk | None) -> frozenset[str] | None:
        """The workers a request asking `ask` may go to; empty: none serves it."""
        if ask is None:
            return EVERY
        name, strict = ask
        servers = self.by_name.get(name, _UNLISTED)
        if servers is not _UNLISTED:
            return servers
        return self.unlisted if strict else EVERY


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
    return ModelServers(by_name, EVERY if unlisted == every else frozenset(unlisted))
