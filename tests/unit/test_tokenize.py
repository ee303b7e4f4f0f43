"""Request tokenizers: the bytes one, and HF tokenizer.json + chat template built here, offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from router.tokenize import BytesTokenizer, JinjaChat, load_tokenizer, render_chat_plain

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant",
    "hello there how are you",
]
# Renders like many real templates: BOS once, each turn closed by EOS, then the reply opener.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }} {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "hello world"},
]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    # Like Llama's: a completion prompt gets BOS from the post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture
def hf() -> Tokenizer:
    return build_tokenizer()


def model_dir(
    root: Path, config: dict[str, Any] | None = None, jinja_file: str | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (root / "chat_template.jinja").write_text(jinja_file)
    return root


def standard_config() -> dict[str, Any]:
    return {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}


def ids(hf: Tokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# --- bytes ----------------------------------------------------------------------------------


def test_the_bytes_tokenizer_matches_the_fake_workers() -> None:
    tok = load_tokenizer("bytes")
    assert tok.name == "bytes"
    assert (
        tok.encode_prompt("héllo")
        == BytesTokenizer().encode("héllo")
        == [b + 3 for b in "héllo".encode()]
    )
    assert tok.encode_chat(MESSAGES) == BytesTokenizer().encode(render_chat_plain(MESSAGES))


# --- token id prompts -----------------------------------------------------------------------


def test_token_id_prompts_are_used_as_they_are() -> None:
    prompt = [0, 5, 2**32 - 1]
    assert load_tokenizer("bytes").encode_prompt(prompt) is prompt


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ([], "empty"),
        ([1, -1], "within"),
        ([1, 2**32], "within"),
        ([1, True], "integers"),
        ([1, 2.0], "integers"),
        ([1, "2"], "integers"),
        ({"ids": [1]}, "string or a list"),
        (None, "string or a list"),
        (7, "string or a list"),
    ],
)
def test_bad_prompts_raise_value_error_with_a_reason(prompt: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        load_tokenizer("bytes").encode_prompt(prompt)


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\].role"),
        ([{"role": "user", "content": "hi"}, {"role": 3}], r"messages\[1\].role"),
    ],
)
def test_bad_messages_raise_value_error_with_a_reason(messages: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        load_tokenizer("bytes").encode_chat(messages)


# --- HF tokenizer.json + chat template ------------------------------------------------------


def test_a_tokenizer_json_path_encodes_text_prompts_with_special_tokens(
    tmp_path: Path, hf: Tokenizer
) -> None:
    path = model_dir(tmp_path) / "tokenizer.json"
    tok = load_tokenizer(str(path))
    assert tok.name == f"hf:{path}"
    bos = hf.token_to_id("<s>")
    assert tok.encode_prompt("hello world") == [bos, *ids(hf, "hello world")]
    assert tok.encode_prompt([9, 8]) == [9, 8]


def test_a_model_directory_renders_chat_with_its_template_and_no_extra_bos(
    tmp_path: Path, hf: Tokenizer
) -> None:
    tok = load_tokenizer(str(model_dir(tmp_path, standard_config())))
    rendered = "<s><|system|> you are a helpful assistant</s><|user|> hello world</s><|assistant|>"
    expected = ids(hf, rendered)
    assert expected.count(hf.token_to_id("<s>")) == 1  # from the template, not the processor
    assert tok.encode_chat(MESSAGES) == expected


def test_a_growing_conversation_keeps_its_earlier_turns_as_a_token_prefix(
    tmp_path: Path,
) -> None:
    tok = load_tokenizer(str(model_dir(tmp_path, standard_config())))
    first = tok.encode_chat(MESSAGES)
    reply = {"role": "assistant", "content": "hello there"}
    later = tok.encode_chat([*MESSAGES, reply, {"role": "user", "content": "how are you"}])
    assert later[: len(first)] == first


def test_special_tokens_written_as_added_token_objects_are_read(
    tmp_path: Path, hf: Tokenizer
) -> None:
    config = {
        "chat_template": TEMPLATE,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>"},
    }
    tok = load_tokenizer(str(model_dir(tmp_path, config)))
    assert tok.encode_chat(MESSAGES[1:]) == ids(hf, "<s><|user|> hello world</s><|assistant|>")


def test_content_parts_are_flattened_to_their_text(tmp_path: Path) -> None:
    tok = load_tokenizer(str(model_dir(tmp_path, standard_config())))
    parts = [
        {"type": "text", "text": "hello "},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "world"},
    ]
    assert tok.encode_chat([{"role": "user", "content": parts}]) == tok.encode_chat(
        [{"role": "user", "content": "hello world"}]
    )


def test_chat_template_jinja_overrides_the_config_and_an_explicit_template_overrides_both(
    tmp_path: Path, hf: Tokenizer
) -> None:
    directory = model_dir(tmp_path, standard_config(), jinja_file="{{ messages[0]['content'] }}")
    assert load_tokenizer(str(directory)).encode_chat(MESSAGES) == ids(hf, MESSAGES[0]["content"])
    explicit = load_tokenizer(str(directory), chat_template="{{ messages[1]['content'] }}")
    assert explicit.encode_chat(MESSAGES) == ids(hf, "hello world")


def test_named_templates_use_the_default_one(tmp_path: Path, hf: Tokenizer) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "the lazy dog"},
            {"name": "default", "template": "the quick fox"},
        ]
    }
    tok = load_tokenizer(str(model_dir(tmp_path, config)))
    assert tok.encode_chat(MESSAGES) == ids(hf, "the quick fox")


def test_without_a_template_chat_falls_back_to_the_plain_format(
    tmp_path: Path, hf: Tokenizer
) -> None:
    tok = load_tokenizer(str(model_dir(tmp_path, {"bos_token": "<s>"})))
    assert tok.encode_chat(MESSAGES) == ids(hf, render_chat_plain(MESSAGES))


def test_transformers_template_helpers_are_available() -> None:
    chat = JinjaChat(
        "{% generation %}{{ messages | tojson }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}"
        "{% endfor %}{{ strftime_now('%Y') | length }}",
        {},
    )
    out = chat.render([{"role": "user", "content": "héllo"}, {"role": "bot", "content": "x"}])
    assert out == '[{"role": "user", "content": "héllo"}, {"role": "bot", "content": "x"}]|user4'


def test_a_template_refusing_the_messages_is_a_value_error() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    )
    tok = load_tokenizer("bytes", chat_template=source)
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.encode_chat(MESSAGES)
    assert tok.encode_chat(MESSAGES[1:]) == []  # renders to nothing: accepted


def test_the_template_runs_sandboxed_and_cannot_mutate_the_request() -> None:
    tok = load_tokenizer("bytes", chat_template="{{ messages.append(1) }}")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template refused"):
        tok.encode_chat(messages)
    assert messages == [{"role": "user", "content": "hi"}]


# --- loading errors -------------------------------------------------------------------------


def test_loading_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        load_tokenizer(str(tmp_path / "broken.json"))
    bad_config = model_dir(tmp_path / "m1")
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_tokenizer(str(bad_config))
    bad_template = model_dir(tmp_path / "m2", {"chat_template": "{% for %}"})
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(str(bad_template))


@pytest.mark.parametrize("module", ["tokenizers", "jinja2"])
def test_a_missing_hf_extra_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    directory = model_dir(tmp_path, standard_config())
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, module, None)  # type: ignore[arg-type]
    with pytest.raises(ImportError, match=r"pip install 'kvrouter\[hf\]'"):
        load_tokenizer(str(directory))
