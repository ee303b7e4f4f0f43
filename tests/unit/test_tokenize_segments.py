"""The segment cache's ids always equal a fresh full encode; its memory stays bounded.

Property tests: random conversations rendered by every fixture template (each on its family's
tokenizer, loaded as the engines load it), encoded by one long-lived SegmentEncoder per template
(so later examples hit what earlier ones cached), compared with the backend's own encode of the
whole text. A hand-built tokenizer adds the hard cases: added tokens that swallow whitespace
(lstrip/rstrip) and a Metaspace pre-tokenizer that prefixes only the start of the text.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from router.tokenize.segments import SegmentCache, SegmentEncoder, entry_bytes, ids_encoder
from tests.support.model_dirs import (
    FIXTURE_TEMPLATES,
    HOLDOUT_TEMPLATES,
    build_fixture_model,
    build_holdout_model,
    corpus,
    holdout_dir,
)

TEXT = st.lists(
    st.sampled_from(
        [
            *"abc XYZ.,\n\t",
            *["  ", "東", "é", "😀", "<|im_end|>", "<|im_start|>", "[INST]", "<s>", "</s>"],
            *["<eos>", "<|eot_id|>", "<think>", "<tool_call>", "<start_of_turn>", "▁", "\u00a0"],
            # the hold-out families' control tokens (Phi-3's strip the whitespace after them)
            *["<|end|>", "<|user|>", "[SYSTEM_PROMPT]", "<\uff5cUser\uff5c>", "<|start_of_role|>"],
            *["<|START_OF_TURN_TOKEN|>", "<BOS_TOKEN>", "<|message|>", " \n "],
        ]
    ),
    max_size=40,
).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT})
CONVERSATION = st.lists(MESSAGE, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, SegmentEncoder]]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in FIXTURE_TEMPLATES:
        tokenizer = AutoTokenizer.from_pretrained(str(build_fixture_model(root / name, name)))
        out[name] = (tokenizer, SegmentEncoder(tokenizer.backend_tokenizer, 1 << 20))
    return out


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    # Raw text around the template: the property is about encoding, whatever the template does.
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    try:
        templated = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # the template refused the conversation: the raw text still counts
        templated = ""
    return templated + body


@settings(max_examples=60, deadline=None)
@given(conversation=CONVERSATION, grown=CONVERSATION)
def test_cached_ids_equal_a_fresh_full_encode_on_every_fixture_template(
    loaded: dict[str, tuple[Any, SegmentEncoder]],
    conversation: list[dict[str, str]],
    grown: list[dict[str, str]],
) -> None:
    assert_cached_ids_equal_fresh_ones(loaded, conversation, grown)


def assert_cached_ids_equal_fresh_ones(
    loaded: dict[str, tuple[Any, SegmentEncoder]],
    conversation: list[dict[str, str]],
    grown: list[dict[str, str]],
) -> None:
    for name, (tokenizer, encoder) in loaded.items():
        backend = tokenizer.backend_tokenizer
        for messages in (conversation, [*conversation, *grown], conversation):
            text = render(tokenizer, messages)
            fresh = backend.encode(text, add_special_tokens=False).ids
            assert list(encoder.encode(text)) == fresh, (name, text)


HOLDOUT_DIR = holdout_dir()


@pytest.fixture(scope="module")
def holdouts_loaded(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Any, SegmentEncoder]]:
    if HOLDOUT_DIR is None:
        pytest.skip("no hold-out templates: set KVROUTER_HOLDOUT_TEMPLATES to their directory")
    root = tmp_path_factory.mktemp("holdouts")
    out = {}
    for i, name in enumerate(HOLDOUT_TEMPLATES):
        path = build_holdout_model(root / str(i), name, HOLDOUT_DIR)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        out[name] = (tokenizer, SegmentEncoder(tokenizer.backend_tokenizer, 1 << 20))
    return out


@settings(max_examples=30, deadline=None)
@given(conversation=CONVERSATION, grown=CONVERSATION)
def test_cached_ids_equal_a_fresh_full_encode_on_every_hold_out_template(
    holdouts_loaded: dict[str, tuple[Any, SegmentEncoder]],
    conversation: list[dict[str, str]],
    grown: list[dict[str, str]],
) -> None:
    assert_cached_ids_equal_fresh_ones(holdouts_loaded, conversation, grown)


def test_a_repeated_conversation_is_served_from_the_cache(
    loaded: dict[str, tuple[Any, SegmentEncoder]],
) -> None:
    tokenizer, _ = loaded["qwen3.jinja"]
    encoder = SegmentEncoder(tokenizer.backend_tokenizer, 1 << 20)
    turns = [{"role": "user", "content": f"question {i} about the weather"} for i in range(8)]
    encoder.encode(render(tokenizer, turns[:7]))
    misses = encoder.cache.misses
    encoder.encode(render(tokenizer, turns))  # one new turn
    assert encoder.cache.misses - misses <= 4  # the new turn's segments, not the history's
    assert encoder.cache.hits > 20


def whitespace_eating_tokenizer() -> Tokenizer:
    """Metaspace (prepend at the start only) and added tokens that strip whitespace."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    )
    tok.add_special_tokens(
        [
            AddedToken("<L>", lstrip=True, special=True, normalized=False),
            AddedToken("<R>", rstrip=True, special=True, normalized=False),
            AddedToken("<LR>", lstrip=True, rstrip=True, special=True, normalized=False),
        ]
    )
    tok.add_tokens([AddedToken("<plain>", normalized=False)])
    return tok


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(
        st.sampled_from([*"ab c\n", "  ", "<L>", "<R>", "<LR>", "<plain>", "<"]),
        max_size=30,
    ).map("".join)
)
def test_neighbouring_tokens_that_strip_whitespace_and_the_start_prefix_are_reproduced(
    text: str,
) -> None:
    tok = whitespace_eating_tokenizer()
    encoder = SegmentEncoder(tok, 1 << 20)
    assert encoder.enabled
    expected = tok.encode(text, add_special_tokens=False).ids
    assert list(encoder.encode(text)) == expected
    assert list(encoder.encode(text)) == expected  # from the cache


class EncodeOnly:
    """A backend without encode_batch_fast (older tokenizers): only what the protocol names."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.calls += 1
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return self._tok.get_added_tokens_decoder()


def test_ids_are_the_same_with_and_without_the_offset_free_encode() -> None:
    tok = whitespace_eating_tokenizer()
    text = "ab<R>  c <L>a\n<plain> <LR> b"
    expected = tok.encode(text, add_special_tokens=False).ids
    fast, plain = ids_encoder(tok), ids_encoder(EncodeOnly(tok))
    assert fast(text, False) == plain(text, False) == expected
    assert fast(text, True) == tok.encode(text, add_special_tokens=True).ids
    backend = EncodeOnly(tok)
    encoder = SegmentEncoder(backend, 1 << 20)
    assert list(encoder.encode(text)) == expected and backend.calls > 0  # the fallback ran


def test_a_single_word_added_token_turns_the_cache_off_and_stays_exact() -> None:
    tok = whitespace_eating_tokenizer()
    tok.add_special_tokens([AddedToken("<W>", single_word=True, normalized=False)])
    encoder = SegmentEncoder(tok, 1 << 20)
    assert not encoder.enabled
    for text in ("a<W>b", "a <W> b", "<R> x <W>"):
        assert list(encoder.encode(text)) == tok.encode(text, add_special_tokens=False).ids


def test_split_special_tokens_makes_specials_text_not_boundaries() -> None:
    tok = whitespace_eating_tokenizer()
    tok.encode_special_tokens = True
    encoder = SegmentEncoder(tok, 1 << 20, split_special=True)
    for text in ("a<L> b", "<R>  c<plain>d"):
        assert list(encoder.encode(text)) == tok.encode(text, add_special_tokens=False).ids


def segment_key(i: int) -> tuple[str, str, str]:
    return ("", f"{i:010d}", "")


def test_the_cache_is_an_lru_bounded_by_the_bytes_its_entries_hold() -> None:
    cache = SegmentCache(max_bytes=10 * entry_bytes(segment_key(0), array("I", [0])))
    for i in range(100):
        cache.put(segment_key(i), array("I", [i]))
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 10
    assert cache.get(segment_key(90)) == array("I", [90])  # refreshed: now the most recent
    cache.put(("", "x" * 10, ""), array("I", [1]))
    assert cache.get(segment_key(91)) is None  # the least recent went first
    assert cache.get(segment_key(90)) == array("I", [90])


def test_a_segment_larger_than_a_tenth_of_the_budget_is_not_kept() -> None:
    cache = SegmentCache(max_bytes=10_000)
    cache.put(("", "y" * 2000, ""), array("I", [1, 2]))
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match=">= 0"):
        SegmentCache(-1)


@pytest.mark.parametrize("script", ["english", "cjk"])
def test_the_bytes_the_cache_counts_are_the_memory_it_holds(
    loaded: dict[str, tuple[Any, SegmentEncoder]], script: str
) -> None:
    # kvrouter_tokenize_cache_bytes and --tokenize-cache-mb are this count: ids kept as a
    # tuple of Python ints held 3x what it said (a 28-byte int and an 8-byte slot per id).
    tokenizer, _ = loaded["qwen3.jinja"]
    rng = random.Random(0)
    words = " ".join(corpus()).split()
    gc.collect()
    tracemalloc.start()
    try:
        encoder = SegmentEncoder(tokenizer.backend_tokenizer, 1 << 20)
        held_before = tracemalloc.get_traced_memory()[0]
        for i in range(1500):  # past the bound: entries are evicted as it goes
            if script == "english":
                body = " ".join(rng.choice(words) for _ in range(200))
            else:
                body = "".join(chr(rng.randint(0x4E00, 0x62FF)) for _ in range(300))
            encoder.encode(f"<|im_start|>system\n{i} {body}<|im_end|>\n")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - held_before
    finally:
        tracemalloc.stop()
    cache = encoder.cache
    assert 0.9 * cache.max_bytes < cache.bytes <= cache.max_bytes
    assert abs(held - cache.bytes) < 0.1 * cache.bytes, (held, cache.bytes, len(cache))


def test_a_zero_budget_encodes_whole_texts(tmp_path: Path) -> None:
    tok = whitespace_eating_tokenizer()
    encoder = SegmentEncoder(tok, 0)
    assert not encoder.enabled
    assert encoder.encode("a <R> b") == tok.encode("a <R> b", add_special_tokens=False).ids


def test_the_cache_stays_consistent_when_a_worker_thread_shares_it() -> None:
    # A long chat is encoded in a worker thread (router.tokenize.offload) while the loop
    # encodes others with the same cache: lookups, insertions and evictions interleave (an
    # eviction between a lookup and its move to the end raised KeyError).
    cache = SegmentCache(40 * entry_bytes(segment_key(0), array("I", [0, 0])))
    errors: list[BaseException] = []
    rounds = 50_000

    def churn(tag: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(rounds):
                key = ("", f"{tag}{rng.randrange(30):02d}", "")
                if cache.get(key) is None:
                    cache.put(key, array("I", [i, i]))
        except BaseException as exc:
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter lets them
    try:
        threads = [
            threading.Thread(target=churn, args=(tag, seed)) for seed, tag in enumerate("ab")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    sizes = [entry_bytes(key, ids) for key, ids in cache._entries.items()]
    assert cache.bytes == sum(sizes) <= cache.max_bytes
    assert cache.hits + cache.misses == 2 * rounds
