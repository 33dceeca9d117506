"""Word timings from Whisper's cross-attention, as OpenAI's ``timing.py`` computes them.

A window's text tokens are read once more by the decoder, after ``<|startoftranscript|>``, the
language, the task and ``<|notimestamps|>``; the cross-attention weights of the alignment heads
(``generation_config.json``'s ``alignment_heads``, else every head of the last half of the
decoder's layers) say where in the sound each token was read. The weights of the rows from
``<|notimestamps|>`` to the last text token (each row predicts the next token) are cut to the
window's sound and renormalized over it, standardized per head and frame over the rows, smoothed
by a median filter over the frames (width 7), and averaged over the heads; dynamic time warping
then finds the monotone path through that matrix of least cost (the negated weights), and each
row's time is the frame where the path first reaches it (20 ms a frame). A token starts at its
row's time and ends at the next row's. Tokens join into words at a space, at punctuation and at
complete UTF-8 characters (every character is a word in Chinese, Japanese, Thai, Lao, Burmese and
Cantonese); a word much longer than the median one is cut at a sentence's end; then punctuation
joins the word beside it, which keeps its own times (``merge_punctuations``).
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from collections.abc import Callable, Sequence

import numpy as np

#: Seconds between two encoder positions (two front-end frames of 10 ms).
SECONDS_PER_POSITION = 0.02
#: OpenAI's: punctuation joined to the following word, and to the preceding one.
PREPENDED = "\"'“¿([{-"
APPENDED = "\"'.。,，!！?？:：”)]}、"  # noqa: RUF001 (the full-width marks are meant)
SENTENCE_ENDS = ".。!！?？"  # noqa: RUF001
#: Languages written without spaces: split at characters.
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my", "yue"})


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """The median of each ``width`` neighbours along the last axis, the edges reflected (as
    OpenAI's and transformers'); unchanged when the axis holds ``width // 2`` values or fewer."""
    if width <= 0 or width % 2 != 1:
        raise ValueError(f"the median filter's width must be odd, got {width}")
    half = width // 2
    if x.shape[-1] <= half:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.sort(windows, axis=-1)[..., half]


def dynamic_time_warping(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The path of least summed ``cost`` ``[rows, frames]`` from the first cell to the last,
    each step one row down, one frame on, or both: ``(rows, frames)`` of the path's cells.

    The accumulated cost is kept in float32 and ties go as OpenAI's ``dtw_cpu`` breaks them
    (diagonal only when strictly least, then down, else across). The cells of one anti-diagonal
    depend only on the two before it, so the tables are kept by anti-diagonal (``[i + j, i]``) and
    each anti-diagonal is one vectorized step over slices."""
    N, M = cost.shape
    i, j = np.meshgrid(np.arange(1, N + 1), np.arange(1, M + 1), indexing="ij")
    skewed = np.zeros((N + M + 1, N + 1))
    skewed[i + j, i] = cost
    total = np.full((N + M + 1, N + 1), np.inf, dtype=np.float32)
    trace = np.full((N + M + 1, N + 1), -1, dtype=np.int8)
    total[0, 0] = 0
    for d in range(2, N + M + 1):
        lo, hi = max(1, d - M), min(N, d - 1) + 1
        c0, c1, c2 = total[d - 2, lo - 1 : hi - 1], total[d - 1, lo - 1 : hi - 1], total[d - 1, lo:hi]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        best = np.where(step == 0, c0, np.where(step == 1, c1, c2))
        total[d, lo:hi] = (skewed[d, lo:hi] + best.astype(np.float64)).astype(np.float32)
        trace[d, lo:hi] = step
    rows, frames = [], []
    r, f = N, M
    while r > 0 or f > 0:
        rows.append(r - 1)
        frames.append(f - 1)
        move = 2 if r == 0 else 1 if f == 0 else trace[r + f, r]
        r, f = (r - 1, f - 1) if move == 0 else (r - 1, f) if move == 1 else (r, f - 1)
    return np.array(rows[::-1]), np.array(frames[::-1])


def row_positions(weights: np.ndarray, positions: int, width: int = 7, rows: slice = slice(None)) -> np.ndarray:
    """The encoder position where each of ``rows`` starts: ``weights`` ``[heads, tokens, all
    positions]`` (the alignment heads' softmax), cut to the first ``positions`` (the window's
    sound) and renormalized over them, standardized per head and position over all the tokens,
    median-filtered over the positions and averaged over the heads; then ``rows`` of that matrix
    are warped (:func:`dynamic_time_warping`)."""
    cut = weights[..., :positions].astype(np.float64)
    cut = cut / cut.sum(axis=-1, keepdims=True)
    std, mean = cut.std(axis=-2, keepdims=True), cut.mean(axis=-2, keepdims=True)
    standard = (cut - mean) / np.where(std > 0, std, 1.0)
    matrix = median_filter(standard, width).mean(axis=0)[rows]
    path_rows, path_frames = dynamic_time_warping(-matrix)
    jumps = np.diff(path_rows, prepend=-1).astype(bool)
    return path_frames[jumps]


def split_words(tokens: Sequence[int], decode: Callable[[list[int]], str], language: str) -> list[tuple[str, list[int]]]:
    """``tokens`` (text only) as words with their tokens, as OpenAI's ``split_to_word_tokens``:
    at complete UTF-8 characters; then, unless ``language`` is written without spaces, a piece
    starting with a space or made of punctuation starts a word, any other joins the one before."""
    whole = decode(list(tokens))
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    offset = 0
    for token in tokens:
        current.append(token)
        text = decode(current)
        broken = text.find("\ufffd")
        # A replacement character the whole text also has there is the text's own, not a cut.
        if broken < 0 or offset + broken >= len(whole) or whole[offset + broken] == "\ufffd":
            pieces.append((text, current))
            current = []
            offset += len(text)
    if current:  # never whole: kept, so that every token stays in a word
        pieces.append((decode(current), current))
    if language in UNSPACED:
        return pieces
    words: list[tuple[str, list[int]]] = []
    for text, part in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(part)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + part)
    return words


@dataclasses.dataclass
class Timing:
    """A word, its tokens, and its start and end in seconds from the window's start."""

    word: str
    tokens: list[int]
    start: float
    end: float


def word_timings(words: list[tuple[str, list[int]]], starts: np.ndarray) -> list[Timing]:
    """Each word timed: ``starts`` holds the start position of every text token's row and of
    one row more (the one after the last token), so a word runs from its first token's row to
    the row after its last."""
    timed, first = [], 0
    for text, part in words:
        last = first + len(part)
        timed.append(Timing(text, list(part), float(starts[first]) * SECONDS_PER_POSITION,
                            float(starts[last]) * SECONDS_PER_POSITION))  # fmt: skip
        first = last
    return timed


def shorten_at_sentence_ends(timed: list[Timing]) -> None:
    """OpenAI's guard: a word longer than twice the median word (the median at most 0.7 s) is cut
    to that length when it is a sentence's final mark, or begins one after such a mark."""
    durations = np.array([t.end - t.start for t in timed])
    durations = durations[durations.nonzero()]
    if not len(durations):
        return
    longest = 2 * min(0.7, float(np.median(durations)))
    for previous, timing in itertools.pairwise(timed):
        if timing.end - timing.start > longest:
            if timing.word in SENTENCE_ENDS:
                timing.end = timing.start + longest
            elif previous.word in SENTENCE_ENDS:
                timing.start = timing.end - longest


def merge_punctuations(timed: list[Timing]) -> list[Timing]:
    """OpenAI's ``merge_punctuations``: an opening mark (:data:`PREPENDED`, after a space) joins
    the next word, a closing one (:data:`APPENDED`) the word before; the word joined keeps its
    times, and emptied words are dropped."""
    i, j = len(timed) - 2, len(timed) - 1
    while i >= 0:
        previous, following = timed[i], timed[j]
        if previous.word.startswith(" ") and previous.word.strip() in PREPENDED:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(timed):
        previous, following = timed[i], timed[j]
        if not previous.word.endswith(" ") and following.word in APPENDED:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1
    return [timing for timing in timed if timing.word]
