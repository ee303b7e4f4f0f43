"""Generation request bodies at the sizes routing bounds are about: the largest real ones, and
hostile ones of the same byte size that held the router's event loop for seconds.

`REAL` are what no bound may change (a 128k-token prompt, a chat of 1,000 turns with tools, a
batch of 64 prompts); `HOSTILE` hold more JSON values or object keys than any real request
(the probe's 30 MiB chat of 10.5M empty content parts among them), as raw bytes, since building
them as Python objects first would cost the test what it shows the router no longer pays.
"""

from __future__ import annotations

from typing import Any, Final

from tests.support.chat_shapes import SEARCH_TOOL, WEATHER_TOOL

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"


def _words(chars: int) -> str:
    text = " ".join(f"word{i % 997}, and {i}" for i in range(chars // 8))
    return text[:chars]


def _agent_chat(turns: int) -> dict[str, Any]:
    """A tool-using agent's conversation: a question, a call, its result and an answer a turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for i in range(turns // 4):
        call = {
            "id": f"call{i:05d}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "city {i}"}}'},
        }
        messages += [
            {"role": "user", "content": [{"type": "text", "text": f"And the weather {i}?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {i % 30} C"},
            {"role": "assistant", "content": f"It is sunny, {i % 30} C."},
        ]
    tools = [WEATHER_TOOL, SEARCH_TOOL] * 10
    return {"messages": messages, "tools": tools, "max_tokens": 1}


REAL: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    "128k-token prompt as ids": (
        COMPLETIONS,
        {"prompt": [100 + i % 50_000 for i in range(131_072)], "max_tokens": 1},
    ),
    "128k-token prompt as text (512 Ki characters)": (
        COMPLETIONS,
        {"prompt": _words(1 << 19), "max_tokens": 1},
    ),
    "chat of 1,000 turns with tools": (CHAT, _agent_chat(1_000)),
    "batch of 64 prompts": (
        COMPLETIONS,
        {"prompt": [f"prompt {i}: " + _words(2_000) for i in range(64)], "max_tokens": 1},
    ),
    "batch of 64 prompts of 2,048 ids": (
        COMPLETIONS,
        {"prompt": [[100 + i + j for j in range(2_048)] for i in range(64)], "max_tokens": 1},
    ),
}


def _chat_of_parts(part: bytes, count: int) -> bytes:
    return (
        b'{"max_tokens":1,"messages":[{"role":"user","content":['
        + b",".join([part] * count)
        + b"]}]}"
    )


HOSTILE: Final[dict[str, tuple[str, bytes]]] = {
    # The probe's: 30 MiB, under the 32 MiB limit; 4.6 s of the loop, 800 MiB to decode.
    "chat of 10.5M empty content parts": (CHAT, _chat_of_parts(b"{}", 10_500_000)),
    "chat of 200k text parts": (CHAT, _chat_of_parts(b'{"type":"text","text":"a"}', 200_000)),
    "prompt of 600k token ids": (
        COMPLETIONS,
        b'{"max_tokens":1,"prompt":[' + b",".join([b"12345"] * 600_000) + b"]}",
    ),
    "message of 200k distinct keys": (
        CHAT,
        b'{"max_tokens":1,"messages":[{"role":"user","content":"hi",'
        + b",".join(b'"k%d":1' % i for i in range(200_000))
        + b"}]}",
    ),
}
