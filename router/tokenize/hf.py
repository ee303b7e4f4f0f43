"""A model directory, loaded and rendered the way vLLM and SGLang do it: through transformers.

Why transformers itself (the `hf` extra) rather than `tokenizers` + jinja2 on our own: the
engines load with `AutoTokenizer.from_pretrained`, which does not always use `tokenizer.json`
as written. For many model types it rebuilds the pipeline from the vocabulary (a Llama-family
sentencepiece JSON gets a Metaspace pre-tokenizer instead of its legacy normalizer, so `You`
after a special token stays `You` instead of becoming `▁You`), fills special tokens from the
class defaults, reads `chat_template.jinja` or a dict of named templates, and renders with its
own jinja2 environment, helpers and message normalization (None-valued keys dropped, reasoning
fields aliased, `continue_final_message` cut). Re-implementing that per model type would drift
with every transformers release; calling it cannot. Cost, measured in bench/bench_tokenize.py:
the import (~0.7 s, once at start-up) and apply_chat_template's own copying of the request
(tens of microseconds), while the expensive part, encoding, goes through our segment cache
(segments.py) on the same `tokenizers` backend transformers built.

What is ours: the engine's rewrite of the request before the template (chat_rules.py), the
template inspection (template_traits.py) and the cache.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any, Final

from router.tokenize.chat_rules import (
    Engine,
    RenderCall,
    TemplateTraits,
    Unrenderable,
    bare_tools,
    render_call,
)
from router.tokenize.segments import SegmentEncoder
from router.tokenize.template_traits import inspect_template

log = logging.getLogger(__name__)

HF_INSTALL_HINT: Final = "install the HF extra: pip install 'kvrouter[hf]'"


class HfModel:
    """One model's tokenizer and chat template, as the engine has them."""

    def __init__(self, tokenizer: Any, engine: Engine, cache_bytes: int) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.engine = engine
        self.segments = SegmentEncoder(
            self._backend, cache_bytes, split_special=bool(tokenizer.split_special_tokens)
        )
        self._apply_params = _apply_chat_template_params(tokenizer)
        self._traits: dict[str, TemplateTraits] = {}

    @property
    def has_template(self) -> bool:
        return self._tokenizer.chat_template is not None

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt: encoded with the tokenizer's special tokens (BOS), as engines do."""
        return list(self._backend.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, body: dict[str, Any]) -> list[int]:
        """Raises ChatRequestError (a 400) or Unrenderable (route as a miss)."""
        tools = body.get("tools")
        template = self._template(tools if isinstance(tools, list) else None)
        call = render_call(body, self._traits_of(template), self.engine)
        text = self._render(call, template) + call.suffix
        try:
            return self.segments.encode(text)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise Unrenderable("encode", f"the tokenizer failed: {exc}") from None

    def template_name(self, tools: Any) -> str:
        """Which template a request uses, for logs: 'default', 'tool_use', or 'none'."""
        chat_template = self._tokenizer.chat_template
        if isinstance(chat_template, dict):
            return "tool_use" if tools is not None and "tool_use" in chat_template else "default"
        return "default" if chat_template is not None else "none"

    def _template(self, tools: list[Any] | None) -> str:
        try:
            # transformers' own choice: a dict of templates gives "tool_use" to requests with
            # tools when there is one, else "default".
            return self._tokenizer.get_chat_template(None, tools)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise Unrenderable("no_template", str(exc)) from None

    def _traits_of(self, template: str) -> TemplateTraits:
        traits = self._traits.get(template)
        if traits is None:
            traits = self._traits[template] = inspect_template(template, self._apply_params)
        return traits

    def _render(self, call: RenderCall, template: str) -> str:
        try:
            return self._apply(call, call.tools, template)
        except Exception as first:  # the template is code run on client data: anything goes
            if not (call.retry_with_bare_tools and call.tools):
                raise Unrenderable("render", f"the chat template raised: {first}") from None
        try:
            return self._apply(call, bare_tools(call.tools), template)
        except Exception as exc:
            raise Unrenderable("render", f"the chat template raised: {exc}") from None

    def _apply(self, call: RenderCall, tools: Any, template: str) -> str:
        return self._tokenizer.apply_chat_template(  # type: ignore[no-any-return]
            call.conversation, tools=tools, chat_template=template, tokenize=False, **call.kwargs
        )


def _apply_chat_template_params(tokenizer: Any) -> frozenset[str]:
    """apply_chat_template's named parameters: vLLM passes a request kwarg through when the
    method takes it by name, even if the template never reads it."""
    from transformers import PreTrainedTokenizerBase

    names: set[str] = set()
    for fn in (type(tokenizer).apply_chat_template, PreTrainedTokenizerBase.apply_chat_template):
        names.update(
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
        )
    return frozenset(names)


def load_model(directory: Path, engine: Engine, cache_bytes: int) -> HfModel:
    """`AutoTokenizer.from_pretrained(directory)`, offline, no remote code.

    Raises ValueError when the directory is not a loadable model, ImportError without the extra.
    """
    # Its import-time advice ("PyTorch was not found...") is for model code, not a tokenizer.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"a model tokenizer needs 'transformers': {HF_INSTALL_HINT}") from exc
    transformers.logging.set_verbosity_error()  # its advice is for training code, not us
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"cannot load a tokenizer from {directory}: {exc}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(
            f"{directory}: {type(tokenizer).__name__} is not backed by a tokenizer.json; "
            "kvrouter needs the fast (tokenizers) tokenizer the engines use"
        )
    return HfModel(tokenizer, engine, cache_bytes)
