"""Small tokenizers of each family the engines serve, saved as the Hugging Face hub ships them.

Each family is a byte-pair model trained here in milliseconds on a few hundred generated
sentences, written as `tokenizer.json` + `tokenizer_config.json` (its class, special tokens and
the chat template) + `config.json` (the `model_type` that `AutoTokenizer` keys on). The
pipelines are the families' own, so loading them exercises what a real checkpoint does:

- `qwen`: byte-level BPE with the GPT-2 split regex, `Qwen2Tokenizer`; `<|im_start|>`,
  `<|im_end|>` special, `<think>`/`<tool_call>` added but not special.
- `llama3`: byte-level BPE with the tiktoken-style split regex and a BOS post-processor,
  loaded as a plain `PreTrainedTokenizerFast` (the JSON is used as written).
- `mistral`: a Llama-2-style sentencepiece JSON (Prepend/Replace normalizer, byte fallback)
  under `LlamaTokenizer` / `model_type: mistral`, which transformers rebuilds (Metaspace
  pre-tokenizer, no normalizer) on load: the JSON as written gives other ids.
- `gemma`: sentencepiece-style BPE under `GemmaTokenizer`.
- `llama2`: the same legacy sentencepiece JSON as `mistral`, with ChatML special tokens, under
  `model_type: llama` (the issue's `'Y','ou'` vs `'▁You'` row).

And for the hold-out templates (`HOLDOUT_TEMPLATES`), the families of their models:

- `tekken` (Mistral Nemo, Small 3.x, Devstral): byte-level, `[INST]`-style control tokens, BOS.
- `deepseek` (V3, R1 and its distills): byte-level under `LlamaTokenizerFast`, fullwidth-bar
  control tokens, BOS.
- `phi3` (Phi-3.5): legacy sentencepiece whose chat tokens strip the whitespace on their right
  (`rstrip`), as Phi-3's do.
- `phi4` (Phi-4-mini), `granite`: byte-level under `GPT2Tokenizer`.
- `cohere` (Command R / R7B): byte-level under `CohereTokenizer`, `<BOS_TOKEN>`.
- `hermes` (Hermes 2 Pro / 3): the Llama 3 vocabulary with ChatML tokens, `<tool_call>` text.
- `harmony` (gpt-oss): byte-level with the harmony control tokens.

`build_model_dir(root, family, template)` writes one (`template` may be a list of named
templates, as the hub stores them); `FIXTURE_TEMPLATES` pairs every fixture template
(tests/fixtures/chat_templates/) with the family its model ships with.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Final

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

TEMPLATES_DIR: Final = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

# template file -> tokenizer family of the model that ships it
FIXTURE_TEMPLATES: Final = {
    "chatml.jinja": "llama2",
    "llama3.1_instruct.jinja": "llama3",
    "qwen3.jinja": "qwen",
    "qwen3_4b_2507.jinja": "qwen",
    "mistral_v0.3.jinja": "mistral",
    "gemma3.jinja": "gemma",
}

_WORDS: Final = (  # noqa: SIM905 - a sentence reads better than 60 quoted words
    "you are a helpful assistant the weather in paris today is sunny and warm what time "
    "is it please call the function get_weather with city name arguments result tool "
    "answer question hello world thank very much think step by step first second then "
    "json object value key list number string true false null search query document "
    "title text summary résumé naïve café 東京 天気 données über straße 😀 🚀"
).split()
_PUNCT: Final = [".", ",", "?", "!", ":", ";", '"', "'", "(", ")", "{", "}", "[", "]", "\n", "  "]

# GPT-2's split (Qwen2) and the tiktoken cl100k-style split (Llama 3).
_GPT2_SPLIT: Final = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TIKTOKEN_SPLIT: Final = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN_SPECIAL: Final = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED: Final = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]
LLAMA3_SPECIAL: Final = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]
MISTRAL_SPECIAL: Final = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
GEMMA_SPECIAL: Final = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LLAMA2_SPECIAL: Final = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def corpus(n: int = 400, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        words[0] = words[0].capitalize()
        lines.append(
            " ".join(w + (rng.choice(_PUNCT) if rng.random() < 0.2 else "") for w in words)
        )
    return lines


def bench_corpus(limit_chars: int = 4_000_000) -> list[str]:
    """Python's own standard library sources: megabytes of real text (code, prose, English)."""
    import sysconfig

    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total >= limit_chars:
            break
    return texts


def _byte_level_json(
    special: list[str],
    added: list[str],
    split: str,
    vocab_size: int,
    lines: list[str],
    nfc: bool,
    rstrip: frozenset[str] = frozenset(),
) -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=_regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    doc = json.loads(tok.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    doc["added_tokens"] = _added_tokens(len(vocab), special, added, rstrip)
    doc["normalizer"] = {"type": "NFC"} if nfc else None
    doc["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    return doc


def _regex(pattern: str) -> Any:
    from tokenizers import Regex

    return Regex(pattern)


def _sentencepiece_json(
    special: list[str], vocab_size: int, legacy: bool, rstrip: frozenset[str] = frozenset()
) -> dict:
    """A BPE with byte fallback over `▁`-joined words, the way sentencepiece converts."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    doc = json.loads(tok.to_str())
    trained: dict[str, int] = doc["model"]["vocab"]
    # Real sentencepiece vocabularies start with the specials, then the 256 byte pieces.
    pieces = [*special, *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    for piece in sorted(trained, key=trained.__getitem__):
        vocab.setdefault(piece, len(vocab))
    doc["model"]["vocab"] = vocab
    doc["added_tokens"] = [
        {
            "id": vocab[t],
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": t in rstrip,
            "normalized": False,
            "special": True,
        }
        for t in special
    ]
    if legacy:
        doc["pre_tokenizer"] = None
    else:
        doc["normalizer"] = None
        doc["pre_tokenizer"] = {
            "type": "Metaspace",
            "replacement": "▁",
            "prepend_scheme": "first",
            "split": False,
        }
    doc["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return doc


def _added_tokens(
    first_id: int, special: list[str], added: list[str], rstrip: frozenset[str] = frozenset()
) -> list[dict]:
    return [
        {
            "id": first_id + i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": t in rstrip,
            "normalized": False,
            "special": t in special,
        }
        for i, t in enumerate([*special, *added])
    ]


def _bos_post_processor(bos: str, bos_id: int) -> dict:
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


@dataclass(frozen=True)
class HoldoutFamily:
    """A tokenizer family of a hold-out template's model: its pipeline and its two configs."""

    special: tuple[str, ...]
    tokenizer_config: dict[str, Any]
    model_type: str
    added: tuple[str, ...] = ()  # added tokens that are not special
    kind: str = "byte_level"  # or "sentencepiece" (legacy, with a Prepend/Replace normalizer)
    split: str = _TIKTOKEN_SPLIT
    nfc: bool = False
    bos: str | None = None  # a BOS post-processor (completion prompts get it)
    rstrip: frozenset[str] = field(default_factory=frozenset)

    @property
    def configs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.tokenizer_config, {"model_type": self.model_type}


_MISTRAL_CONTROL: Final = (
    *("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"),
    *("[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
    *("[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"),
)


def _deepseek(name: str) -> str:
    """DeepSeek's control tokens are written with fullwidth bars: <\uff5cname\uff5c>."""
    return f"<\uff5c{name}\uff5c>"


_DEEPSEEK_BOS: Final = _deepseek("begin▁of▁sentence")
_DEEPSEEK_EOS: Final = _deepseek("end▁of▁sentence")
_DEEPSEEK_ADDED: Final = (
    _deepseek("User"),
    _deepseek("Assistant"),
    "<think>",
    "</think>",
    *(
        _deepseek(f"tool▁{name}")
        for name in (
            *("calls▁begin", "calls▁end", "call▁begin", "call▁end", "outputs▁begin"),
            *("outputs▁end", "output▁begin", "output▁end", "sep"),
        )
    ),
)
_PHI3_CHAT: Final = ("<|assistant|>", "<|end|>", "<|system|>", "<|user|>")
_COHERE_SPECIAL: Final = (
    *("<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>"),
    *("<EOP_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"),
    *("<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    *("<|START_ACTION|>", "<|END_ACTION|>", "<|START_THINKING|>", "<|END_THINKING|>"),
    *("<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"),
)

HOLDOUT_FAMILIES: Final[dict[str, HoldoutFamily]] = {
    "tekken": HoldoutFamily(
        special=("<unk>", "<s>", "</s>", *_MISTRAL_CONTROL),
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": 131072,
        },
        model_type="mistral",
        bos="<s>",
    ),
    "deepseek": HoldoutFamily(
        special=(_DEEPSEEK_BOS, _DEEPSEEK_EOS, _deepseek("▁pad▁")),
        added=_DEEPSEEK_ADDED,
        tokenizer_config={
            "tokenizer_class": "LlamaTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": _DEEPSEEK_BOS,
            "eos_token": _DEEPSEEK_EOS,
            "pad_token": _deepseek("▁pad▁"),
            "legacy": True,
            "model_max_length": 131072,
        },
        model_type="deepseek_v3",
        bos=_DEEPSEEK_BOS,
    ),
    "phi3": HoldoutFamily(
        special=("<unk>", "<s>", "</s>", "<|endoftext|>", *_PHI3_CHAT),
        kind="sentencepiece",
        rstrip=frozenset(_PHI3_CHAT),
        tokenizer_config={
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": 131072,
        },
        model_type="phi3",
        bos="<s>",
    ),
    "phi4": HoldoutFamily(
        special=(
            *("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
            *("<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>"),
            *("<|tool_response|>", "<|/tool_response|>"),
        ),
        split=_GPT2_SPLIT,
        tokenizer_config={
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "add_prefix_space": False,
            "model_max_length": 131072,
        },
        model_type="phi3",
    ),
    "granite": HoldoutFamily(
        special=(
            *("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
            *("<|start_of_cite|>", "<|end_of_cite|>"),
        ),
        split=_GPT2_SPLIT,
        tokenizer_config={
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": "<|end_of_text|>",
            "eos_token": "<|end_of_text|>",
            "unk_token": "<|end_of_text|>",
            "pad_token": "<|end_of_text|>",
            "add_prefix_space": False,
            "model_max_length": 131072,
        },
        model_type="granite",
    ),
    "cohere": HoldoutFamily(
        special=_COHERE_SPECIAL,
        split=_GPT2_SPLIT,
        nfc=True,
        bos="<BOS_TOKEN>",
        tokenizer_config={
            "tokenizer_class": "CohereTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<BOS_TOKEN>",
            "eos_token": "<|END_OF_TURN_TOKEN|>",
            "pad_token": "<PAD>",
            "unk_token": "<UNK>",
            "model_max_length": 131072,
        },
        model_type="cohere",
    ),
    "hermes": HoldoutFamily(
        special=(*LLAMA3_SPECIAL, "<|im_start|>", "<|im_end|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        bos="<|begin_of_text|>",
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|im_end|>",
            "model_max_length": 131072,
        },
        model_type="llama",
    ),
    "harmony": HoldoutFamily(
        special=(
            *("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>"),
            *("<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
        ),
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|startoftext|>",
            "eos_token": "<|return|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 131072,
        },
        model_type="gpt_oss",
    ),
}


def _holdout_family_json(family: HoldoutFamily, lines: list[str], size: int) -> str:
    special, added = list(family.special), list(family.added)
    if family.kind == "sentencepiece":
        doc = _sentencepiece_json(special, 700, legacy=True, rstrip=family.rstrip)
    else:
        doc = _byte_level_json(special, added, family.split, size, lines, family.nfc, family.rstrip)
    if family.bos is not None:
        bos_id = next(t["id"] for t in doc["added_tokens"] if t["content"] == family.bos)
        doc["post_processor"] = _bos_post_processor(family.bos, bos_id)
    return json.dumps(doc, ensure_ascii=False)


@cache
def _family_json(family: str, big: bool = False) -> str:
    """big: a 32k vocabulary trained on megabytes (benchmarks), else 700 on a few sentences."""
    lines, size = (bench_corpus(), 32_000) if big else (corpus(), 700)
    if family in HOLDOUT_FAMILIES:
        return _holdout_family_json(HOLDOUT_FAMILIES[family], lines, size)
    if family == "qwen":
        doc = _byte_level_json(QWEN_SPECIAL, QWEN_ADDED, _GPT2_SPLIT, size, lines, nfc=True)
    elif family == "llama3":
        doc = _byte_level_json(LLAMA3_SPECIAL, [], _TIKTOKEN_SPLIT, size, lines, nfc=False)
        bos_id = next(t["id"] for t in doc["added_tokens"] if t["content"] == "<|begin_of_text|>")
        doc["post_processor"] = _bos_post_processor("<|begin_of_text|>", bos_id)
    elif family == "mistral":
        doc = _sentencepiece_json(MISTRAL_SPECIAL, 700, legacy=True)
    elif family == "gemma":
        doc = _sentencepiece_json(GEMMA_SPECIAL, 700, legacy=False)
        doc["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        doc["pre_tokenizer"] = None
    elif family == "llama2":
        doc = _sentencepiece_json(LLAMA2_SPECIAL, 700, legacy=True)
    else:
        raise ValueError(f"unknown tokenizer family {family!r}")
    if family in ("mistral", "llama2", "gemma"):
        bos = "<bos>" if family == "gemma" else "<s>"
        doc["post_processor"] = _bos_post_processor(bos, doc["model"]["vocab"][bos])
    return json.dumps(doc, ensure_ascii=False)


_CONFIGS: Final[dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    # family: (tokenizer_config.json without the template, config.json)
    "qwen": (
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_prefix_space": False,
            "errors": "replace",
            "model_max_length": 131072,
            "split_special_tokens": False,
        },
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    ),
    "llama3": (
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "model_max_length": 131072,
            "clean_up_tokenization_spaces": True,
        },
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    ),
    "mistral": (
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": 32768,
        },
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
    ),
    "gemma": (
        {
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": 131072,
        },
        {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},
    ),
    "llama2": (
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "model_max_length": 4096,
        },
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    ),
}


def build_model_dir(
    root: Path, family: str, template: str | list[dict[str, str]] | None, *, big: bool = False
) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with `template`) and config.json.

    `big` (byte-level families only): a 32k vocabulary trained on the standard library's
    sources, as fast per token as a real model's (about a second to build)."""
    if big and family not in ("qwen", "llama3"):
        raise ValueError("big models are byte-level: qwen or llama3")
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(_family_json(family, big), encoding="utf-8")
    if family in HOLDOUT_FAMILIES:
        tokenizer_config, config = HOLDOUT_FAMILIES[family].configs
    else:
        tokenizer_config, config = _CONFIGS[family]
    doc = json.loads(_family_json(family, big))
    decoder = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": t["rstrip"],
            "single_word": False,
            "special": t["special"],
        }
        for t in doc["added_tokens"]
    }
    full = {**tokenizer_config, "added_tokens_decoder": decoder}
    if template is not None:
        full["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(full, ensure_ascii=False), "utf-8")
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def build_multimodal_model_dir(
    root: Path, tokenizer_template: str | None, processor_template: str
) -> Path:
    """A Llava-style directory on the qwen tokenizer whose processor has a chat template of
    its own, in `chat_template.json` as such models ship it (transformers' AutoProcessor
    loads a LlavaProcessor from it); the tokenizer has `tokenizer_template`, or none."""
    build_model_dir(root, "qwen", tokenizer_template)
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {"model_type": "qwen2"},
        "vision_config": {"model_type": "clip_vision_model"},
    }
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": 14,
        "vision_feature_select_strategy": "default",
        "image_token": "<|endoftext|>",
    }
    image_processor = {"image_processor_type": "CLIPImageProcessor", **processor}
    for name, document in (
        ("config.json", config),
        ("processor_config.json", processor),
        ("preprocessor_config.json", image_processor),
        ("chat_template.json", {"chat_template": processor_template}),
    ):
        (root / name).write_text(json.dumps(document), encoding="utf-8")
    return root


def fixture_template(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text(encoding="utf-8")


def build_fixture_model(root: Path, template_name: str) -> Path:
    """The model directory a fixture template ships in, with that template."""
    return build_model_dir(root, FIXTURE_TEMPLATES[template_name], fixture_template(template_name))


# --- hold-out templates -------------------------------------------------------------------
# Real templates the router was not written against, kept out of this repository (public
# material fetched as data): `KVROUTER_HOLDOUT_TEMPLATES`, else the first
# `shared/fixtures/chat_templates_holdout` above this checkout. Its README.md names each one's
# source. Template file (or a model with named templates) -> the family its model ships with.
HOLDOUT_TEMPLATES: Final = {
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "llama3",
    "meetkai-functionary-medium-v3.1.jinja": "llama3",
    "meetkai-functionary-medium-v3.2.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "tekken",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "tekken",
    "unsloth-mistral-Devstral-Small-2507.jinja": "tekken",
    "google-gemma-2-2b-it.jinja": "gemma",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "qwen",
    "Qwen-QwQ-32B.jinja": "qwen",
    "deepseek-ai-DeepSeek-V3.jinja": "deepseek",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "deepseek",
    "microsoft-Phi-3.5-mini-instruct.jinja": "phi3",
    "microsoft-Phi-4-mini-instruct.jinja": "phi4",
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "granite",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "cohere",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "cohere",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "openai-gpt-oss-120b.jinja": "harmony",
    # Hermes 3 as the hub ships it: a default template and a tool_use one, picked per request.
    "NousResearch-Hermes-3-Llama-3.1 (default + tool_use)": "hermes",
}
_NAMED_HOLDOUTS: Final = {
    "NousResearch-Hermes-3-Llama-3.1 (default + tool_use)": {
        "default": "NousResearch-Hermes-3-Llama-3.1-70B-default.jinja",
        "tool_use": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    }
}


def holdout_dir() -> Path | None:
    """Where the hold-out templates are, or None (the tests that need them say so)."""
    configured = os.environ.get("KVROUTER_HOLDOUT_TEMPLATES")
    if configured:
        return Path(configured)
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "fixtures" / "chat_templates_holdout"
        if candidate.is_dir():
            return candidate
    return None


def build_holdout_model(root: Path, name: str, directory: Path) -> Path:
    """The model directory of a hold-out template (`directory` holds the template files)."""
    named = _NAMED_HOLDOUTS.get(name)
    template: str | list[dict[str, str]]
    if named is None:
        template = (directory / name).read_text(encoding="utf-8")
    else:
        template = [
            {"name": n, "template": (directory / f).read_text(encoding="utf-8")}
            for n, f in named.items()
        ]
    return build_model_dir(root, HOLDOUT_TEMPLATES[name], template)
