"""`Offload`: a tokenizer's work too long for the event loop, done in a worker thread.

A long prompt's encode held the loop for hundreds of milliseconds (a 512 Ki-character prompt:
180-560 ms), while every other request, the probes and the KV-event ingest waited. Asked to
(`offload=True`), the model directory's tokenizer (`hf.py`) does on the loop what reads or
writes state the loop shares (validation, the engine's chat rules, the template's choice),
and returns the rest, the render and the encode, as an `Offload`: `run` in a worker thread,
then `then` on the loop with its outcome. HF `tokenizers` releases the GIL while it encodes,
so the loop keeps turning meanwhile (a 1 ms ticker's longest gap while the router took a
512 Ki-character prompt fell from 190-270 ms to 3-20 ms; the tests' model directories).
The render is Python and holds the GIL, but a thread holding it lets the loop run every
switch interval (5 ms), where the render on the loop held it throughout (50-60 ms for a
512 Ki-character chat).

The outcome is a callable that returns what `run` returned or raises what it raised, so each
layer adds its step with `map` and handles the errors it handles on the synchronous path, in
the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


def _outcome(outcome: Callable[[], Any]) -> Any:
    return outcome()


@dataclass(frozen=True, slots=True)
class Offload(Generic[T]):
    # In a worker thread: it must touch nothing the loop writes, or only under a lock.
    run: Callable[[], Any]
    # On the loop, given `run`'s outcome.
    then: Callable[[Callable[[], Any]], T] = _outcome

    def map(self, after: Callable[[Callable[[], T]], U]) -> Offload[U]:
        """The same work, with `after` run on the loop on this one's outcome."""
        then = self.then
        return Offload(self.run, lambda outcome: after(lambda: then(outcome)))
