"""The ``tiktoken`` tokenizer backend: a BPE rank file through the tiktoken library.

Some families ship their vocabulary as tiktoken's rank file (one ``base64(token) rank`` line per
mergeable token) rather than a ``tokenizer.json``. The file holds neither the word-splitting pattern
nor the special tokens: the special tokens come from ``tokenizer_config.json``'s
``added_tokens_decoder`` and the pattern from its ``pat_str`` (or ``pattern``) key, defaulting to
the cl100k / Llama 3 pattern most of these families use.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import MissingDependency, ModelLoadError
from mlxr_core.model.tokenizer import TokenBytes
from mlxr_plugins.formats.safetensors.tokenizer import FolderTokenizer, added_tokens

if TYPE_CHECKING:
    import tiktoken

log = logging.getLogger(__name__)

#: cl100k's split pattern, which Llama 3 and most tiktoken-vocab families use.
DEFAULT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_ranks(path: Path) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken file; ModelLoadError naming the line that is not one.

    Parsed here rather than with ``tiktoken.load.load_tiktoken_bpe``, which caches files by path
    in a temporary folder and would serve a stale copy of a file rewritten in place.
    """
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ModelLoadError(f"unreadable rank file: {exc}", path=str(path)) from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ModelLoadError(
                f"line {number} is not 'base64-token rank': {line[:60]!r}", path=str(path)
            ) from None
    if not ranks:
        raise ModelLoadError("the rank file holds no tokens", path=str(path))
    return ranks


class TiktokenTokenizer(FolderTokenizer):
    """A :class:`~mlxr_core.model.tokenizer.Tokenizer` over a ``tiktoken.Encoding``."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        *,
        ranks: dict[bytes, int],
        config: dict[str, Any],
        data: dict[str, Any],
        chat_template: str | None,
    ):
        self._encoding = encoding
        added = added_tokens(config)
        self._special = {i for i, (_, special) in added.items() if special}
        self._known = set(ranks.values()) | set(added)
        by_text = {text: i for i, (text, _) in added.items()}
        self._set_specials(
            config=config,
            data=data,
            token_id=by_text.get,
            specials={text: i for text, i in by_text.items() if i in self._special},
            size=max(self._known) + 1,
            chat_template=chat_template,
        )
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_id = by_text.get(self.eos_token or "")
        self._eos_id = eos_id if config.get("add_eos_token", False) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts map to their ids."""
        ids: list[int] = self._encoding.encode(text, allowed_special="all")
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocab decode to nothing, incomplete UTF-8 to U+FFFD."""
        skipped = self._special if skip_special_tokens else set()
        kept = [i for i in ids if i in self._known and i not in skipped]
        return self._encoding.decode_bytes(kept).decode("utf-8", errors="replace")

    def token_bytes(self) -> TokenBytes:
        """Each id's bytes as the encoding holds them (ranks and added tokens alike)."""
        pieces = [
            self._encoding.decode_single_token_bytes(i) if i in self._known else b""
            for i in range(max(self._known) + 1)
        ]
        return TokenBytes(pieces=pieces, special=frozenset(self._special))


class TiktokenTokenizerBackend:
    """Builds a :class:`TiktokenTokenizer` from a rank file and ``tokenizer_config.json``."""

    def build(self, data: dict[str, Any], *, chat_template: str | None) -> TiktokenTokenizer:
        """Build the tokenizer; ModelLoadError naming the file when it cannot be used."""
        try:
            import tiktoken
        except ImportError:
            raise MissingDependency(
                "tiktoken", "a tiktoken BPE vocabulary (rank file)", extra="tiktoken"
            ) from None
        path = Path(data["file"])
        config: dict[str, Any] = data.get("tokenizer_config") or {}
        ranks = read_ranks(path)
        pattern = config.get("pat_str") or config.get("pattern")
        if not isinstance(pattern, str):
            log.info("%s: no pat_str in tokenizer_config.json; using the cl100k pattern", path.name)
            pattern = DEFAULT_PATTERN
        specials = {text: i for i, (text, _) in added_tokens(config).items()}
        try:
            encoding = tiktoken.Encoding(
                path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as exc:
            raise ModelLoadError(
                f"cannot build the tiktoken encoding: {exc}", path=str(path)
            ) from exc
        return TiktokenTokenizer(
            encoding, ranks=ranks, config=config, data=data, chat_template=chat_template
        )
