"""A multi-turn agentic chat trace: shared system prompts with tool lists, growing conversations.

What chat traffic looks like to a router: a few applications, each with its long system prompt
and tool list, and many sessions per application whose conversations grow one turn per request
(user turn, assistant reply, now and then a tool call and its result). Requests of different
sessions interleave. Deterministic for a seed.

`chat_trace()` returns the chat completions bodies in arrival order; bench/bench_tokenize.py
measures tokenization on it, and the proxy benchmark can send the same bodies (each is a plain
JSON request with `model` and `max_tokens`).
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class TraceShape:
    apps: int = 3  # distinct system prompts with tool lists
    sessions: int = 24  # conversations, spread over the apps
    turns: int = 8  # requests per session
    system_words: int = 400
    tools_per_app: int = 8
    user_words: tuple[int, int] = (15, 80)
    reply_words: tuple[int, int] = (30, 150)
    tool_call_every: int = 3  # every n-th assistant turn calls a tool first
    seed: int = 11


@cache
def _words() -> tuple[str, ...]:
    # Real English and identifiers: the words of the standard library's docstrings and comments.
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    text += (Path(sysconfig.get_paths()["stdlib"]) / "subprocess.py").read_text(encoding="utf-8")
    return tuple(sorted(set(re.findall(r"[A-Za-z][a-z]{2,11}", text))))


def _sentence(rng: random.Random, n: int) -> str:
    words = _words()
    out = []
    for i in range(n):
        word = rng.choice(words)
        out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
        if rng.random() < 0.08:
            out[-1] += rng.choice([".", ",", ";", "?"])
    return " ".join(out) + "."


def _tool(rng: random.Random, app: int, i: int) -> dict[str, Any]:
    words = _words()
    params = {
        rng.choice(words).lower(): {
            "type": rng.choice(["string", "integer", "boolean"]),
            "description": _sentence(rng, rng.randint(4, 12)),
        }
        for _ in range(rng.randint(1, 4))
    }
    return {
        "type": "function",
        "function": {
            "name": f"app{app}_{rng.choice(words).lower()}_{i}",
            "description": _sentence(rng, rng.randint(10, 30)),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
        },
    }


def chat_trace(shape: TraceShape = TraceShape(), model: str = "fake-model") -> list[dict[str, Any]]:
    rng = random.Random(shape.seed)
    apps = [
        (
            {"role": "system", "content": _sentence(rng, shape.system_words)},
            [_tool(rng, a, i) for i in range(shape.tools_per_app)],
        )
        for a in range(shape.apps)
    ]
    sessions: list[tuple[int, list[dict[str, Any]]]] = []
    for s in range(shape.sessions):
        system, _ = apps[s % shape.apps]
        sessions.append((s % shape.apps, [system]))
    bodies = []
    for turn in range(shape.turns):
        for app, messages in sessions:
            messages.append(
                {"role": "user", "content": _sentence(rng, rng.randint(*shape.user_words))}
            )
            tools = apps[app][1]
            bodies.append(
                {
                    "model": model,
                    "messages": [dict(m) for m in messages],
                    "tools": tools,
                    "max_tokens": 16,
                }
            )
            if (turn + 1) % shape.tool_call_every == 0:
                tool = rng.choice(tools)["function"]
                call_id = f"call{rng.randrange(10**5):05d}"
                args = {k: rng.choice(_words()) for k in tool["parameters"]["properties"]}
                messages.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": tool["name"], "arguments": json.dumps(args)},
                            }
                        ],
                    }
                )
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call_id,
                        "content": _sentence(rng, rng.randint(10, 60)),
                    }
                )
            messages.append(
                {"role": "assistant", "content": _sentence(rng, rng.randint(*shape.reply_words))}
            )
    return bodies
