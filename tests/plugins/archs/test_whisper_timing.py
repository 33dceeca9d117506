"""The numpy steps of Whisper's word timings against transformers 5.25's (dynamic time warping,
the median filter, the grouping of tokens into words) and OpenAI's rules for punctuation and
sentence ends; the whole alignment against transformers' model is in test_whisper.py."""

from __future__ import annotations

import numpy as np
import pytest

from mlxr_plugins.archs import whisper_timing as timing

torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
generation_whisper = pytest.importorskip("transformers.models.whisper.generation_whisper")
tokenization_whisper = pytest.importorskip("transformers.models.whisper.tokenization_whisper")


@pytest.mark.parametrize(("rows", "frames", "ties"), [(1, 1, False), (7, 40, False), (12, 9, False), (9, 30, True)])
def test_dynamic_time_warping_equals_transformers(rows: int, frames: int, ties: bool) -> None:
    rng = np.random.default_rng(rows * frames)
    cost = rng.integers(-2, 3, (rows, frames)).astype(np.float64) if ties else rng.standard_normal((rows, frames))
    got = timing.dynamic_time_warping(cost)
    want = generation_whisper._dynamic_time_warping(cost)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("frames", [2, 3, 4, 50])
def test_median_filter_equals_transformers(frames: int) -> None:
    x = np.random.default_rng(frames).standard_normal((3, 5, frames))
    want = generation_whisper._median_filter(torch.tensor(x), 7).numpy()
    np.testing.assert_array_equal(timing.median_filter(x, 7), want)
    with pytest.raises(ValueError, match="odd"):
        timing.median_filter(x, 4)


class ByteTokens:
    """One token a UTF-8 byte (the tiny checkpoint's vocabulary, bytes as their values)."""

    eos_token_id = 256

    def decode(self, tokens: list[int], **_: object) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", [' Hello, world "this" is (a) test!', " Straße über 東京, ok? ¿Sí?", "no space at first"])
def test_tokens_group_into_words_as_transformers_groups_them(text: str) -> None:
    tokens = list(text.encode("utf-8"))
    words = timing.split_words(tokens, ByteTokens().decode, "en")
    want = tokenization_whisper._split_tokens_on_spaces(ByteTokens(), tokens)
    assert [w for w, _ in words] == want[0] and [t for _, t in words] == want[1]
    timed = timing.merge_punctuations(timing.word_timings(words, np.arange(len(tokens) + 1)))
    merged = tokenization_whisper._combine_tokens_into_words(
        ByteTokens(), tokens, "english", timing.PREPENDED, timing.APPENDED
    )  # fmt: skip
    assert [t.word for t in timed] == merged[0] and [t.tokens for t in timed] == merged[1]


def test_unspaced_languages_split_at_characters() -> None:
    tokens = list("東京です".encode())
    words = timing.split_words(tokens, ByteTokens().decode, "ja")
    assert [w for w, _ in words] == ["東", "京", "で", "す"] and sum(len(t) for _, t in words) == len(tokens)


def test_joined_punctuation_keeps_the_word_s_times() -> None:
    timed = [timing.Timing(w, [i], float(i), i + 0.5) for i, w in enumerate([" (", "a", ")", " b", ","])]
    merged = timing.merge_punctuations(timed)
    assert [(t.word, t.tokens, t.start, t.end) for t in merged] == [(" (a)", [0, 1, 2], 1.0, 1.5), (" b,", [3, 4], 3.0, 3.5)]


def test_long_words_are_cut_at_sentence_ends() -> None:
    spans = [(" a", 0.0, 0.2), (" b", 0.2, 0.4), (".", 0.4, 2.0), (" c", 2.0, 4.0), (" d", 4.0, 4.2)]
    timed = [timing.Timing(w, [i], start, end) for i, (w, start, end) in enumerate(spans)]
    timing.shorten_at_sentence_ends(timed)  # the median word lasts 0.2 s: at most 0.4 s at a sentence's end
    assert [(t.start, t.end) for t in timed] == [(0.0, 0.2), (0.2, 0.4), (0.4, pytest.approx(0.8)), (pytest.approx(3.6), 4.0), (4.0, 4.2)]
