"""The tokenizer embedded in a GGUF file (``tokenizer.ggml.*``), built on Hugging Face ``tokenizers``.

Two vocab kinds are supported, and both aim at llama.cpp's own ids byte for byte:

- ``"gpt2"``: byte-level BPE with ranked merges; the word-splitting regexes are chosen by
  ``tokenizer.ggml.pre`` exactly as llama.cpp chooses them (``llama-vocab.cpp``).
- ``"llama"``: a SentencePiece vocab with scores (Llama 2, Gemma ...). llama.cpp merges the adjacent
  pair whose joined text is the best-scored token; that is a BPE whose merge ranks are the scores,
  so the merges are derived from the vocab once and handed to the same BPE model, with ``<0xNN>``
  byte fallback and ``▁`` for spaces.

Control, user-defined and unknown tokens are split out of the raw text before the model runs (as
llama.cpp does with ``parse_special``), so ``<|im_start|>`` encodes to its single id. Decoding goes
through a per-id table of bytes, the same pieces llama.cpp's ``token_to_piece`` writes.

:meth:`GGUFTokenizer.hf_files` writes the same tokenizer as a Hugging Face folder's
``tokenizer.json`` and ``tokenizer_config.json`` (``mlxr convert``): mlxr, transformers and mlx-lm
load it without the GGUF, and without transformers' own GGUF converter (or torch).
"""

from __future__ import annotations

import enum
import json
import logging
import numbers
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.tokenizer import ChatTemplating, TokenBytes

if TYPE_CHECKING:
    import gguf
    import tokenizers

log = logging.getLogger(__name__)

PREFIX = "tokenizer.ggml."


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (SentencePiece's piece types)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Word-splitting regexes per ``tokenizer.ggml.pre``, applied in order, each isolating its matches
# (llama.cpp's ``unicode_regex_split``). These are llama.cpp's spellings: where it rewrote a
# case-insensitive group as explicit classes, so do we, since Unicode case folding would differ.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}", 1)

#: name -> (regexes, ignore_merges, add_bos default)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
        False,
        False,
    ),
    "gpt2": ((_GPT2,), False, False),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "llama3": ((_LLAMA3,), True, True),
    "qwen2": ((_QWEN2,), False, False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False, False),
}
_PRE_ALIASES = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4"), "gpt2"),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "smollm"
    ),
    **dict.fromkeys(("llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), "qwen2"),
}

# Texts of the control tokens that end a turn or a document in the chat formats we know
# (ChatML, Gemma, Llama 3, Phi-3, gpt-oss, DeepSeek ...); a subset of llama.cpp's EOG list.
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|return|>",
        "<|call|>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek
    }
)  # fmt: skip


def tokenizer_data_from_reader(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every ``tokenizer.ggml.*`` metadata field of ``reader`` as plain Python values.

    Strings stay ``str``, arrays become lists (``list[str]``, ``list[float]``, ``list[int]``),
    scalars become ``int``/``float``/``bool``. ``tokenizer.chat_template`` is not included: the
    checkpoint carries it separately.
    """
    data: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(PREFIX):
            data[key] = field.contents()
    return data


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabs."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_piece(text: str) -> bytes:
    table = _unicode_to_byte()
    if all(c in table for c in text):
        return bytes(table[c] for c in text)
    return text.encode()  # not a byte-level string: llama.cpp has no good answer, keep the text


class GGUFTokenizer(ChatTemplating):
    """A :class:`~mlxr_core.model.tokenizer.Tokenizer` over a GGUF vocab. Thread-safe."""

    def __init__(
        self,
        *,
        backend: tokenizers.Tokenizer,
        tokens: list[str],
        types: list[int],
        pieces: list[bytes],
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        strip_leading_space: bool,
        chat_template: str | None,
        byte_level: bool = True,
    ):
        self._backend = backend
        self._byte_level = byte_level
        self._types = types
        #: Decoded bytes of each id with special tokens skipped; ``_special`` holds their text.
        self._pieces = pieces
        self._special = {
            i: tokens[i].encode()
            for i, t in enumerate(types)
            if t in (TokenType.CONTROL, TokenType.UNKNOWN)
        }
        self._strip_leading_space = strip_leading_space
        self.vocab_size = len(tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.bos_token = tokens[bos_token_id] if bos_token_id is not None else None
        self.eos_token = tokens[eos_token_id] if eos_token_id is not None else None
        self.add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and eos_token_id is not None
        self._eos_token_id = eos_token_id
        self.chat_template = chat_template

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; control and user-defined token texts map to their single ids.

        With ``add_special_tokens``, BOS (and EOS) are added where the vocab asks for them.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._add_eos:
                ids.append(self._eos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out unless ``skip_special_tokens=False``.

        Ids outside the vocab decode to nothing; an incomplete UTF-8 sequence becomes U+FFFD.
        """
        pieces, n = self._pieces, len(self._pieces)
        if skip_special_tokens:
            parts = [pieces[i] if 0 <= i < n else b"" for i in ids]
        else:
            special = self._special
            parts = [special.get(i, pieces[i]) if 0 <= i < n else b"" for i in ids]
        if self._strip_leading_space:
            # The space encode prefixed goes again: from the first token that renders anything,
            # if it is a normal piece (as Hugging Face's Strip decoder does).
            for i, part in enumerate(parts):
                if part:
                    if part.startswith(b" ") and self._types[ids[i]] == TokenType.NORMAL:
                        parts[i] = part[1:]
                    break
        return b"".join(parts).decode("utf-8", errors="replace")

    def token_bytes(self) -> TokenBytes:
        """Each id's bytes: its decoded piece, or its text for a control/unknown token."""
        pieces = [self._special.get(i, piece) for i, piece in enumerate(self._pieces)]
        return TokenBytes(pieces=pieces, special=frozenset(self._special))

    def hf_files(self) -> dict[str, str]:
        """This tokenizer as a Hugging Face folder's files: ``tokenizer.json`` (the same model,
        pre-tokenizer and special tokens, plus the decoder and the BOS/EOS post-processor a
        Hugging Face tokenizer needs) and ``tokenizer_config.json`` (special tokens, chat template)."""
        from tokenizers import Tokenizer, decoders, processors

        backend = Tokenizer.from_str(self._backend.to_str())
        if self._byte_level:
            backend.decoder = decoders.ByteLevel()
        else:  # SentencePiece-style, as Hugging Face writes it (and mlx-lm recognizes)
            steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            if self._strip_leading_space:
                steps.append(decoders.Strip(" ", 1, 0))
            backend.decoder = decoders.Sequence(steps)
        bos = [self.bos_token] if self.add_bos and self.bos_token is not None else []
        eos = [self.eos_token] if self._add_eos and self.eos_token is not None else []
        if bos or eos:
            ids = {self.bos_token: self.bos_token_id, self.eos_token: self._eos_token_id}
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join([*bos, "$A", *eos]),
                pair=" ".join([*bos, "$A", *eos, *bos, "$B:1", *eos]),
                special_tokens=[(token, ids[token]) for token in dict.fromkeys([*bos, *eos])],
            )
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": self._add_eos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return {
            "tokenizer.json": backend.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        }



class GGUFTokenizerBackend:
    """Builds a :class:`GGUFTokenizer` from ``tokenizer.ggml.*`` metadata (see module docs)."""

    def build(self, data: dict[str, Any], *, chat_template: str | None) -> GGUFTokenizer:
        """Build the tokenizer; raise ModelLoadError when the metadata is unusable."""
        kind = data.get(PREFIX + "model")
        tokens: list[str] = list(data.get(PREFIX + "tokens") or [])
        if not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer.ggml.tokens")
        types = [
            int(t) for t in data.get(PREFIX + "token_type") or [TokenType.NORMAL] * len(tokens)
        ]
        if len(types) != len(tokens):
            raise ModelLoadError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )

        def token_id(key: str) -> int | None:
            value = data.get(PREFIX + key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ModelLoadError(f"{value!r} is not a token id", key=PREFIX + key)
            return int(value) if 0 <= int(value) < len(tokens) else None  # out of range: unused

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        if kind == "gpt2":
            backend, add_bos = _build_gpt2(data, tokens)
            pieces = [_byte_level_piece(t) for t in tokens]
            strip = False
        elif kind in ("llama", "gemma4"):
            build = _build_spm if kind == "llama" else _build_merged_spm
            backend, add_space_prefix = build(data, tokens, types)
            add_bos = True
            pieces = [t.replace("▁", " ").encode() for t in tokens]
            strip = add_space_prefix
        else:
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama, gemma4)",
                key="tokenizer.ggml.model",
            )
        for i, t in enumerate(types):
            if t == TokenType.BYTE:
                pieces[i] = _byte_token_value(i, tokens[i])
            elif t == TokenType.USER_DEFINED:
                pieces[i] = tokens[i].encode()  # user-defined texts are stored raw
            elif t != TokenType.NORMAL:
                pieces[i] = b""

        add_bos = bool(data.get(PREFIX + "add_bos_token", add_bos))
        add_eos = bool(data.get(PREFIX + "add_eos_token", False))
        _add_special_tokens(backend, tokens, types)
        return GGUFTokenizer(
            backend=backend,
            tokens=tokens,
            types=types,
            pieces=pieces,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=end_of_generation_ids(
                tokens, types, [eos, token_id("eot_token_id"), token_id("eom_token_id")]
            ),
            add_bos=add_bos,
            add_eos=add_eos,
            strip_leading_space=strip,
            chat_template=chat_template,
            byte_level=kind == "gpt2",
        )


def _byte_token_value(token_id: int, text: str) -> bytes:
    """The byte a ``<0xNN>`` token stands for."""
    try:
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
    except ValueError:
        pass
    raise ModelLoadError(f"token {token_id} is typed as a byte but reads {text!r}, not <0xNN>")


def end_of_generation_ids(
    tokens: list[str], types: list[int], declared: Sequence[int | None]
) -> frozenset[int]:
    """The ids that end generation: the declared eos/eot/eom ids, plus every control token whose
    text is a known end-of-turn or end-of-text marker (``<|im_end|>``, ``<end_of_turn>`` ...).

    A known text only counts when the vocab marks it control or user-defined (a normal piece
    spelling ``<|end|>`` is text). gpt-oss ends a message with ``<|end|>`` and then goes on in
    another channel, so ``<|end|>`` is left out when ``<|return|>`` and ``<|call|>`` exist.
    """
    specials = (TokenType.CONTROL, TokenType.USER_DEFINED)
    found = {t: i for i, t in enumerate(tokens) if t in _END_OF_TURN_TEXTS and types[i] in specials}
    if "<|return|>" in found and "<|call|>" in found:
        found.pop("<|end|>", None)
    return frozenset({i for i in declared if i is not None} | set(found.values()))


def _build_gpt2(data: dict[str, Any], tokens: list[str]) -> tuple[tokenizers.Tokenizer, bool]:
    """A byte-level BPE with llama.cpp's pre-tokenizer; returns it and the default add_bos."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    pre = data.get(PREFIX + "pre") or ""
    if not pre:
        log.warning("the GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer")
        pre = "default"
    name = _PRE_ALIASES.get(pre, pre)
    if name not in _PRE_TOKENIZERS:
        supported = ", ".join(sorted([*_PRE_TOKENIZERS, *_PRE_ALIASES]))
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")
    regexes, ignore_merges, add_bos = _PRE_TOKENIZERS[name]

    # A duplicated text keeps its last id, as in llama.cpp.
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _usable_merges(data, vocab, "gpt2")

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return backend, add_bos


def _build_spm(
    data: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[tokenizers.Tokenizer, bool]:
    """A SentencePiece-style BPE ranked by scores; returns it and whether it prefixes a space."""
    from tokenizers import Tokenizer, models, normalizers

    scores = data.get(PREFIX + "scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ModelLoadError(
            f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp may join any two adjacent symbols whose text is a token, best score first (ties:
    # leftmost); as BPE merges that is every split of every token, ranked by the token's score.
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()

    unk = data.get(PREFIX + "unknown_token_id")
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in ranked],
        unk_token=unk_token,
        byte_fallback=TokenType.BYTE in types,
    )
    backend = Tokenizer(model)
    add_space_prefix = bool(data.get(PREFIX + "add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    return backend, add_space_prefix


def _usable_merges(data: dict[str, Any], vocab: dict[str, int], kind: str) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, less those whose parts or result are not tokens; a
    ModelLoadError when none is left."""
    merges: list[tuple[str, str]] = []
    for merge in data.get(PREFIX + "merges") or []:
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    if not merges:
        raise ModelLoadError(f"the GGUF's {kind} tokenizer has no usable tokenizer.ggml.merges", key=PREFIX + "merges")
    return merges


def _build_merged_spm(
    data: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[tokenizers.Tokenizer, bool]:
    """A SentencePiece-style BPE (spaces as ``▁``, byte fallback) ranked by explicit merges, as
    llama.cpp's ``gemma4`` tokenizer model stores Gemma 4's: its ``tokenizer.json`` BPE, no space
    prefixed unless ``add_space_prefix`` says so. Returns it and whether it prefixes a space."""
    from tokenizers import Tokenizer, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _usable_merges(data, vocab, "gemma4")
    unk = data.get(PREFIX + "unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, byte_fallback=TokenType.BYTE in types)
    )
    add_space_prefix = bool(data.get(PREFIX + "add_space_prefix", False))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    return backend, add_space_prefix


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Make control, unknown and user-defined tokens match their raw text before the model runs."""
    from tokenizers import AddedToken

    def added(i: int, special: bool) -> AddedToken:
        return AddedToken(tokens[i], special=special, normalized=False, single_word=False)

    specials = (TokenType.CONTROL, TokenType.UNKNOWN)
    backend.add_special_tokens(
        [added(i, True) for i, t in enumerate(types) if t in specials and tokens[i]]
    )
    backend.add_tokens(
        [added(i, False) for i, t in enumerate(types) if t == TokenType.USER_DEFINED and tokens[i]]
    )
