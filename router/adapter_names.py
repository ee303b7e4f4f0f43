"""The LoRA adapter names the index has learned: bounded, and kept to the ones in use.

A request naming a learned adapter is keyed in that adapter's namespace (`routing.namespace_for`:
for vLLM it matters when no worker's `/v1/models` was readable, and names cannot be told
apart otherwise). Names come from the engines' stores (`lora_name`), worker snapshots, workers'
`/v1/models` and sibling grafts, and a fleet may cycle through more of them than the bound
(`MAX_ADAPTER_NAMES`) over a replica's life: vLLM loads adapters at run time (by
`/v1/load_lora_adapter` or a LoRA resolver on first request) and drops them, SGLang too.

So the set is least-recently-used: learning a name again makes it the most recent, and a new
name past the bound takes the place of the one least recently learned. That is the engines'
own rule: vLLM's and SGLang's adapter caches evict the least recently used adapter, and their
prefix caches the least recently used blocks, so the adapter whose blocks were stored longest
ago is the one whose blocks are the likeliest gone. An adapter in use keeps being stored
(every request caches the blocks it fills), so it stays among the most recent; one forgotten
while some of its blocks are still cached is learned again at its next store. A name is not
forgotten for being absent from the index instead: the tree holds chained keys, the namespace
hashed into a chain's first, and keeping each key's namespace beside it would cost the index
memory on every adapter block.

Requests read the set and never change it: the pump is its only writer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Set

from cachetree.keys import MAX_ADAPTER_NAMES


class AdapterNames(Set[str]):
    """The adapter names learned, at most `MAX_ADAPTER_NAMES`, the least recently learned
    dropped first."""

    def __init__(self) -> None:
        self._names: OrderedDict[str, None] = OrderedDict()  # least recently learned first

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"AdapterNames({list(self._names)!r})"

    @classmethod
    def _from_iterable(cls, names: Iterable[str]) -> frozenset[str]:
        # What `Set`'s operators (&, |, -) build their results with: plain names, no order.
        return frozenset(names)

    def use(self, name: str) -> None:
        """Learn `name`, or make it the most recent again; past the bound, drop the least
        recently learned."""
        names = self._names
        if name in names:
            names.move_to_end(name)
            return
        names[name] = None
        if len(names) > MAX_ADAPTER_NAMES:
            names.popitem(last=False)

    def learn(self, names: Iterable[str]) -> None:
        """`use` each of `names`, in sorted order: of more names than the bound, the first
        `MAX_ADAPTER_NAMES` in sorted order are kept, whatever order a set gave them in."""
        for name in sorted(names)[:MAX_ADAPTER_NAMES]:
            self.use(name)
