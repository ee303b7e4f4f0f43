"""Request text -> token ids.

The `bytes` tokenizer (UTF-8 bytes plus a fixed offset) needs no model files; the fake worker
uses the same one, so a demo fleet caches exactly the blocks the router hashes.

A real deployment points `load_tokenizer` at the model's `tokenizer.json` (or its directory)
and gets the HF `tokenizers` library plus the model's jinja2 chat template, both imported
only then, so the router itself installs without them (`pip install 'kvrouter[hf]'`).
`RequestTokenizer` is what the app calls: `encode_prompt` for completions and `/generate`,
`encode_chat` for chat messages; bad client input raises ValueError (a 400).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol

log = logging.getLogger(__name__)

BYTES_TOKEN_OFFSET: Final = 3  # ids 0..2 stay free for special tokens, as in real vocabularies
_SHIFTED: Final = bytes((b + BYTES_TOKEN_OFFSET) % 256 for b in range(256))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class BytesTokenizer:
    """Token id = UTF-8 byte value + 3."""

    def encode(self, text: str) -> list[int]:
        # UTF-8 bytes never exceed 0xF4, so the offset fits a byte: translate in C, then list().
        return list(text.encode("utf-8").translate(_SHIFTED))

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


# --- request tokenizers ---------------------------------------------------------------------
#
# The router hashes the token ids the *engine* will cache, so it must tokenize exactly as the
# engine does: the same tokenizer.json, the same chat template, the same special-token rules.
# vLLM and SGLang encode a completion prompt with the tokenizer's special tokens (BOS), and a
# rendered chat prompt without them, because chat templates write BOS themselves; we do the
# same. A mismatch never breaks a request, it only makes the router's prefix match shorter.

HF_INSTALL_HINT: Final = "install the HF extra: pip install 'kvrouter[hf]'"
_MAX_TOKEN_ID: Final = 2**32  # block keys hash ids as u32


class TextEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...


class ChatRenderer(Protocol):
    def render(self, messages: list[dict[str, Any]]) -> str: ...


class RequestTokenizer:
    """A request's prompt -> the token ids the engine will see.

    Errors caused by the request (a malformed prompt, messages the chat template refuses)
    raise ValueError with a reason the app returns as a 400.
    """

    def __init__(self, name: str, encoder: TextEncoder, chat: ChatRenderer) -> None:
        self.name = name
        self._encoder = encoder
        self._chat = chat

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Text is tokenized with special tokens; token ids are checked and used as they are."""
        if isinstance(prompt, str):
            return self._encoder.encode(prompt, True)
        if isinstance(prompt, list):
            return _checked_ids(prompt)
        raise ValueError("the prompt must be a string or a list of token ids")

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the messages with the chat template (generation prompt added), tokenize."""
        return self._encoder.encode(self._chat.render(_checked_messages(messages)), False)

    def __repr__(self) -> str:
        return f"RequestTokenizer({self.name!r})"


def _checked_ids(ids: list[Any]) -> list[int]:
    if not ids:
        raise ValueError("the prompt is an empty list of token ids")
    # C-level passes only (the types as a set, then min/max), not a Python loop per id: a
    # 100k-token prompt is checked in a few milliseconds. `type(t) is int` rather than
    # isinstance, because bool is an int subclass and JSON `true` is not a token.
    if set(map(type, ids)) != {int}:
        raise ValueError("token ids must be integers")
    if min(ids) < 0 or max(ids) >= _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be within [0, {_MAX_TOKEN_ID})")
    return ids


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string")
    return messages


class _BytesEncoder:
    def __init__(self) -> None:
        self._tokenizer = BytesTokenizer()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text)  # no special tokens in this vocabulary


class _PlainChat:
    def render(self, messages: list[dict[str, Any]]) -> str:
        return render_chat_plain(messages)


class _HFEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


class JinjaChat:
    """A HF chat template, rendered as `transformers.apply_chat_template` does.

    Same environment: jinja2's immutable sandbox (the template comes with the model, so it
    is not trusted to touch Python objects), `trim_blocks`, `lstrip_blocks`, loop controls,
    the `raise_exception` and `strftime_now` globals, a `tojson` that keeps non-ASCII, and the
    `{% generation %}` tag (a no-op here). Variables: `messages`, `add_generation_prompt=True`
    and the special tokens (`bos_token`, `eos_token`, ...).

    Message content given as a list of parts is flattened to its text parts (vLLM's "string"
    content format, what text-only templates expect).
    """

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        jinja2, sandbox, ext = _import_jinja2()

        class GenerationTag(ext.Extension):  # type: ignore[misc]  # a base of type Any
            # transformers marks assistant turns with {% generation %}...{% endgeneration %}
            # to build masks; for rendering it is a plain block.
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self._special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]]) -> str:
        flat = [
            {**m, "content": _content_text(m["content"])}
            if isinstance(m.get("content"), list)
            else m
            for m in messages
        ]
        try:
            return self._template.render(
                messages=flat, add_generation_prompt=True, **self._special_tokens
            )
        except Exception as exc:  # the template is code run on client data: any failure is a 400
            raise ValueError(f"the chat template refused the messages: {exc}") from None


def load_tokenizer(spec: str, chat_template: str | None = None) -> RequestTokenizer:
    """`bytes`, or a HF `tokenizer.json`, or a model directory holding one.

    Beside the tokenizer.json, `tokenizer_config.json` (optional) gives `chat_template` and
    the special tokens, and `chat_template.jinja` (optional, newer HF layout) overrides its
    template. `chat_template`, when given, is template source that overrides both (like
    vLLM's `--chat-template`). Without any template, chat is rendered with the plain
    `<|role|>` format of the bytes tokenizer: routing still works, with shorter matches.

    Raises ValueError for a missing or unreadable file, ImportError when the HF extra is
    not installed.
    """
    if spec == "bytes":
        chat: ChatRenderer = _PlainChat() if chat_template is None else JinjaChat(chat_template, {})
        return RequestTokenizer("bytes", _BytesEncoder(), chat)
    path = Path(spec)
    if path.is_dir():
        directory, tokenizer_file = path, path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer {spec!r}: the directory has no tokenizer.json")
    elif path.is_file():
        directory, tokenizer_file = path.parent, path
    else:
        raise ValueError(f"tokenizer {spec!r}: not 'bytes' and no such file or directory")
    tokenizers = _import_tokenizers()
    try:
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise ValueError(f"cannot load {tokenizer_file}: {exc}") from None
    config = _read_json(directory / "tokenizer_config.json")
    special = {
        name: token
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (token := _token_text(config.get(name))) is not None
    }
    source = chat_template
    if source is None and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if source is None:
        source = _config_template(config.get("chat_template"))
    if source is None:
        log.warning("%s has no chat template: chat prompts are rendered in a plain format", spec)
    chat = _PlainChat() if source is None else JinjaChat(source, special)
    return RequestTokenizer(f"hf:{tokenizer_file}", _HFEncoder(hf), chat)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a JSON object")
    return doc


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized
    # AddedToken: {"__type": "AddedToken", "content": "<s>", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_template(value: object) -> str | None:
    # Either one template, or named ones ([{"name": "default", "template": ...}, ...]).
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            f"a HF tokenizer needs the 'tokenizers' package: {HF_INSTALL_HINT}"
        ) from exc
    return tokenizers


def _import_jinja2() -> tuple[Any, Any, Any]:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as exc:
        raise ImportError(f"a chat template needs the 'jinja2' package: {HF_INSTALL_HINT}") from exc
    return jinja2, jinja2.sandbox, jinja2.ext
