"""What Whisper does with sound: windows, prompts, the decoding rules, segments and their times.

The sound is decoded a window (``chunk_length`` seconds, 30 for released models) at a time, as
OpenAI's ``transcribe`` does: a window's prompt is ``<|startofprev|>`` and the earlier windows'
tokens (the request's ``prompt`` before the first), then ``<|startoftranscript|>``, the language
(detected from the first window when not given: the most likely language token after
``<|startoftranscript|>``), the task, and ``<|notimestamps|>`` unless timestamps are asked. Each
step suppresses ``suppress_tokens`` (and ``begin_suppress_tokens`` at the first), then, with
timestamps, applies Whisper's timestamp rules as transformers' ``WhisperTimeStampLogitsProcessor``
does: timestamps in pairs (a lone one only before the end), never decreasing, the first token a
timestamp no later than ``max_initial_timestamp_index``, and a timestamp taken whenever all
timestamps together are likelier than any text token. With timestamps, each pair closes a
segment, and the next window starts at the last closed timestamp (the rest of the window is
decoded again); without them, a window is one segment and the next starts where it ends. Every
time is the window's start plus the token's, so the windows' segments stitch into one timeline.
With words asked, the text a window keeps is read once more and its words timed from the
cross-attention (:mod:`mlxr_plugins.archs.whisper_timing`), on the same timeline.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.errors import ModelLoadError, RequestError
from mlxr_core.model.audio import Segment, Transcript, TranscriptionOptions, Word, compression_ratio
from mlxr_core.model.cache import KVCache
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_plugins.archs import whisper_timing as timing
from mlxr_plugins.archs.whisper import HeadWeights
from mlxr_plugins.archs.whisper_audio import LogMel

#: Seconds one timestamp token stands for.
TIME_PRECISION = 0.02


class WhisperSpeech:
    """A loaded Whisper's :class:`~mlxr_core.model.audio.SpeechToText`."""

    def __init__(self, model: Any, tokenizer: Tokenizer, front_end: LogMel, generation: dict[str, Any], where: str):
        self.model, self.tokenizer, self.front_end = model, tokenizer, front_end
        try:
            eos = generation["eos_token_id"]
            self.eot = int(eos[0] if isinstance(eos, list) else eos)
            self.sot = int(generation["decoder_start_token_id"])
            self.no_timestamps = int(generation["no_timestamps_token_id"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ModelLoadError(f"generation_config.json lacks Whisper's special token {exc}", path=where) from None
        self.timestamp_begin = self.no_timestamps + 1
        #: What ``<|nospeech|>`` is (OpenAI's no-speech probability is its chance after SOT).
        self.no_speech = self.no_timestamps - 1
        self.language_ids = {code.strip("<|>"): int(i) for code, i in (generation.get("lang_to_id") or {}).items()}
        self.languages = tuple(self.language_ids)
        self.task_ids = {task: int(i) for task, i in (generation.get("task_to_id") or {}).items()}
        self.previous_sot = generation.get("prev_sot_token_id")
        self.suppress = [int(t) for t in generation.get("suppress_tokens") or []]
        self.begin_suppress = [int(t) for t in generation.get("begin_suppress_tokens") or []]
        self.max_initial_timestamp = generation.get("max_initial_timestamp_index")
        self.max_positions = int(model.args.max_target_positions)
        self.alignment_heads = alignment_heads(generation.get("alignment_heads"), model.args, where)
        self.median_filter_width = int(model.args.median_filter_width)
        #: Frames of the front end one timestamp step covers (2 at 10 ms a frame).
        self.frames_per_step = round(TIME_PRECISION * front_end.sample_rate / front_end.hop_length)

    # -- the prompt ---------------------------------------------------------------------------

    def prompt(self, language: str | None, task: str, timestamps: bool, previous: list[int]) -> list[int]:
        """A window's prompt: earlier tokens (at most half the decoder's positions), then the
        start, language, task and timestamp tokens."""
        head: list[int] = []
        if previous and self.previous_sot is not None:
            head = [int(self.previous_sot), *previous[-(self.max_positions // 2 - 1) :]]
        start = [self.sot]
        if self.language_ids:
            start.append(self.language_ids[language or "en"])
            if task not in self.task_ids:
                raise RequestError(f"this model cannot {task}", field="model")
            start.append(self.task_ids[task])
        elif task != "transcribe":
            raise RequestError("this model is English only: it transcribes, it does not translate", field="model")
        if not timestamps:
            start.append(self.no_timestamps)
        return head + start

    def check_language(self, language: str | None) -> None:
        if language is None or language in self.language_ids or (not self.language_ids and language == "en"):
            return
        known = ", ".join(self.languages) or "en"
        raise RequestError(f"this model does not know the language {language!r} (known: {known})", field="language")

    def detect_language(self, cross: list[tuple[mx.array, mx.array]]) -> str:
        """The most likely language token after ``<|startoftranscript|>``."""
        logits = self.model(mx.array([[self.sot]]), None, cross=cross)[0, -1]
        codes = list(self.language_ids)
        ids = mx.array([self.language_ids[code] for code in codes])
        return codes[int(mx.argmax(logits[ids]).item())]  # type: ignore[arg-type]

    # -- one window ---------------------------------------------------------------------------

    def filter(self, logits: np.ndarray, sampled: list[int], timestamps: bool) -> np.ndarray:
        """The step's logits with what may not come next at ``-inf``."""
        logits = logits.copy()
        if not sampled:
            logits[self.begin_suppress] = -np.inf
        logits[self.suppress] = -np.inf
        if not timestamps:
            return logits
        begin = self.timestamp_begin
        logits[self.no_timestamps] = -np.inf
        last = len(sampled) >= 1 and sampled[-1] >= begin
        penultimate = len(sampled) < 2 or sampled[-2] >= begin
        if last:
            if penultimate:
                logits[begin:] = -np.inf
            else:
                logits[: self.eot] = -np.inf
        stamps = [token for token in sampled if token >= begin]
        if stamps:
            lowest = stamps[-1] if last and not penultimate else stamps[-1] + 1
            logits[begin:lowest] = -np.inf
        if not sampled:
            logits[:begin] = -np.inf
            if self.max_initial_timestamp is not None:
                logits[begin + int(self.max_initial_timestamp) + 1 :] = -np.inf
        logprobs = log_softmax(logits)
        if np.logaddexp.reduce(logprobs[begin:]) > logprobs[:begin].max():
            logits[:begin] = -np.inf
        return logits

    def decode(
        self, prompt: list[int], cross: list[tuple[mx.array, mx.array]], options: TranscriptionOptions,
        rng: np.random.Generator, max_tokens: int | None = None,
    ) -> Generator[None, None, tuple[list[int], float, float]]:  # fmt: skip
        """The window's tokens after ``prompt`` (up to and with ``<|endoftext|>``), their summed
        log-probability and the no-speech probability; one decoder step per ``yield``."""
        room = self.max_positions - len(prompt)
        limit = min(self.max_positions // 2, room) if max_tokens is None else min(max_tokens, room)
        cache = [KVCache() for _ in self.model.layers]
        logits = self.model(mx.array([prompt]), cache, cross=cross)[0]
        first = np.array(logits[prompt.index(self.sot)].astype(mx.float32))
        no_speech = float(np.exp(log_softmax(first)[self.no_speech])) if self.no_speech >= 0 else 0.0
        step = logits[-1]
        sampled: list[int] = []
        total = 0.0
        for _ in range(limit):
            row = self.filter(np.array(step.astype(mx.float32), dtype=np.float64), sampled, options.timestamps)
            logprobs = log_softmax(row)
            if options.temperature > 0:
                probs = np.exp(log_softmax(row / options.temperature))
                token = int(rng.choice(len(probs), p=probs / probs.sum()))
            else:
                token = int(np.argmax(row))
            total += float(logprobs[token])
            sampled.append(token)
            if token == self.eot:
                break
            yield
            step = self.model(mx.array([[token]]), cache, cross=cross)[0, -1]
        return sampled, total, no_speech

    # -- word timings (:mod:`mlxr_plugins.archs.whisper_timing`) -----------------------------

    def cross_weights(self, tokens: list[int], cross: list[tuple[mx.array, mx.array]]) -> np.ndarray:
        """The alignment heads' cross-attention weights as the decoder reads ``tokens`` at once:
        ``[heads, len(tokens), encoder positions]``."""
        reports: dict[int, HeadWeights] = {}
        for layer, head in self.alignment_heads:
            reports.setdefault(layer, HeadWeights([])).heads.append(head)
        self.model(mx.array([tokens]), None, cross=cross, cross_weights=reports)
        picked = []
        for layer, head in self.alignment_heads:
            weights = reports[layer].weights
            if weights is None:
                raise RuntimeError(f"decoder layer {layer} did not report its cross-attention weights")
            picked.append(weights[0, reports[layer].heads.index(head)])
        return np.array(mx.stack(picked))

    def align_words(
        self, text: list[int], cross: list[tuple[mx.array, mx.array]], language: str, task: str, size: int
    ) -> list[timing.Timing]:
        """The words of a window's ``text`` tokens, timed in seconds from the window's start
        (``size``: the frames of sound the window holds)."""
        if not text:
            return []
        prompt = self.prompt(language, task, False, [])
        weights = self.cross_weights([*prompt, *text, self.eot], cross)
        rows = slice(len(prompt) - 1, len(prompt) + len(text))  # <|notimestamps|> .. the last text token
        positions = max(1, size // 2)  # two front-end frames an encoder position
        starts = timing.row_positions(weights, positions, self.median_filter_width, rows)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        timed = timing.word_timings(timing.split_words(text, decode, language), starts)
        timing.shorten_at_sentence_ends(timed)
        return timing.merge_punctuations(timed)

    # -- the whole sound ----------------------------------------------------------------------

    def transcribe(
        self, features: np.ndarray, duration: float, options: TranscriptionOptions
    ) -> Generator[None, None, Transcript]:
        """See :class:`~mlxr_core.model.audio.SpeechToText`."""
        self.check_language(options.language)
        window = self.front_end.window_frames
        total = min(features.shape[1] - window, round(duration * self.front_end.sample_rate / self.front_end.hop_length))
        seconds_per_frame = self.front_end.hop_length / self.front_end.sample_rate
        rng = np.random.default_rng(options.seed)
        language = options.language
        previous, produced, seek = list(options.prompt), 0, 0
        segments: list[Segment] = []
        timed_words: list[Word] = []
        while seek < max(total, 1):
            size = min(window, total - seek)
            cross = self.model.cross(self.model.encode(mx.array(features[None, :, seek : seek + window])))
            if language is None:
                language = self.detect_language(cross) if self.language_ids else "en"
            prompt = self.prompt(language, options.task, options.timestamps, previous)
            tokens, logprob, no_speech = yield from self.decode(prompt, cross, options, rng)
            produced += len(tokens)
            text = [token for token in tokens if token != self.eot]
            spans, advance = self.spans(text, size, options.timestamps)
            for start, end, part in spans:
                words = self.tokenizer.decode([t for t in part if t < self.eot])
                segments.append(Segment(
                    id=len(segments), seek=seek, start=round((seek * seconds_per_frame) + start, 3),
                    end=round((seek * seconds_per_frame) + end, 3), text=words, tokens=tuple(part),
                    temperature=options.temperature, avg_logprob=logprob / (len(tokens) + 1),
                    compression_ratio=compression_ratio(words), no_speech_prob=no_speech,
                ))  # fmt: skip
            if options.words:
                kept = [token for _, _, part in spans for token in part if token < self.eot]
                offset = seek * seconds_per_frame
                for timed in self.align_words(kept, cross, language, options.task, size):
                    timed_words.append(Word(timed.word, round(offset + timed.start, 2), round(offset + timed.end, 2)))
                yield
            previous += text
            seek += max(advance, 1)
        return Transcript(
            text="".join(segment.text for segment in segments).strip(),
            segments=tuple(segments), language=language or "en", words=tuple(timed_words),
            duration=duration, tokens=produced,
        )  # fmt: skip

    def spans(self, tokens: list[int], size: int, timestamps: bool) -> tuple[list[tuple[float, float, list[int]]], int]:
        """A window's segments as ``(start, end, tokens)`` in seconds from the window's start,
        and the frames to advance (``size``: the window holds ``size`` frames of sound)."""
        length = size * self.front_end.hop_length / self.front_end.sample_rate
        if not timestamps:
            return [(0.0, length, tokens)], size
        begin = self.timestamp_begin
        stamp = [token >= begin for token in tokens]
        cuts = [i for i in range(1, len(tokens)) if stamp[i] and stamp[i - 1]]
        lone_end = len(tokens) >= 2 and not stamp[-2] and stamp[-1]
        if not cuts:
            stamps = [token for token in tokens if token >= begin]
            end = (stamps[-1] - begin) * TIME_PRECISION if stamps and stamps[-1] != begin else length
            return [(0.0, end, tokens)], size
        spans, last = [], 0
        for cut in [*cuts, len(tokens)] if lone_end else cuts:
            part = tokens[last:cut]
            spans.append(((part[0] - begin) * TIME_PRECISION, (part[-1] - begin) * TIME_PRECISION, part))
            last = cut
        advance = size if lone_end else (tokens[last - 1] - begin) * self.frames_per_step
        return spans, advance


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    return logits - top - np.log(np.exp(logits - top).sum())


def alignment_heads(value: Any, args: Any, where: str) -> list[tuple[int, int]]:
    """``generation_config.json``'s ``alignment_heads`` (``[[layer, head], ...]``), or, where it
    has none, every head of the last half of the decoder's layers (OpenAI's default)."""
    layers, heads = int(args.decoder_layers), int(args.decoder_attention_heads)
    if value is None:
        return [(layer, head) for layer in range(layers // 2, layers) for head in range(heads)]
    try:
        pairs = [(int(layer), int(head)) for layer, head in value]
    except (TypeError, ValueError):
        raise ModelLoadError("alignment_heads must be a list of [layer, head] pairs", path=where, key="alignment_heads") from None
    outside = [pair for pair in pairs if not (0 <= pair[0] < layers and 0 <= pair[1] < heads)]
    if not pairs or outside:
        raise ModelLoadError(
            f"alignment_heads names no head of the decoder's {layers} layers of {heads} heads: {outside or pairs}",
            path=where, key="alignment_heads",
        )  # fmt: skip
    return pairs
