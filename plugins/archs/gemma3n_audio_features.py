"""Gemma 3n's audio front end (numpy only): 16 kHz samples, padded to a multiple of 128 samples,
cut into frames of ``frame_length`` + 1 samples every ``hop_length``; HTK-style pre-emphasis
(``0.97``), a periodic Hann window, the magnitude of an FFT of twice the next power of two,
``feature_size`` triangular Mel filters (HTK scale, no area norm, 125 to 7600 Hz), ``log`` of at
least ``mel_floor``, optionally minus a per-bin mean and over a per-bin deviation. A frame is valid
when its first sample lies in the sound (not in the padding). The math follows transformers'
``Gemma3nAudioFeatureExtractor``; the tower is :mod:`mlxr_plugins.archs.gemma3n_audio`.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from mlxr_core.errors import ConfigError, RequestError

#: Every sound is this long at most, in samples at 16 kHz (30 s): the tower's soft tokens fill
#: ``audio_soft_tokens_per_image`` positions for it.
MAX_SAMPLES = 480_000
#: The front end pads a sound to a multiple of this many samples.
PAD_MULTIPLE = 128


def htk_mel_filters(n_freqs: int, low: float, high: float, n_mels: int, sample_rate: int, fft_length: int) -> np.ndarray:
    """``[n_freqs, n_mels]`` triangular filters on the HTK Mel scale, peak 1, no area norm."""
    freqs = np.arange(n_freqs, dtype=np.float64) * (sample_rate / fft_length)
    mel_low, mel_high = (2595.0 * math.log10(1.0 + f / 700.0) for f in (low, high))
    edges = 700.0 * (10 ** (np.linspace(mel_low, mel_high, n_mels + 2) / 2595.0) - 1.0)
    widths = np.diff(edges)
    slopes = edges[None, :] - freqs[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(rising, falling))


@attrs.frozen
class Gemma3nLogMel:
    """Gemma 3n's front end: ``samples`` at :attr:`sample_rate` -> ``(features [frames,
    feature_size] float32, valid [frames] bool)`` (:meth:`__call__`). Settings in the names of
    the checkpoint's ``preprocessor_config.json`` (:meth:`from_config`)."""

    feature_size: int = 128
    sample_rate: int = 16_000
    frame_length_ms: float = 32.0
    hop_length_ms: float = 10.0
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = True
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-5
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None

    @classmethod
    def from_config(cls, preprocessor: dict[str, Any] | None) -> Gemma3nLogMel:
        """From a ``preprocessor_config.json`` (its ``feature_extractor`` part when nested;
        missing keys take the defaults). ``dither`` other than 0 is refused: it adds noise."""
        settings = dict(preprocessor or {})
        settings = dict(settings.get("feature_extractor", settings))
        if float(settings.get("dither", 0.0) or 0.0) != 0.0:
            raise ConfigError("dither adds random noise to every frame; mlxr computes Gemma 3n's features "
                              "without it", field="dither")  # fmt: skip
        names = {field.name for field in attrs.fields(cls)}
        kept: dict[str, Any] = {k: v for k, v in settings.items() if k in names and v is not None}
        for key in ("per_bin_mean", "per_bin_stddev"):
            if key in kept:
                kept[key] = tuple(float(v) for v in kept[key])
        return cls(**kept)

    @property
    def frame_length(self) -> int:
        return round(self.sample_rate * self.frame_length_ms / 1000.0)

    @property
    def hop_length(self) -> int:
        return round(self.sample_rate * self.hop_length_ms / 1000.0)

    @property
    def fft_length(self) -> int:
        length = 2 ** math.ceil(math.log2(self.frame_length))
        return length * 2 if self.fft_overdrive else length

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        signal = np.asarray(samples, dtype=np.float32).reshape(-1)[:MAX_SAMPLES]
        length = len(signal)
        padded = -(-max(length, 1) // PAD_MULTIPLE) * PAD_MULTIPLE
        signal = np.pad(signal, (0, padded - length)) * np.float32(self.input_scale_factor)
        size, hop = self.frame_length + 1, self.hop_length
        count = max(0, (padded - size) // hop + 1)
        if count == 0:
            raise RequestError(f"a sound of {length} samples at {self.sample_rate} Hz is shorter than one "
                               f"frame of the audio tower ({size} samples)")  # fmt: skip
        frames = np.lib.stride_tricks.as_strided(
            signal, shape=(count, size), strides=(signal.strides[0] * hop, signal.strides[0]), writeable=False
        ).astype(np.float64)
        if self.preemphasis > 0.0 and self.preemphasis_htk_flavor:
            frames = np.concatenate(
                [frames[:, :1] * (1.0 - self.preemphasis), frames[:, 1:-1] - self.preemphasis * frames[:, :-2]], axis=1
            )
        elif self.preemphasis > 0.0:
            frames = frames[:, 1:] - self.preemphasis * frames[:, :-1]
        else:
            frames = frames[:, :-1]
        n = self.frame_length
        window = 0.5 * (1 - np.cos(2 * np.pi * np.arange(n, dtype=np.float32) / n))
        magnitude = np.abs(np.fft.rfft(frames * window.astype(np.float32), n=self.fft_length, axis=-1))
        filters = htk_mel_filters(self.fft_length // 2 + 1, self.min_frequency, self.max_frequency,
                                  self.feature_size, self.sample_rate, self.fft_length)  # fmt: skip
        features = np.log(np.maximum(magnitude @ filters, self.mel_floor))
        if self.per_bin_mean is not None:
            features = features - np.asarray(self.per_bin_mean)
        if self.per_bin_stddev is not None:
            features = features / np.asarray(self.per_bin_stddev)
        valid = np.arange(count) * hop < length
        return features.astype(np.float32), valid
