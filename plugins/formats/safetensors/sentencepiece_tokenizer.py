"""The ``sentencepiece`` tokenizer backend: a ``tokenizer.model`` through the sentencepiece library.

Text between special tokens is encoded by SentencePiece itself, so ids match it exactly. The
special tokens (``tokenizer_config.json``'s ``added_tokens_decoder`` and its BOS/EOS/UNK) are split
out of the text first and map to their ids, as Hugging Face's slow tokenizers and llama.cpp do;
each piece of text after one is encoded on its own, so it gets SentencePiece's dummy space prefix
again (``transformers``' ``legacy=True``, llama.cpp's behaviour).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import MissingDependency, ModelLoadError
from mlxr_core.model.tokenizer import TokenBytes
from mlxr_plugins.formats.safetensors.tokenizer import FolderTokenizer, added_tokens, token_text

if TYPE_CHECKING:
    import sentencepiece

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token")


class SentencePieceTokenizer(FolderTokenizer):
    """A :class:`~mlxr_core.model.tokenizer.Tokenizer` over a ``SentencePieceProcessor``."""

    def __init__(
        self,
        processor: sentencepiece.SentencePieceProcessor,
        *,
        config: dict[str, Any],
        data: dict[str, Any],
        chat_template: str | None,
    ):
        self._sp = processor
        self._size = processor.get_piece_size()
        added = added_tokens(config)
        #: Texts matched in the input before SentencePiece runs -> their ids.
        self._matched = {text: i for i, (text, _) in added.items()}
        for key in SPECIAL_KEYS:
            text = token_text(config.get(key))
            if text is not None and text not in self._matched and self._piece_id(text) is not None:
                self._matched[text] = self._piece_id(text)  # type: ignore[assignment]
        if not config.get("bos_token") and processor.bos_id() >= 0:
            config = {**config, "bos_token": processor.id_to_piece(processor.bos_id())}
        if not config.get("eos_token") and processor.eos_id() >= 0:
            config = {**config, "eos_token": processor.id_to_piece(processor.eos_id())}

        #: Pieces SentencePiece decodes to nothing: control pieces and the unknown piece.
        silent = {
            i for i in range(self._size) if processor.is_control(i) or processor.is_unknown(i)
        }
        #: Ids skipped by ``skip_special_tokens``: silent pieces and special added tokens.
        self._special = silent | {i for i, (_, special) in added.items() if special}
        #: Text of the ids SentencePiece cannot render: silent pieces, tokens beyond its vocab.
        self._text = {i: processor.id_to_piece(i) for i in silent} | {
            i: text for i, (text, _) in added.items() if i >= self._size
        }
        self._split = (
            re.compile("|".join(re.escape(t) for t in sorted(self._matched, key=len, reverse=True)))
            if self._matched
            else None
        )
        specials = {text: i for text, i in self._matched.items() if i in self._special}
        self._set_specials(
            config=config,
            data=data,
            token_id=lambda text: self._matched.get(text, self._piece_id(text)),
            specials=specials,
            size=max([self._size, *(i + 1 for i in added)]),
            chat_template=chat_template,
        )
        self.add_bos = bool(config.get("add_bos_token", True)) and self.bos_token_id is not None
        eos_id = self._matched.get(self.eos_token or "", self._piece_id(self.eos_token or ""))
        self._eos_id = eos_id if config.get("add_eos_token", False) else None

    def _piece_id(self, text: str) -> int | None:
        i = self._sp.piece_to_id(text)
        return i if 0 <= i < self._size and self._sp.id_to_piece(i) == text else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts map to their ids."""
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text) if self._split else ():
            if match.start() > start:
                ids.extend(self._sp.encode(text[start : match.start()]))
            ids.append(self._matched[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self._sp.encode(text[start:]))
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocab decode to nothing, incomplete UTF-8 to U+FFFD."""
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if skip_special_tokens and i in self._special:
                continue
            if i in self._text:
                parts.append(self._sp.decode(run))
                run = []
                parts.append(self._text[i])
            elif 0 <= i < self._size:
                run.append(i)  # user-defined pieces too: SentencePiece renders them as their text
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def token_bytes(self) -> TokenBytes:
        """Each id's bytes: ``<0xNN>`` pieces their byte, ``▁`` a space, special ids their text."""
        pieces = [b""] * max([self._size, *(i + 1 for i in self._text)])
        for i in range(self._size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                pieces[i] = bytes([int(piece[3:5], 16)])
            else:
                pieces[i] = piece.replace("\u2581", " ").encode()
        for i, text in self._text.items():
            pieces[i] = text.encode()
        return TokenBytes(pieces=pieces, special=frozenset(self._special))


class SentencePieceTokenizerBackend:
    """Builds a :class:`SentencePieceTokenizer` from a folder's ``tokenizer.model``."""

    def build(self, data: dict[str, Any], *, chat_template: str | None) -> SentencePieceTokenizer:
        """Build the tokenizer; ModelLoadError naming the file when it cannot be read."""
        try:
            import sentencepiece
        except ImportError:
            raise MissingDependency(
                "sentencepiece",
                "a SentencePiece tokenizer (tokenizer.model)",
                extra="sentencepiece",
            ) from None
        path = str(data["file"])
        try:
            processor = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as exc:
            raise ModelLoadError(f"unreadable SentencePiece model: {exc}", path=path) from exc
        return SentencePieceTokenizer(
            processor,
            config=data.get("tokenizer_config") or {},
            data=data,
            chat_template=chat_template,
        )
