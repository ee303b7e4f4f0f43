"""Chat completions bodies of every shape a router meets: the issue's table, and then some.

Each is a plain JSON body a client could send. Tool-call ids are 9 alphanumerics, as Mistral's
template demands. Used by the fidelity tests (router ids vs engine ids on every fixture template)
and the tokenization benchmark.
"""

from __future__ import annotations

from typing import Any, Final

SYSTEM: Final = {"role": "system", "content": "You are a helpful assistant."}
USER: Final = {"role": "user", "content": "What is the weather in Paris today?"}

WEATHER_TOOL: Final = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city name"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: Final = {  # no description: vLLM's request model dumps it as null
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
}

BILLING_HEADER: Final = "x-anthropic-billing-header: cc_version=2.1.3.e4f"

TOOL_CALL: Final = {
    "id": "call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CALL_HISTORY: Final = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call12345", "content": "Sunny, 24 degrees."},
]


def _called_with(arguments: Any) -> dict[str, Any]:
    """A tool-call history whose call carries these arguments."""
    call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": arguments}}
    return {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny."},
        ],
        "tools": [WEATHER_TOOL],
    }


SHAPES: Final[dict[str, dict[str, Any]]] = {
    "plain": {"messages": [SYSTEM, USER]},
    "multi_turn": {
        "messages": [
            SYSTEM,
            USER,
            {"role": "assistant", "content": "It is sunny and warm."},
            {"role": "user", "content": "Thank you! And tomorrow?"},
        ]
    },
    "tools": {"messages": [SYSTEM, USER], "tools": [WEATHER_TOOL, SEARCH_TOOL]},
    # Keys vLLM's tool models do not declare are dropped, a null strict too; a tool-level
    # defer_loading is copied into its function (Anthropic-translating gateways send these).
    "tools_with_undeclared_keys": {
        "messages": [SYSTEM, USER],
        "tools": [
            {**WEATHER_TOOL, "defer_loading": True, "cache_control": {"type": "ephemeral"}},
            {
                "type": "function",
                "function": {**SEARCH_TOOL["function"], "strict": None, "examples": ["paris"]},
            },
        ],
    },
    # Flags in pydantic's lax forms, a null strict, a function's keys in the client's order:
    # both engines read the flags as booleans; SGLang 0.5.23 keeps the client's order.
    "tools_with_lax_flags": {
        "messages": [SYSTEM, USER],
        "tools": [
            {
                "type": "function",
                "defer_loading": 1,
                "function": {
                    "parameters": WEATHER_TOOL["function"]["parameters"],
                    "name": "get_weather",
                    "strict": "true",
                },
            },
            {**SEARCH_TOOL, "function": {**SEARCH_TOOL["function"], "strict": None}},
            {**SEARCH_TOOL, "function": {"defer_loading": "off", **SEARCH_TOOL["function"]}},
        ],
    },
    "tools_choice_none": {"messages": [USER], "tools": [WEATHER_TOOL], "tool_choice": "none"},
    "developer": {"messages": [{"role": "developer", "content": "You are terse."}, USER]},
    # MiniMax M3's first message: vLLM renders any role, SGLang 0.5.23 takes this one as it is.
    "root": {"messages": [{"role": "root", "content": "You are terse."}, USER]},
    # SGLang lower-cases every role but user, whose model takes it exactly: a 400 there.
    "capitalised_roles": {
        "messages": [{"role": "System", "content": "You are terse."}, {**USER, "role": "User"}]
    },
    "text_parts": {
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the weather"},
                    {"type": "text", "text": "in Paris?"},
                ],
            },
        ]
    },
    # vLLM leaves an empty text out of the string it joins (kept as a part); SGLang keeps it.
    "empty_text_parts": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the weather"},
                    {"type": "text", "text": ""},
                    {"type": "text", "text": "in Paris?"},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {
                "role": "tool",
                "tool_call_id": "call12345",
                "content": [
                    {"type": "text", "text": "Sunny"},
                    {"type": "text", "text": ""},
                    {"type": "text", "text": "24C"},
                ],
            },
        ],
        "tools": [WEATHER_TOOL],
    },
    # Parts without text: vLLM skips a text or refusal one, and keeps a thinking, input_text
    # or output_text one as a text part whose text is null where the template takes parts.
    "textless_parts": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is the weather"},
                    {"type": "thinking"},
                    {"type": "input_text", "text": None},
                    {"type": "output_text"},
                    {"type": "text", "text": None},
                    {"type": "refusal"},
                    {"type": "text", "text": "in Paris?"},
                ],
            }
        ]
    },
    # An assistant's thinking parts: SGLang takes them there alone, with exactly one of
    # thinking or text, and leaves them out of what the template sees.
    "thinking_parts_in_history": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The forecast says sun."},
                    {"type": "reasoning", "text": "Answer briefly."},
                    {"type": "text", "text": "Sunny."},
                ],
            },
            {"role": "user", "content": "And tomorrow?"},
        ]
    },
    # The Responses API's phase and DeepSeek's prefix flag: SGLang 0.5.23 hands a non-user
    # message's to the template (a prefix in pydantic's lax form read as a boolean).
    "phase_and_prefix": {
        "messages": [
            {**USER, "phase": "commentary", "prefix": True},
            {"role": "assistant", "content": "Let me look.", "phase": "commentary", "prefix": 1},
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": "It is", "phase": "final_answer", "prefix": "yes"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    "thinking_part_in_a_user_message": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "thinking", "thinking": "I want it short."},
                    {"type": "text", "text": "What is the weather in Paris?"},
                ],
            }
        ]
    },
    "thinking_part_with_thinking_and_text": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Sun.", "text": "Sun."},
                    {"type": "text", "text": "Sunny."},
                ],
            },
            {"role": "user", "content": "And tomorrow?"},
        ]
    },
    # The Responses API's text part: vLLM reads it as a text; SGLang's request model refuses it.
    "input_text_parts": {
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is the weather"},
                    {"type": "text", "text": "in Paris?"},
                ],
            },
        ]
    },
    "empty_string_parts": {
        "messages": [{"role": "user", "content": ["What is the weather", "", "in Paris?"]}]
    },
    # A reference to a deferred tool (Claude Code's tool search through a gateway, GLM's
    # templates): its name as a part, or as a text when the template takes strings.
    "tool_reference": {
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Use the tool I found:"},
                    {"type": "tool_reference", "name": "get_weather"},
                ],
            },
        ],
        "tools": [{**WEATHER_TOOL, "defer_loading": True}],
    },
    "tool_call_history": {"messages": [SYSTEM, *CALL_HISTORY], "tools": [WEATHER_TOOL]},
    "tool_call_dict_arguments": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        **TOOL_CALL,
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny."},
        ],
        "tools": [WEATHER_TOOL],
    },
    "tool_call_bad_arguments": {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {**TOOL_CALL, "function": {"name": "get_weather", "arguments": "{not json"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny."},
        ],
        "tools": [WEATHER_TOOL],
    },
    # Arguments json.loads reads and orjson (SGLang's parser) does not (NaN);
    # an integer past 64 bits, which orjson reads as a float; arguments no string nor object
    # (vLLM renders them as {}, SGLang's request model refuses them).
    "tool_call_nan_arguments": _called_with('{"city": "Paris", "days": NaN}'),
    "tool_call_big_int_arguments": _called_with('{"city": "Paris", "id": 123456789012345678901}'),
    "tool_call_list_arguments": _called_with(["Paris"]),
    "tool_result_parts": {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {
                "role": "tool",
                "tool_call_id": "call12345",
                "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "24C"}],
            },
        ],
        "tools": [WEATHER_TOOL],
    },
    "thinking_off": {
        "messages": [SYSTEM, USER],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "no_generation_prompt": {
        "messages": [SYSTEM, USER, {"role": "assistant", "content": "It is sunny."}],
        "add_generation_prompt": False,
    },
    "continue_final_message": {
        "messages": [SYSTEM, USER, {"role": "assistant", "content": "The weather in Paris is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    # Flags as the engines' lax request models take them: "false" is False, 1 is True.
    "lax_flags": {
        "messages": [SYSTEM, USER, {"role": "assistant", "content": "The weather in Paris is"}],
        "add_generation_prompt": "false",
        "continue_final_message": 1,
    },
    # vLLM adds the tokenizer's BOS again on top of the template's; SGLang has no such field.
    "add_special_tokens": {"messages": [SYSTEM, USER], "add_special_tokens": True},
    # vLLM keeps the last 24 tokens (its tokenizer's side), or as asked, the first 24 of the
    # encoding with BOS; SGLang's models have no such fields.
    "truncated": {"messages": [SYSTEM, USER], "truncate_prompt_tokens": 24},
    "truncated_right_with_bos": {
        "messages": [SYSTEM, USER],
        "truncate_prompt_tokens": "24",
        "truncation_side": "right",
        "add_special_tokens": True,
    },
    "truncated_to_the_context": {"messages": [SYSTEM, USER], "truncate_prompt_tokens": -1},
    "documents": {
        "messages": [USER],
        "documents": [{"title": "Forecast", "text": "Paris: sunny all week."}],
    },
    "reasoning_history": {
        "messages": [
            USER,
            {"role": "assistant", "content": "Sunny.", "reasoning": "The forecast says sun."},
            {"role": "user", "content": "Thanks!"},
        ]
    },
    # The deprecated field (agent loops replaying an older server's answers): vLLM renames it
    # to `reasoning`, SGLang reads it alone. Qwen3 renders it after the last user turn.
    "reasoning_content_in_a_tool_loop": {
        "messages": [
            SYSTEM,
            USER,
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "The user wants the weather: call get_weather.",
                "tool_calls": [TOOL_CALL],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny, 24 degrees."},
        ],
        "tools": [WEATHER_TOOL],
    },
    # Claude Code through a gateway translating Anthropic requests: its first system block is
    # a billing header whose cch= changes on every request. vLLM drops the line; SGLang not.
    "claude_code_billing_header": {
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": f"{BILLING_HEADER}; cc_entrypoint=cli; cch=a1b2c;"},
                    {"type": "text", "text": "You are Claude Code, an agent for the terminal."},
                ],
            },
            USER,
        ]
    },
    "claude_code_billing_header_line": {
        "messages": [
            {"role": "system", "content": f"{BILLING_HEADER}; cch=a1b2c;\nYou are Claude Code."},
            USER,
        ]
    },
    "unicode": {"messages": [{"role": "user", "content": "東京の天気は? café résumé 😀 naïve"}]},
    "parallel_tool_calls": {
        "messages": [
            SYSTEM,
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": "call67890"}],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny, 24 degrees."},
            {"role": "tool", "tool_call_id": "call67890", "content": "Sunny, 25 degrees."},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
    },
    "tool_call_with_content": {
        "messages": [
            USER,
            {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call12345", "content": "Sunny."},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "And in Rome?"},
        ],
        "tools": [WEATHER_TOOL],
    },
    "reasoning_effort": {"messages": [SYSTEM, USER], "reasoning_effort": "low"},
    # Both engines turn thinking off for "none" (enable_thinking), unless the kwargs say.
    "reasoning_effort_none": {"messages": [SYSTEM, USER], "reasoning_effort": "none"},
    "thinking_kwarg_over_reasoning_effort": {
        "messages": [SYSTEM, USER],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    },
    # vLLM: the field over the kwargs; SGLang: the kwargs over the field.
    "reasoning_effort_in_kwargs": {
        "messages": [SYSTEM, USER],
        "reasoning_effort": "high",
        "chat_template_kwargs": {"reasoning_effort": "low"},
    },
    # SGLang's alone: a `reasoning` object, a number (vLLM ignores the one, refuses the other).
    "reasoning_object": {"messages": [SYSTEM, USER], "reasoning": {"effort": "none"}},
    "reasoning_effort_number": {"messages": [SYSTEM, USER], "reasoning_effort": 0.5},
    # Ids for the engine to take as they are, its template skipped: SGLang's input_ids (vLLM's
    # model ignores them), vLLM's disaggregated decode's reused ids (SGLang has no such field).
    "input_ids": {"messages": [SYSTEM, USER], "input_ids": [11, 12, "13", 14.0]},
    "reused_prompt_token_ids": {
        "messages": [SYSTEM, USER],
        "kv_transfer_params": {"do_remote_prefill": True, "prompt_token_ids": [11, 12, 13]},
    },
    "empty_system": {"messages": [{"role": "system", "content": ""}, USER]},
    "named_user": {"messages": [{"role": "user", "name": "alice", "content": "Hi there!"}]},
    "special_text_in_content": {
        "messages": [{"role": "user", "content": "Say <|im_end|> and [INST] and <s> literally"}]
    },
}
