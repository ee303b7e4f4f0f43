"""The fake engine's tokenizer and chat rendering against the router's, written separately.

They follow one written rule (README: the `bytes` tokenizer). Neither imports the other, so a
change to one that the other does not share shows up here before it becomes a silent miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.text import ByteTokenizer, render_plain_chat
from router.tokenize import BytesTokenizer, render_chat_plain

_content = st.one_of(
    st.text(max_size=40),
    st.none(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
            st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.text(max_size=5)}),
        ),
        max_size=3,
    ),
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _content}
    ),
    min_size=1,
    max_size=5,
)


@given(st.text(max_size=200))
def test_the_fake_engine_tokenizes_text_as_the_router_does(text: str) -> None:
    assert ByteTokenizer().encode(text) == BytesTokenizer().encode(text)


@given(_messages)
def test_the_fake_engine_renders_plain_chat_as_the_router_does(messages: list[dict]) -> None:
    assert render_plain_chat(messages) == render_chat_plain(messages)


@pytest.mark.parametrize(
    ("text", "ids"),
    [("", []), ("A", [68]), ("é", [0xC3 + 3, 0xA9 + 3]), ("\x00", [3])],
)
def test_byte_tokens_are_utf8_bytes_plus_three(text: str, ids: list[int]) -> None:
    assert ByteTokenizer().encode(text) == ids
    assert BytesTokenizer().encode(text) == ids


def test_the_fake_worker_takes_bytes_or_a_model_directory(tmp_path: Path) -> None:
    assert WorkerConfig(tokenizer="bytes").tokenizer == "bytes"
    with pytest.raises(ValueError, match=r"model directory with a tokenizer\.json"):
        WorkerConfig(tokenizer=str(tmp_path / "missing"))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert WorkerConfig(tokenizer=str(tmp_path)).tokenizer == str(tmp_path)
