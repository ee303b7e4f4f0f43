"""The fake engine's own tokenizer and chat rendering: the written rule, implemented here again.

The router's `bytes` tokenizer and plain chat format follow the same rule (token id = UTF-8
byte + 3; each turn `<|role|>content\\n`, then `<|assistant|>`). This module does not import
the router's: an engine is an independent party, so a bug on either side must show up as a
cache miss in the tests (`tests/unit/test_fake_worker_text.py` holds the two against each
other), not be mirrored by a shared implementation.
"""

from __future__ import annotations

from typing import Final, Protocol

TOKEN_OFFSET: Final = 3  # ids 0..2 are the vocabulary's special tokens
_OFFSET_TABLE: Final = bytes((b + TOKEN_OFFSET) % 256 for b in range(256))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """One token per UTF-8 byte, its value plus `TOKEN_OFFSET`."""

    def encode(self, text: str) -> list[int]:
        # UTF-8 never produces a byte above 0xF4, so the shifted value still fits a byte.
        return list(text.encode("utf-8").translate(_OFFSET_TABLE))


def render_plain_chat(messages: list[dict[str, object]]) -> str:
    """`<|role|>text\\n` per message, then `<|assistant|>` for the reply.

    Content may be a string or a list of OpenAI parts, of which only text parts count.
    """
    turns = []
    for message in messages:
        role = message.get("role", "user")
        turns.append(f"<|{role}|>{_text_of(message.get('content'))}\n")
    return "".join(turns) + "<|assistant|>"


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
    return "".join(texts)
