"""Request text -> token ids.

The `bytes` tokenizer (UTF-8 bytes plus a fixed offset) needs no model files; the fake worker
uses the same one, so a demo fleet caches exactly the blocks the router hashes.
"""

from __future__ import annotations

from typing import Final, Protocol

BYTES_TOKEN_OFFSET: Final = 3  # ids 0..2 stay free for special tokens, as in real vocabularies


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class BytesTokenizer:
    """Token id = UTF-8 byte value + 3."""

    def encode(self, text: str) -> list[int]:
        return [b + BYTES_TOKEN_OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t - BYTES_TOKEN_OFFSET for t in token_ids).decode("utf-8", errors="replace")


def render_chat_plain(messages: list[dict[str, object]]) -> str:
    """The chat template used with the `bytes` tokenizer (no model files).

    Each turn renders as `<|role|>content\n`, then `<|assistant|>` opens the reply, so a
    conversation that grows turn by turn keeps its earlier turns as a token prefix.
    """
    parts = [f"<|{m.get('role', 'user')}|>{_content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>")
    return "".join(parts)


def _content_text(content: object) -> str:
    # OpenAI allows a list of content parts; only the text parts carry tokens here.
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""
