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
the limit, whatever its header says. Each block read is mixed to mono and resampled before the
next is read, so a file costs the model's rate in mono float32 for its seconds (at most the
limit's: 115 MB for 1800 s at 16 kHz), whatever its channels and rate.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

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
            read, samples = read_within(sound, math.floor(limits.max_seconds * rate), sample_rate, field)
            if declared < UNKNOWN_FRAMES and read < declared:
                raise RequestError(
                    f"the audio file ends after {read} of the {declared} frames its header declares "
                    "(an upload cut short?)", field=field,
                )  # fmt: skip
    except soundfile.LibsndfileError as exc:
        raise RequestError(f"the audio file cannot be read: {_why(exc)}", field=field) from None
    except MemoryError:
        raise Overloaded("the server ran out of memory decoding the audio; retry later", field=field) from None
    except (RuntimeError, ValueError, TypeError) as exc:  # a header libsndfile takes but cannot decode
        raise RequestError(f"the audio file cannot be decoded: {exc}", field=field) from None
    if read == 0:
        raise RequestError("the audio file holds no samples", field=field)
    return Audio(samples, sample_rate)


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


def read_within(sound: Any, max_frames: int, sample_rate: int, field: str) -> tuple[int, np.ndarray]:
    """At most ``max_frames`` frames of an open ``soundfile.SoundFile``, read a block at a time,
    each mixed to mono and resampled to ``sample_rate`` as it comes (so memory holds the mono
    result, not the file's channels at its rate); the frames read and the samples. A
    RequestError when more frames follow (found by reading one frame past the limit)."""
    resampler = Resampler(int(sound.samplerate), sample_rate)
    parts: list[np.ndarray] = []
    total = 0
    while True:
        want = min(BLOCK_FRAMES, max_frames + 1 - total)
        block = sound.read(want, dtype="float32", always_2d=True)
        total += len(block)
        if total > max_frames:
            raise RequestError(
                f"the audio lasts more than server.max_audio_seconds ({max_frames / sound.samplerate:g} s)", field=field
            )  # fmt: skip
        mono = block.mean(axis=1) if block.shape[1] > 1 else block[:, 0]
        mono = np.nan_to_num(mono, nan=0.0, posinf=1.0, neginf=-1.0).clip(-1.0, 1.0)
        last = len(block) < want
        parts.append(resampler(mono.astype(np.float32), last=last))
        if last:
            return total, np.concatenate(parts).astype(np.float32, copy=False)


class Resampler:
    """Mono float32 blocks from ``rate`` to ``target`` Hz as a stream: libsoxr's high-quality
    filter (its state carried from block to block, so the blocks join as one signal would)."""

    def __init__(self, rate: int, target: int):
        self.stream: Any = None
        if rate != target:
            try:
                import soxr
            except ImportError:
                raise MissingDependency("soxr", "resampling audio", extra="audio") from None
            self.stream = soxr.ResampleStream(rate, target, 1, dtype="float32")

    def __call__(self, block: np.ndarray, *, last: bool) -> np.ndarray:
        if self.stream is None:
            return block
        return np.asarray(self.stream.resample_chunk(block, last=last), dtype=np.float32)


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
