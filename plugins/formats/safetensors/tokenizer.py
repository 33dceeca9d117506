"""The tokenizer files of a model folder, and what the three tokenizer backends share.

A folder ships one of: ``tokenizer.json`` (Hugging Face ``tokenizers``, kind ``"hf"``), a
SentencePiece model (``tokenizer.model``, kind ``"sentencepiece"``) or a tiktoken BPE rank file
(``*.tiktoken``, or a ``tokenizer.model`` that holds ranks rather than a protobuf, kind
``"tiktoken"``); the first present in that order wins, as in ``transformers``. Next to it,
``tokenizer_config.json`` names the special tokens, whether BOS/EOS are added, and the chat template
(also found in ``chat_template.jinja`` or ``chat_template.json``).

The :class:`~mlxr_core.model.checkpoint.TokenizerSpec` a folder yields carries paths and parsed
JSON only; the backends import their libraries when a model loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mlxr_core.model.checkpoint import TokenizerSpec
from mlxr_core.model.tokenizer import ChatTemplating
from mlxr_plugins.formats.safetensors.files import read_json

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
TIKTOKEN_FILES = ("tiktoken.model", "tokenizer.model")
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"

#: The first line of a tiktoken rank file: a base64 token, a space, its rank.
_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")

# Texts of special tokens that end a turn or a document in the chat formats we know (ChatML,
# Gemma, Llama 3, Phi-3 ...): like the GGUF tokenizer, generation stops on them even when the
# configs declare only the document end (a base model prompted with its own chat template).
END_OF_TURN_TEXTS = frozenset(
    {
        "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
    }
)  # fmt: skip


def _is_rank_file(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return _RANK_LINE.fullmatch(handle.readline(4096)) is not None
    except OSError:
        return False


def tokenizer_spec(
    folder: Path, *, eos_token_ids: Iterable[int] = (), vocab_size: int | None = None
) -> TokenizerSpec | None:
    """The tokenizer a folder ships, or None when it ships none.

    ``eos_token_ids`` are the ids ``config.json`` and ``generation_config.json`` declare; they end
    generation besides the tokenizer's own EOS. ``vocab_size`` is the embedding table's row count.
    """
    config_path = folder / TOKENIZER_CONFIG
    config = read_json(config_path) if config_path.is_file() else {}
    data: dict[str, Any] = {
        "tokenizer_config": config,
        "eos_token_ids": sorted(set(eos_token_ids)),
        "vocab_size": vocab_size,
    }
    if (folder / TOKENIZER_JSON).is_file():
        return TokenizerSpec(kind="hf", data={**data, "file": str(folder / TOKENIZER_JSON)})
    for name in SENTENCEPIECE_FILES:
        if (folder / name).is_file() and not _is_rank_file(folder / name):
            return TokenizerSpec(kind="sentencepiece", data={**data, "file": str(folder / name)})
    ranks = sorted(folder.glob("*.tiktoken")) + [folder / name for name in TIKTOKEN_FILES]
    for path in ranks:
        if path.is_file() and _is_rank_file(path):
            return TokenizerSpec(kind="tiktoken", data={**data, "file": str(path)})
    return None


def read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s, else
    ``chat_template.json``'s. Of a list of named templates, the one named ``default``."""
    if (folder / CHAT_TEMPLATE_JINJA).is_file():
        return (folder / CHAT_TEMPLATE_JINJA).read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / CHAT_TEMPLATE_JSON).is_file():
        template = read_json(folder / CHAT_TEMPLATE_JSON).get("chat_template")
    if isinstance(template, list):
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict) and isinstance(entry.get("template"), str)
        }
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def added_tokens(config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """``added_tokens_decoder``: id -> (text, special)."""
    found: dict[int, tuple[str, bool]] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        text = token_text(entry)
        if text is not None and str(key).isdigit():
            found[int(key)] = (text, bool(entry.get("special", True)))
    return found


def end_of_generation_ids(
    declared: Iterable[int | None], specials: dict[str, int]
) -> frozenset[int]:
    """The declared end ids plus every special token whose text is a known end-of-turn marker.

    gpt-oss (Harmony) ends a turn with ``<|return|>`` or ``<|call|>``, and ends only a message
    with ``<|end|>`` (the reply goes on in another channel): there ``<|end|>`` is not an end.
    """
    known = {text: i for text, i in specials.items() if text in END_OF_TURN_TEXTS}
    if "<|return|>" in specials and "<|call|>" in specials:
        known.pop("<|end|>", None)
        known.update({text: specials[text] for text in ("<|return|>", "<|call|>")})
    return frozenset({i for i in declared if i is not None} | set(known.values()))


class FolderTokenizer(ChatTemplating):
    """The parts of the :class:`~mlxr_core.model.tokenizer.Tokenizer` protocol every backend
    shares: special tokens, end ids and the chat template. Subclasses encode and decode."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    chat_template: str | None

    def _set_specials(
        self,
        *,
        config: dict[str, Any],
        data: dict[str, Any],
        token_id: Callable[[str], int | None],
        specials: dict[str, int],
        size: int,
        chat_template: str | None,
    ) -> None:
        """Resolve BOS/EOS (texts in ``tokenizer_config.json``) through ``token_id``, the end ids
        (the configs' and the known end-of-turn ``specials``) and the vocab size, at least the
        embedding's row count."""
        self.bos_token = token_text(config.get("bos_token"))
        self.eos_token = token_text(config.get("eos_token"))
        self.bos_token_id = token_id(self.bos_token) if self.bos_token is not None else None
        eos_id = token_id(self.eos_token) if self.eos_token is not None else None
        self.eos_token_ids = end_of_generation_ids(
            [eos_id, *data.get("eos_token_ids", ())], specials
        )
        self.vocab_size = max(size, int(data.get("vocab_size") or 0))
        self.chat_template = chat_template

