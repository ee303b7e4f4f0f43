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
import json
import logging
import os
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from typing import Any, Final

from router.tokenize.chat_rules import (
    Engine,
    RenderCall,
    TemplateTraits,
    Unrenderable,
    bare_tools,
    render_call,
    template_tools,
    within_text,
)
from router.tokenize.offload import Offload
from router.tokenize.params import MAX_ENCODED_CHARS, TokenizeParams, kept
from router.tokenize.segments import SegmentEncoder, ids_encoder
from router.tokenize.template_traits import inspect_template

log = logging.getLogger(__name__)

HF_INSTALL_HINT: Final = "install the HF extra: pip install 'kvrouter[hf]'"
# A text past `MAX_ENCODED_CHARS` (params.py) is routed by the blocks of its first part, which
# are the engine's first blocks too, less the tokens near the cut, which the text after it
# could have merged differently.
CUT_MARGIN_TOKENS: Final = 64


class HfModel:
    """One model's tokenizer and chat template, as the engine has them."""

    def __init__(
        self,
        tokenizer: Any,
        engine: Engine,
        cache_bytes: int,
        processor_template: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._processor_template = processor_template
        self._backend = tokenizer.backend_tokenizer
        self._encode = ids_encoder(self._backend)
        self.engine = engine
        self.segments = SegmentEncoder(
            self._backend, cache_bytes, split_special=bool(tokenizer.split_special_tokens)
        )
        self._apply_params = _apply_chat_template_params(tokenizer)
        self._traits: dict[str, TemplateTraits] = {}
        self._special_affixes = _special_affixes(self._encode)

    @property
    def has_template(self) -> bool:
        return self._processor_template is not None or self._tokenizer.chat_template is not None

    def encode_text(
        self, text: str, params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int] | Offload[Sequence[int]]:
        """A completion prompt: encoded with the tokenizer's special tokens (BOS) unless the
        request says not to, as engines do; the first `MAX_ENCODED_CHARS` of it (see there);
        cut as the request says (`params.py`). With `offload`, the encode is returned to be
        run in a worker thread (`offload.py`)."""
        if offload:
            return Offload(partial(self._text_ids, text, params))
        return self._text_ids(text, params)

    def _text_ids(self, text: str, params: TokenizeParams) -> Sequence[int]:
        if params.keep is not None:
            return self._truncated(self._plain, text, params, params.keep)
        special = params.add_special_tokens
        return _encoded_within_bound(lambda part: self._encode(part, special), text)

    def encode_chat(
        self, body: dict[str, Any], params: TokenizeParams, *, offload: bool = False
    ) -> Sequence[int] | Offload[Sequence[int]]:
        """Raises ChatRequestError (a 400) or Unrenderable (route as a miss). With `offload`,
        the request is checked and rewritten here, and its render and encode are returned to
        be run in a worker thread (`offload.py`), where they raise Unrenderable."""
        template = self._template(template_tools(body, self.engine))
        call = render_call(body, self._traits_of(template), self.engine)
        if offload:
            return Offload(partial(self._chat_ids, call, template, params))
        return self._chat_ids(call, template, params)

    def _chat_ids(self, call: RenderCall, template: str, params: TokenizeParams) -> Sequence[int]:
        """`call` rendered and encoded. Safe in a worker thread: what it shares with the loop
        is the backend (Rust, thread-safe), the segment cache (locked) and two memo dicts, the
        compiled templates and the sandbox's checks, each read or written in one step under
        the GIL (a race computes an entry twice, the same). Raises Unrenderable for a chat
        whose text is too long to render (`within_text`)."""
        within_text(call)
        text = self._render(call, template) + call.suffix
        try:
            if params.keep is not None:
                return self._truncated(self.segments.encode, text, params, params.keep)
            ids = _encoded_within_bound(self.segments.encode, text)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise Unrenderable("encode", f"the tokenizer failed: {exc}") from None
        if params.add_special_tokens:  # on top of those the template wrote, as vLLM does
            prefix, suffix = self._special_affixes
            ids = [*prefix, *ids, *suffix]
        return ids

    def _plain(self, text: str) -> list[int]:
        """`text`'s ids without the special tokens."""
        return self._encode(text, False)

    def _truncated(
        self, encode: Callable[[str], Sequence[int]], text: str, params: TokenizeParams, keep: int
    ) -> list[int]:
        """`text` encoded by `encode` (no special tokens), with them if asked, cut to
        `params.keep` ids as vLLM cuts it (`params.py`). Past `MAX_ENCODED_CHARS`, only a cut
        that keeps the first tokens is known; one that keeps the last is routed as a miss."""
        prefix, suffix = self._special_affixes if params.add_special_tokens else ([], [])
        if len(text) > MAX_ENCODED_CHARS:
            if params.side != "right":
                return []
            return list(kept([*prefix, *_encoded_within_bound(encode, text)], keep, "right"))
        body = encode(text)
        if params.side is None:
            # The tokenizer's own cut (its side is left): room is kept for the special tokens.
            cut = [*prefix, *kept(body, keep - len(prefix) - len(suffix), "left"), *suffix]
            return list(kept(cut, keep, "left"))  # then vLLM's own cut (a no-op unless 0)
        return list(kept([*prefix, *body, *suffix], keep, params.side))

    def template_name(self, tools: Any) -> str:
        """Which template a request uses, for logs: 'processor', 'default', 'tool_use', or
        'none'."""
        if self._uses_processor_template(tools):
            return "processor"
        chat_template = self._tokenizer.chat_template
        if isinstance(chat_template, dict):
            return "tool_use" if tools is not None and "tool_use" in chat_template else "default"
        return "default" if chat_template is not None else "none"

    def _uses_processor_template(self, tools: Any) -> bool:
        # vLLM renders a request without tools (None, not []) by the processor's template,
        # one with tools by the tokenizer's; SGLang loads the processor's in place of the
        # tokenizer's, for every request.
        return self._processor_template is not None and (
            tools is None or self.engine is Engine.SGLANG
        )

    def _template(self, tools: list[Any] | None) -> str:
        if self._uses_processor_template(tools):
            return self._processor_template  # type: ignore[return-value]
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
        direct = self._direct_render(call, tools, template)
        if direct is not None:
            return direct
        return self._tokenizer.apply_chat_template(  # type: ignore[no-any-return]
            call.conversation, tools=tools, chat_template=template, tokenize=False, **call.kwargs
        )

    def _direct_render(self, call: RenderCall, tools: Any, template: str) -> str | None:
        """apply_chat_template(tokenize=False) without its defensive copies, or None.

        A third of its cost is copying the request into fresh plain data (it may hold
        pydantic objects, numpy scalars, media); ours is fresh JSON data already, built by
        chat_rules. What is left of its wrapper is done here the same way: None-valued
        message keys dropped, reasoning fields aliased, the special tokens as variables,
        its own parameters kept out of the template's. Rare paths (continue_final_message,
        which cuts the output, and any other of its parameters) go through transformers
        itself. The fidelity tests hold this against apply_chat_template.
        """
        kwargs = call.kwargs
        if (kwargs.keys() - _DIRECT_PARAMS) & self._apply_params or not call.conversation:
            return None
        if kwargs.get("continue_final_message"):
            return None
        if any(not isinstance(t, dict) for t in tools or ()):
            return None  # transformers converts callables, or raises: let it
        documents = kwargs.get("documents")
        if any(not isinstance(d, dict) for d in documents or ()):
            return None
        variables = {k: v for k, v in kwargs.items() if k not in self._apply_params}
        messages = [_as_transformers_sees_it(m) for m in call.conversation]
        compiled = _compiled(template)
        return compiled.render(  # type: ignore[no-any-return]
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=kwargs.get("add_generation_prompt", False),
            **{**self._tokenizer.special_tokens_map, **variables},
        )


# apply_chat_template parameters the direct render handles itself.
_DIRECT_PARAMS: Final = frozenset(
    {"add_generation_prompt", "continue_final_message", "documents", "return_dict"}
)
_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")


def _as_transformers_sees_it(message: dict[str, Any]) -> dict[str, Any]:
    # Keys whose value is None are dropped (templates handle a missing key, not None), and a
    # message's reasoning is also given as `thinking` and `reasoning_content`.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _compiled(template: str) -> Any:
    """transformers' compiled template (its filters, globals and extensions), recompiled in a
    copy of its environment whose sandbox checks are memoized (`_memo_sandbox`). Cached here
    per template (a model has one or a few)."""
    compiled = _COMPILED.get(template)
    if compiled is None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment.overlay()
        env.__class__ = _memo_sandbox(type(env))
        if len(_COMPILED) >= _MAX_TEMPLATES:
            _COMPILED.clear()
        compiled = _COMPILED[template] = env.from_string(template)
    return compiled


_COMPILED: dict[str, Any] = {}
_MAX_TEMPLATES: Final = 16


@cache
def _memo_sandbox(base: type) -> type:
    """`base` (transformers' ImmutableSandboxedEnvironment) with the same decisions, faster.

    A third of a render went to the sandbox's checks on every attribute a template reads:
    `message.content` on a dict first fails a Python getattr (an exception raised and caught)
    before the item lookup, and each method a template calls (`content.split`, `.strip`) runs
    isinstance checks against the abstract mutable types. Both are functions of the object's
    type and the attribute's name alone, so:
    - a plain dict's attribute that `dict` does not have goes straight to the item lookup
      (what the base does after its getattr fails), and an absent key is the same undefined;
    - `is_safe_attribute` is computed once per (type, attribute) and remembered (the base
      ignores the value; the name set is bounded by the template's source and the few types
      JSON data and jinja produce, and capped anyway).
    The fidelity tests hold every render against apply_chat_template.
    """
    dict_attributes = frozenset(dir(dict))
    safe: dict[tuple[type, str], bool] = {}

    class MemoSandbox(base):  # type: ignore[valid-type, misc]
        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is dict and attribute not in dict_attributes:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            key = (type(obj), attr)
            known = safe.get(key)
            if known is None:
                known = super().is_safe_attribute(obj, attr, value)
                if len(safe) < 4096:
                    safe[key] = known
            return known

    return MemoSandbox


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
    """`AutoTokenizer.from_pretrained(directory)`, offline, no remote code, and the template
    of the directory's processor (`processor_template`).

    Raises ValueError when the directory is not a loadable model, ImportError without the extra.
    """
    # Its import-time advice ("PyTorch was not found...") is for model code, not a tokenizer.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # One request's encode stays on the calling thread (the batch methods would use a pool).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    return HfModel(tokenizer, engine, cache_bytes, processor_template(directory))


# The files AutoProcessor builds a multimodal model's processor from; without one it returns
# the tokenizer.
PROCESSOR_CONFIGS: Final = ("processor_config.json", "preprocessor_config.json")


def processor_template(directory: Path) -> str | None:
    """The chat template of a multimodal model's processor: the `chat_template` of
    `chat_template.json`, which transformers' processors read (over a `chat_template.jinja`,
    which the tokenizer reads too) and its tokenizers do not, so such a directory's tokenizer
    has no template or another one. vLLM and SGLang render by it (`_uses_processor_template`).
    A file that cannot be read gives None: the processor fails to load and vLLM falls back to
    the tokenizer's template. So does a directory with no processor's configuration
    (`processor_config.json`, `preprocessor_config.json`): a text model's AutoProcessor is its
    tokenizer, and the file is read by nothing the engine loads."""
    if not any((directory / name).is_file() for name in PROCESSOR_CONFIGS):
        return None
    try:
        document = json.loads((directory / "chat_template.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = document.get("chat_template") if isinstance(document, dict) else None
    return template if isinstance(template, str) else None


def _special_affixes(encode: Callable[[str, bool], list[int]]) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text's (BOS; EOS for
    the few that add one): the chat path encodes by segments without them, and adds them
    when a request asks. Found by encoding a probe both ways."""
    plain, full = encode("a", False), encode("a", True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []  # a post-processor that rewrites the text's ids: none known adds tokens so


def _encoded_within_bound(encode: Callable[[str], Sequence[int]], text: str) -> Sequence[int]:
    """`encode(text)`, or for a text past `MAX_ENCODED_CHARS` the ids of its first part less
    those the rest could have changed."""
    if len(text) <= MAX_ENCODED_CHARS:
        return encode(text)
    ids = encode(text[:MAX_ENCODED_CHARS])
    return ids[: max(0, len(ids) - CUT_MARGIN_TOKENS)]
