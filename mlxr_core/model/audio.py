"""The speech contract: how an architecture turns sound into text.

An :class:`~mlxr_core.model.arch.Architecture` of a speech-to-text family (Whisper) implements
:class:`ProvidesSpeech`: once its module is loaded, ``speech(...)`` returns a
:class:`SpeechToText`, which the loader keeps beside the model (``LoadedModel.speech``). One
upload goes through two steps, as an image does through the vision side:

1. ``front_end(samples) -> features``: mono float32 samples at ``front_end.sample_rate`` to the
   model's input features (Whisper: a log-Mel spectrogram), with numpy only, on any thread (the
   server runs it in a worker thread, after :mod:`mlxr_core.http.audio` decoded the file);
2. ``transcribe(features, duration, options)``: on the engine thread, a generator that yields
   between decoder steps, so the engine runs its batch steps in between (an
   :class:`~mlxr_core.engine.jobs.EngineJob`), and returns a :class:`Transcript` whose segments
   carry their times in the sound (long sound is decoded a window at a time, the windows' times
   stitched together).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import numpy as np

if TYPE_CHECKING:
    import mlx.nn as nn

    from mlxr_core.model.checkpoint import Checkpoint
    from mlxr_core.model.tokenizer import Tokenizer

#: What a speech model may be asked to do.
TASKS = ("transcribe", "translate")


class AudioFrontEnd(Protocol):
    """Samples -> the model's input features, with numpy only (any thread)."""

    #: The rate (Hz) the samples must be at.
    sample_rate: int

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """Mono float32 ``samples`` at :attr:`sample_rate` -> features (Whisper: ``[mels, frames]``)."""
        ...


@attrs.frozen
class TranscriptionOptions:
    """One request's choices: ``task`` (one of :data:`TASKS`), ``language`` (a code such as
    ``en``; None: detected), ``prompt`` (token ids of earlier text, to condition on), the sampling
    ``temperature`` (0: greedy), whether segments get ``timestamps``, whether the transcript's
    ``words`` are timed, and a ``seed``."""

    task: str = "transcribe"
    language: str | None = None
    prompt: tuple[int, ...] = ()
    temperature: float = 0.0
    timestamps: bool = False
    words: bool = False
    seed: int | None = None


@attrs.frozen
class Segment:
    """A span of the transcript: its text, token ids and times (seconds from the start)."""

    id: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    #: The frame the segment's window started at (OpenAI's ``seek``).
    seek: int
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@attrs.frozen
class Word:
    """A word of the transcript (as decoded: a leading space included, punctuation attached) and
    its times (seconds from the start)."""

    word: str
    start: float
    end: float


@attrs.frozen
class Transcript:
    """The whole transcript: its segments in order, the language spoken (or detected), the
    sound's length, the tokens the decoder produced (usage), and its words in order when they
    were asked for (``TranscriptionOptions.words``)."""

    text: str
    segments: tuple[Segment, ...]
    language: str
    duration: float
    tokens: int
    words: tuple[Word, ...] = ()


class SpeechToText(Protocol):
    """A loaded speech model's side that turns features into a transcript."""

    front_end: AudioFrontEnd
    #: The language codes the model knows (empty: English only, no language token).
    languages: tuple[str, ...]

    def transcribe(
        self, features: np.ndarray, duration: float, options: TranscriptionOptions
    ) -> Generator[None, None, Transcript]:
        """The transcript of ``features`` (the front end's, of ``duration`` seconds of sound),
        one decoder step per ``yield``; engine thread only. Raises RequestError for an option
        the model cannot honour (a language it does not know)."""
        ...


@runtime_checkable
class ProvidesSpeech(Protocol):
    """An optional capability of an :class:`~mlxr_core.model.arch.Architecture`: speech to text.
    A model of such an architecture transcribes; it does not continue text prompts."""

    def speech(
        self, model: nn.Module, checkpoint: Checkpoint, tokenizer: Tokenizer, preprocessor: dict[str, Any] | None
    ) -> SpeechToText:
        """The speech side of the loaded ``model``; ``preprocessor`` is the folder's
        ``preprocessor_config.json`` when it has one. Raises ModelLoadError naming the file where
        a setting it needs is missing."""
        ...


def compression_ratio(text: str) -> float:
    """How much zlib shrinks ``text``'s UTF-8 bytes (OpenAI's repetition signal: above 2.4, the
    decoder is likely looping)."""
    import zlib

    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def load_speech(checkpoint: Checkpoint, arch: object, model: nn.Module, tokenizer: Tokenizer) -> SpeechToText | None:
    """The speech side of a loaded model whose architecture provides one (else None), reading
    the folder's ``preprocessor_config.json`` where there is one."""
    import json

    if not isinstance(arch, ProvidesSpeech):
        return None
    found = checkpoint.path / "preprocessor_config.json"
    preprocessor = checkpoint.preprocessor
    if preprocessor is None and found.is_file():
        try:
            preprocessor = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            from mlxr_core.errors import ModelLoadError

            raise ModelLoadError(f"cannot read it: {exc}", path=str(found)) from None
    return arch.speech(model, checkpoint, tokenizer, preprocessor)
