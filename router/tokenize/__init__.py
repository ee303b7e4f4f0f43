"""Request -> the token ids the engine will compute and cache.

The router's block keys hash the engine's token ids, so any difference between how the router
and the engine turn a request into ids silently turns a warm cache into a miss. Modules:

- `request.py`: `RequestTokenizer`, the request path's entry (`encode_prompt`,
  `encode_chat_request`) and its error contract.
- `chat_rules.py`: the engine's rewrite of a chat request before its template (vLLM's rules,
  SGLang's where they differ). Pure.
- `template_traits.py`: what a template's source tells the engines (content as parts, the
  developer role, the variables it reads).
- `hf.py`: a model directory loaded and rendered through transformers, as the engines do.
- `segments.py`: the prefix tokenization cache (segments between special tokens, bounded LRU).
- `offload.py`: `Offload`, a long text's render and encode for a worker thread.
- `plain.py`: the `bytes` tokenizer and plain chat format of the demo fleet (no model files).

`load_tokenizer(spec)` builds one: `bytes`, or a model directory (or its `tokenizer.json`),
which needs the `hf` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from router.tokenize.chat_rules import ENGINES, FAILURE_REASONS, ChatRequestError, Engine
from router.tokenize.plain import BYTES_TOKEN_OFFSET, BytesTokenizer, render_chat_plain
from router.tokenize.request import BytesModel, ChatTokens, RequestTokenizer

__all__ = [
    "BYTES_TOKEN_OFFSET",
    "DEFAULT_CACHE_MB",
    "ENGINES",
    "FAILURE_REASONS",
    "BytesTokenizer",
    "ChatRequestError",
    "ChatTokens",
    "Engine",
    "RequestTokenizer",
    "load_tokenizer",
    "render_chat_plain",
]

DEFAULT_CACHE_MB: Final = 64


def load_tokenizer(
    spec: str, *, engine: str = "vllm", cache_mb: float = DEFAULT_CACHE_MB
) -> RequestTokenizer:
    """`bytes`, or a model directory (a `tokenizer.json` path means its directory).

    The directory is loaded as the engines load it (transformers' AutoTokenizer: its
    tokenizer.json, tokenizer_config.json, config.json, chat_template.jinja; a processor's
    chat_template.json). `engine` picks
    whose chat rules apply (`vllm` or `sglang`); `cache_mb` bounds the segment cache.

    Raises ValueError for a missing or unloadable model, ImportError without the hf extra.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, not {engine!r}")
    if cache_mb < 0:
        raise ValueError("the tokenization cache size must be >= 0 MB")
    if spec == "bytes":
        return RequestTokenizer("bytes", BytesModel())
    path = Path(spec)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"tokenizer {spec!r}: not 'bytes' and no such model directory")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {spec!r}: the directory has no tokenizer.json")
    from router.tokenize.hf import load_model

    model = load_model(path, Engine(engine), int(cache_mb * 1024 * 1024))
    if not model.has_template:
        import logging

        logging.getLogger(__name__).warning(
            "%s has no chat template: chat requests are routed by load as misses "
            "(the engine refuses them too unless it was given --chat-template FILE: copy "
            "that file into the directory as chat_template.jinja)",
            spec,
        )
    return RequestTokenizer(f"hf:{path}", model)
