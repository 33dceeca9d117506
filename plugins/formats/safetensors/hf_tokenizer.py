"""The ``hf`` tokenizer backend: ``tokenizer.json`` through Hugging Face ``tokenizers``.

It behaves as ``transformers`` 5 loads the same folder: the special tokens
``tokenizer_config.json`` names are added when ``tokenizer.json`` lacks them, and
``tokenizer.json``'s post-processor alone decides what ``add_special_tokens`` adds (transformers 5
drops the config's ``add_bos_token``/``add_eos_token`` whenever a ``tokenizer.json`` exists).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.tokenizer import TokenBytes
from mlxr_plugins.formats.safetensors.tokenizer import FolderTokenizer, added_tokens, token_text

if TYPE_CHECKING:
    import tokenizers

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def clean_up_tokenization(text: str) -> str:
    """``transformers``' clean-up of spaces before punctuation (WordPiece-era vocabularies)."""
    for spaced, joined in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(spaced, joined)
    return text


class HFTokenizer(FolderTokenizer):
    """A :class:`~mlxr_core.model.tokenizer.Tokenizer` over a ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: dict[str, Any],
        data: dict[str, Any],
        chat_template: str | None,
    ):
        self._backend = backend
        specials = {
            token.content: i
            for i, token in backend.get_added_tokens_decoder().items()
            if token.special
        }
        self._set_specials(
            config=config,
            data=data,
            token_id=backend.token_to_id,
            specials=specials,
            size=backend.get_vocab_size(with_added_tokens=True),
            chat_template=chat_template,
        )
        # What the post-processor prepends is the truth about BOS, whatever the config says.
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        self.add_bos = (
            self.bos_token_id is not None
            and len(full) > len(plain)
            and full[0] == self.bos_token_id
        )
        # transformers 5 skips the clean-up for BPE models: it would eat real spaces.
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE"
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts map to their ids."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocab decode to nothing, incomplete UTF-8 to U+FFFD."""
        valid = [i for i in ids if i >= 0]  # tokenizers drops unknown ids but rejects negative ones
        text: str = self._backend.decode(valid, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def token_bytes(self) -> TokenBytes:
        """Each id's bytes, read from its vocab string as the decoder would render it alone:
        byte-level BPE through GPT-2's byte table, otherwise ``<0xNN>`` byte fallback and ``▁``
        as a space. Added tokens are their text."""
        backend = self._backend
        added = backend.get_added_tokens_decoder()
        byte_level = "ByteLevel" in _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
        table = _unicode_to_byte()
        pieces: list[bytes] = []
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            text = added[i].content if i in added else backend.id_to_token(i)
            if text is None:
                pieces.append(b"")
            elif i in added:
                pieces.append(text.encode())
            elif byte_level and all(c in table for c in text):
                pieces.append(bytes(table[c] for c in text))
            elif not byte_level and (byte := _BYTE_PIECE.fullmatch(text)):
                pieces.append(bytes([int(byte.group(1), 16)]))
            else:
                pieces.append(text.replace("\u2581", " ").encode())
        special = frozenset(i for i, token in added.items() if token.special)
        return TokenBytes(pieces=pieces, special=special)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(decoder: Any) -> set[str]:
    """The ``type`` of a ``tokenizer.json`` decoder and of the decoders a Sequence holds."""
    if not isinstance(decoder, dict):
        return set()
    kinds = {str(decoder.get("type"))}
    for inner in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(inner)
    return kinds


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable character -> byte table of byte-level BPE vocabularies."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return {chr(b) if b in printable else chr(next(shifted)): b for b in range(256)}


class HFTokenizerBackend:
    """Builds an :class:`HFTokenizer` from a folder's ``tokenizer.json`` and its config."""

    def build(self, data: dict[str, Any], *, chat_template: str | None) -> HFTokenizer:
        """Build the tokenizer; ModelLoadError naming the file when it cannot be read."""
        from tokenizers import AddedToken, Tokenizer

        path = str(data["file"])
        try:
            backend = Tokenizer.from_file(path)
        except Exception as exc:
            raise ModelLoadError(f"unreadable tokenizer.json: {exc}", path=path) from exc
        config: dict[str, Any] = data.get("tokenizer_config") or {}
        rows, words = data.get("vocab_size"), backend.get_vocab_size(with_added_tokens=False)
        if isinstance(rows, int) and rows < words:
            # Ids past the embedding's last row would read memory that is not the model's.
            raise ModelLoadError(
                f"{words} tokens, but config.json's vocab_size gives the embedding {rows} rows",
                path=path,
                key="vocab_size",
            )

        missing = [
            AddedToken(text, special=special, normalized=False)
            for text, special in [
                *((token_text(config.get(key)), True) for key in SPECIAL_KEYS),
                *added_tokens(config).values(),
            ]
            if text and backend.token_to_id(text) is None
        ]
        backend.add_special_tokens([token for token in missing if token.special])
        backend.add_tokens([token for token in missing if not token.special])

        if config.get("split_special_tokens"):
            backend.encode_special_tokens = True
        return HFTokenizer(backend, config=config, data=data, chat_template=chat_template)
