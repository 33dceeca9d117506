"""Audio in requests: an uploaded file checked against the server's limits, decoded with
libsndfile (``soundfile``), mixed to mono and resampled (``soxr``) to the rate the model's front
end takes, in a worker thread (never the event loop, never the engine thread).

A hostile file is a :class:`~mlxr_core.errors.RequestError` (400) naming its field: bytes past
``server.max_audio_bytes`` (refused before decoding), nothing at all, a container libsndfile does
not read (an MP3 it cannot, a text file, a PNG), a header claiming more than
``server.max_audio_channels`` channels or a sample rate outside :data:`SAMPLE_RATES`, more than
``server.max_audio_seconds`` of sound, a compressed stream that ends early or loses its sync, or
fewer samples than a header states (a WAV's is what the file holds: PCM is read as far as it
goes, whatever size its header claims). The seconds
are checked twice: from the header's frame count before a sample is decoded, and while decoding,
which reads at most the limit's frames and one more, so a compressed file of silence that claims
a few seconds but holds hours (a FLAC of zeros is some hundred bytes a minute) never expands past
the limit, whatever its header says. Decoded samples are the memory a file costs: the limit's
seconds at the file's rate and channels, as float32.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import attrs
import numpy as np

from mlxr_core.errors import MissingDependency, Overloaded, RequestError

if TYPE_CHECKING:
    from mlxr_core.config.schema import ServerConfig

#: Sample rates a file may declare (Hz): below, no speech survives; above, only a hostile header.
SAMPLE_RATES = (1_000, 384_000)
#: libsndfile's frame count for a file whose header states none (a stream): ``2**63 - 1``.
UNKNOWN_FRAMES = 2**62
#: Frames decoded per read while checking the length as it goes.
BLOCK_FRAMES = 1 << 16


@attrs.frozen
class AudioLimits:
    """What one upload may be: bytes, seconds and channels (``server.max_audio_*``)."""

    max_bytes: int
    max_seconds: float
    max_channels: int

    @classmethod
    def from_server(cls, server: ServerConfig) -> AudioLimits:
        return cls(server.max_audio_bytes, server.max_audio_seconds, server.max_audio_channels)


@attrs.frozen
class Audio:
    """Decoded sound: mono float32 samples in [-1, 1] at ``sample_rate``."""

    samples: np.ndarray = attrs.field(eq=False, repr=False)
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def decode_audio(raw: bytes, limits: AudioLimits, *, sample_rate: int, field: str = "file") -> Audio:
    """``raw`` (a WAV, FLAC, OGG/Vorbis, Opus or any container libsndfile reads) as mono samples
    at ``sample_rate``; a RequestError naming ``field`` for anything refused (see the module).
    Blocking: call it in a worker thread."""
    try:
        import soundfile
    except ImportError:
        raise MissingDependency("soundfile", "audio input", extra="audio") from None
    if len(raw) > limits.max_bytes:
        raise RequestError(
            f"the audio file is {len(raw)} bytes, more than server.max_audio_bytes ({limits.max_bytes})", field=field
        )  # fmt: skip
    if not raw:
        raise RequestError("the audio file is empty", field=field)
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as sound:
            rate, channels = int(sound.samplerate), int(sound.channels)
            declared = int(sound.frames)
            check_header(rate, channels, declared, limits, field)
            samples = read_within(sound, math.floor(limits.max_seconds * rate), field)
            if declared < UNKNOWN_FRAMES and len(samples) < declared:
                raise RequestError(
                    f"the audio file ends after {len(samples)} of the {declared} frames its header declares "
                    "(an upload cut short?)", field=field,
                )  # fmt: skip
    except soundfile.LibsndfileError as exc:
        raise RequestError(f"the audio file cannot be read: {_why(exc)}", field=field) from None
    except MemoryError:
        raise Overloaded("the server ran out of memory decoding the audio; retry later", field=field) from None
    except (RuntimeError, ValueError, TypeError) as exc:  # a header libsndfile takes but cannot decode
        raise RequestError(f"the audio file cannot be decoded: {exc}", field=field) from None
    if len(samples) == 0:
        raise RequestError("the audio file holds no samples", field=field)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    mono = np.nan_to_num(mono, nan=0.0, posinf=1.0, neginf=-1.0).clip(-1.0, 1.0)
    return Audio(resample(mono.astype(np.float32), rate, sample_rate), sample_rate)


def check_header(rate: int, channels: int, frames: int, limits: AudioLimits, field: str) -> None:
    """The header's claims against the limits, before a sample is decoded."""
    low, high = SAMPLE_RATES
    if not low <= rate <= high:
        raise RequestError(f"the audio file's sample rate is {rate} Hz; it must lie in [{low}, {high}]", field=field)
    if not 1 <= channels <= limits.max_channels:
        raise RequestError(
            f"the audio file has {channels} channels; at most server.max_audio_channels ({limits.max_channels})",
            field=field,
        )  # fmt: skip
    # An unknown length (a stream) is a huge count; only a count the header states is judged here.
    if 0 < frames < UNKNOWN_FRAMES and frames / rate > limits.max_seconds:
        raise _too_long(frames / rate, limits, field)


def read_within(sound: object, max_frames: int, field: str) -> np.ndarray:
    """At most ``max_frames`` frames of an open ``soundfile.SoundFile``, ``[frames, channels]``
    float32; a RequestError when more follow (found by reading one frame past the limit)."""
    blocks: list[np.ndarray] = []
    total = 0
    while True:
        want = min(BLOCK_FRAMES, max_frames + 1 - total)
        block = sound.read(want, dtype="float32", always_2d=True)  # type: ignore[attr-defined]
        blocks.append(block)
        total += len(block)
        if total > max_frames:
            rate = sound.samplerate  # type: ignore[attr-defined]
            raise RequestError(
                f"the audio lasts more than server.max_audio_seconds ({max_frames / rate:g} s)", field=field
            )  # fmt: skip
        if len(block) < want:
            break
    channels = blocks[0].shape[1] if blocks else 1
    return np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` (mono float32) from ``rate`` to ``target`` Hz: libsoxr's high-quality filter."""
    if rate == target:
        return samples
    try:
        import soxr
    except ImportError:
        raise MissingDependency("soxr", "resampling audio", extra="audio") from None
    return np.asarray(soxr.resample(samples, rate, target), dtype=np.float32)


def _too_long(seconds: float, limits: AudioLimits, field: str) -> RequestError:
    return RequestError(
        f"the audio lasts {seconds:.1f} s, more than server.max_audio_seconds ({limits.max_seconds:g} s)", field=field
    )


def _why(exc: BaseException) -> str:
    """libsndfile's message without the ``<_io.BytesIO ...>`` it names the file by."""
    text = getattr(exc, "error_string", "") or str(exc)
    if "Format not recognised" in text or "unknown format" in text.lower():
        return "it is in no format libsndfile reads (WAV, FLAC, OGG/Vorbis, Opus, MP3 ...)"
    return text
