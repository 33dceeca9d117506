"""Speech to text on the engine thread: a transcription is an
:class:`~mlxr_core.engine.jobs.EngineJob` whose parts are the model's decoder steps
(:meth:`~mlxr_core.model.audio.SpeechToText.transcribe` yields between them), so the engine runs
its batch steps between a transcription's tokens, and a client that leaves stops it at its next
step. The features arrive computed (the front end runs in the server's worker threads)."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.errors import RequestError
from mlxr_core.model.audio import Transcript, TranscriptionOptions

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel


@attrs.frozen
class TranscriptionWork:
    """One transcription (picklable: it crosses to an engine in a process of its own)."""

    model: str
    features: Any = attrs.field(eq=False, repr=False)  # np.ndarray, the front end's
    duration: float
    options: TranscriptionOptions

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[None, None, Transcript]:
        speech = models[self.model].speech
        if speech is None:
            raise RequestError(f"the model {self.model!r} does not transcribe audio", field="model")
        return speech.transcribe(self.features, self.duration, self.options)
