"""Encode a rendered chat by segments, each segment encoded once: the prefix tokenization cache.

Why it is exact. An HF `tokenizers` pipeline first cuts the text at its added tokens whose
`normalized` flag is off (leftmost-longest match); each piece between two of them is then
normalized, pre-tokenized and run through the model on its own. The ids of the whole text are
the concatenation of the pieces' ids. What a piece yields depends only on its text and on what
touches it: whether it starts the text (Metaspace's `prepend_scheme: first` adds `▁` only at
offset 0) and the neighbouring added tokens (an `rstrip`/`lstrip` token swallows adjacent
whitespace). So a segment is encoded together with its neighbours, `prev + text + next`, and the
neighbours' two ids are dropped: that is exactly its share of the whole encoding, and the cache
key `(prev, text, next)` holds all it depends on.

Chat traffic repeats itself: the system prompt and tool list, every earlier turn. A rendered
chat template puts special tokens between messages, so those repeats are whole segments, and a
growing conversation costs the encoding of its new turn only.

Not cached (encoded whole, as before): tokenizers with a `single_word` added token (its match
depends on the characters around it, which a boundary split cannot see).

Misses (and whole texts, when the cache is off) are encoded with `encode_batch_fast`, a batch
of one: the same pipeline and ids as `encode`, without tracking each token's character offsets,
which is a fifth of an encode's CPU (bench/bench_tokenize.py); `ids_encoder` falls back to
`encode` on a `tokenizers` without it.

A segment's ids are kept as an `array('I')`, 4 bytes an id: a tuple held 36 (its 8-byte slot
and, past the 256 small ints Python shares, a 28-byte int object per id), so the cache held 3x
the memory it counted. A chat's ids are built as one array too (a cached segment is copied as
bytes, no int made), which `block_keys` reads as it is. The cache is an LRU bounded by the
memory its entries hold (`entry_bytes`: the key's three strings and the array as
`sys.getsizeof` has them, and a fixed overhead for the key tuple and the dict's slot), which
tracemalloc agrees with (a test holds them together). A segment larger than a tenth of the
budget is encoded without being kept. It is read and written from the event loop and from the
worker thread a long chat is encoded in (`offload.py`), so each lookup and insertion holds a
lock (an eviction between a lookup and its move to the end raised KeyError); the encoding
itself runs outside it.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

# The key tuple and the entry's share of the OrderedDict (its table slot and index, its node
# in the order list): 140-170 bytes under tracemalloc, with the table's slack.
ENTRY_OVERHEAD: Final = 160
Key = tuple[str, str, str]  # (boundary before, segment, boundary after)


class BackendTokenizer(Protocol):
    """The part of `tokenizers.Tokenizer` used here."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def get_added_tokens_decoder(self) -> dict[int, Any]: ...


IdsEncoder = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids


def ids_encoder(backend: Any) -> IdsEncoder:
    """`backend.encode(text, add_special_tokens).ids`, without the offsets when it can."""
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return lambda text, special: list(backend.encode(text, add_special_tokens=special).ids)
    return lambda text, special: list(fast([text], add_special_tokens=special)[0].ids)


def entry_bytes(key: Key, ids: array[int]) -> int:
    """The memory one cache entry holds."""
    prev, segment, nxt = key
    strings = sys.getsizeof(prev) + sys.getsizeof(segment) + sys.getsizeof(nxt)
    return strings + sys.getsizeof(ids) + ENTRY_OVERHEAD


class SegmentCache:
    """LRU of segment -> ids, bounded by the bytes its entries hold."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the tokenization cache size must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> array[int] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return ids

    def put(self, key: Key, ids: array[int]) -> None:
        size = entry_bytes(key, ids)
        with self._lock:
            if size * 10 > self.max_bytes or key in self._entries:
                return
            self._entries[key] = ids
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= entry_bytes(*self._entries.popitem(last=False))


class SegmentEncoder:
    """`encode(text)`'s ids are `backend.encode(text, add_special_tokens=False).ids`, by
    segments (an `array('I')`; a list when the cache is off)."""

    def __init__(
        self, backend: BackendTokenizer, max_bytes: int, *, split_special: bool = False
    ) -> None:
        self._encode = ids_encoder(backend)
        self.cache = SegmentCache(max_bytes)
        added = backend.get_added_tokens_decoder()
        boundaries = {
            token.content: token_id
            for token_id, token in added.items()
            # With split_special_tokens a special token is encoded as text: no boundary.
            if not token.normalized and not (split_special and token.special)
        }
        self._ids = boundaries
        single_word = any(t.single_word for t in added.values() if not t.normalized)
        self.enabled = bool(boundaries) and not single_word and max_bytes > 0
        longest_first = sorted(boundaries, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def encode(self, text: str) -> Sequence[int]:
        if not self.enabled:
            return self._encode(text, False)
        # [text, token, text, token, ..., text]: even items are segments, odd ones boundaries.
        pieces = self._split.split(text)
        ids = array("I")
        last = len(pieces) - 1
        for i in range(0, len(pieces), 2):
            segment = pieces[i]
            prev = pieces[i - 1] if i else ""
            nxt = pieces[i + 1] if i < last else ""
            if segment:
                ids.extend(self._segment(prev, segment, nxt))
            if nxt:
                ids.append(self._ids[nxt])
        return ids

    def _segment(self, prev: str, segment: str, nxt: str) -> array[int]:
        key = (prev, segment, nxt)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        encoded = self._encode(prev + segment + nxt, False)
        ids = array("I", encoded[(1 if prev else 0) : len(encoded) - (1 if nxt else 0)])
        self.cache.put(key, ids)
        return ids
