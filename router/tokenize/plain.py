"""The `bytes` tokenizer and its plain chat format: no model files, the fake worker's rule too.

Token id = UTF-8 byte + 3; a chat renders each turn as `<|role|>content\\n`, then `<|assistant|>`
opens the reply. `fake_kv_worker/text.py` implements the same written rule on its own, so a demo
fleet caches exactly the blocks the router hashes (tests/unit/test_fake_worker_text.py holds the
two against each other).
"""

from __future__ import annotations

from typing import Final

BYTES_TOKEN_OFFSET: Final = 3  # ids 0..2 stay free for special tokens, as in real vocabularies
_SHIFTED: Final = bytes((b + BYTES_TOKEN_OFFSET) % 256 for b in range(256))


class BytesTokenizer:
    """Token id = UTF-8 byte value + 3."""

    def encode(self, text: str) -> list[int]:
        return list(self.encode_bytes(text))

    def encode_bytes(self, text: str) -> bytes:
        """The ids as a bytes object, one id a byte: what the request path keys (a list of
        2,000 ints cost more to build and to read back than the keying itself)."""
        # UTF-8 bytes never exceed 0xF4, so the offset fits a byte: one translate in C.
        return text.encode("utf-8").translate(_SHIFTED)

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t - BYTES_TOKEN_OFFSET for t in token_ids).decode("utf-8", errors="replace")


def render_chat_plain(messages: list[dict[str, object]]) -> str:
    """The chat template used with the `bytes` tokenizer (no model files).

    Each turn renders as `<|role|>content\\n`, then `<|assistant|>` opens the reply, so a
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
