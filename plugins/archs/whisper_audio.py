"""Whisper's front end: 16 kHz samples -> a log-Mel spectrogram, with numpy alone.

As OpenAI's ``log_mel_spectrogram`` and transformers' ``WhisperFeatureExtractor`` compute it: a
periodic Hann window of ``n_fft`` samples every ``hop_length`` (the signal reflected at both ends
by half a window), the power spectrum through ``feature_size`` triangular Mel filters (Slaney's
scale and area normalization, 0 to 8 kHz), ``log10`` of at least 1e-10, the last frame dropped,
floored 8 below the maximum, then ``(x + 4) / 4``. Settings come from the checkpoint's
``preprocessor_config.json`` (tolerant: Whisper's defaults where a key is missing).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

#: Slaney's Mel scale: linear below 1 kHz (3 Mel per 200 Hz), logarithmic above.
MIN_LOG_HERTZ, MIN_LOG_MEL, LOG_STEP = 1000.0, 15.0, 27.0 / np.log(6.4)


def hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    above = freq >= MIN_LOG_HERTZ
    mels[above] = MIN_LOG_MEL + np.log(freq[above] / MIN_LOG_HERTZ) * LOG_STEP
    return mels


def mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    above = mels >= MIN_LOG_MEL
    freq[above] = MIN_LOG_HERTZ * np.exp((mels[above] - MIN_LOG_MEL) / LOG_STEP)
    return freq


def mel_filters(n_fft: int, n_mels: int, sample_rate: int, low: float = 0.0, high: float = 8000.0) -> np.ndarray:
    """``[n_fft // 2 + 1, n_mels]`` triangular filters, each of unit area (Slaney's norm)."""
    bins = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges = mel_to_hertz(np.linspace(hertz_to_mel(np.array([low]))[0], hertz_to_mel(np.array([high]))[0], n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[None, :]


@attrs.frozen
class LogMel:
    """The front end (:class:`~mlxr_core.model.audio.AudioFrontEnd`): ``samples`` at
    :attr:`sample_rate` -> ``[feature_size, frames]`` float32, one frame per ``hop_length``
    samples; a window of the model is :attr:`window_frames` frames (``chunk_length`` seconds)."""

    feature_size: int = 80
    sample_rate: int = 16_000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30
    filters: np.ndarray = attrs.field(eq=False, repr=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.filters is None:
            object.__setattr__(self, "filters", mel_filters(self.n_fft, self.feature_size, self.sample_rate))

    @classmethod
    def from_config(cls, preprocessor: dict[str, Any] | None, feature_size: int) -> LogMel:
        """From ``preprocessor_config.json`` (missing keys: Whisper's values; ``feature_size``
        from the model's ``num_mel_bins`` when the file names none)."""
        settings = preprocessor or {}
        return cls(
            int(settings.get("feature_size", feature_size)),
            int(settings.get("sampling_rate", 16_000)),
            int(settings.get("hop_length", 160)),
            int(settings.get("n_fft", 400)),
            int(settings.get("chunk_length", 30)),
        )

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sample_rate

    @property
    def window_frames(self) -> int:
        return self.window_samples // self.hop_length

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """The log-Mel spectrogram of ``samples``, followed by a window's length of silence (so
        any window starting inside the sound is whole): ``[feature_size, len // hop + window]``.
        The floor (8 below the maximum) is taken over all of it, as OpenAI's long-form does."""
        padded = np.concatenate([np.asarray(samples, np.float32), np.zeros(self.window_samples, np.float32)])
        return self.spectrogram(padded)

    def spectrogram(self, samples: np.ndarray) -> np.ndarray:
        """``[feature_size, len(samples) // hop_length]`` for ``samples`` as they are."""
        half = self.n_fft // 2
        signal = np.pad(samples.astype(np.float32), (half, half), mode="reflect")
        count = 1 + (len(signal) - self.n_fft) // self.hop_length
        window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.n_fft) / self.n_fft)  # periodic Hann
        mel = np.empty((count, self.feature_size), np.float32)
        step = 4096  # frames per FFT batch: an hour of sound never holds its whole power spectrum
        for start in range(0, count, step):
            index = (np.arange(start, min(start + step, count)) * self.hop_length)[:, None] + np.arange(self.n_fft)
            power = np.abs(np.fft.rfft(signal[index] * window, axis=-1)) ** 2
            mel[start : start + len(index)] = np.log10(np.maximum(power @ self.filters, 1e-10))
        mel = mel.T[:, :-1]
        mel = np.maximum(mel, mel.max() - 8.0)
        return ((mel + 4.0) / 4.0).astype(np.float32)
