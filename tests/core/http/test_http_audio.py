"""Decoding uploaded audio under the server's limits (mlxr_core.http.audio): good files of every
common kind come out mono at the model's rate; hostile ones are a 400 naming the field."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mlxr_core.errors import RequestError

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from mlxr_core.http.audio import AudioLimits, decode_audio  # noqa: E402

LIMITS = AudioLimits(max_bytes=2_000_000, max_seconds=20.0, max_channels=2)


def encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.25 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", None), ("OGG", "VORBIS")])
def test_formats_decode_to_mono_at_the_model_rate(fmt: str, subtype: str | None) -> None:
    left, right = tone(1.0, 44_100), tone(1.0, 44_100, hz=220.0)
    raw = encode(np.stack([left, right], axis=1), 44_100, fmt, subtype)
    audio = decode_audio(raw, LIMITS, sample_rate=16_000)
    assert audio.sample_rate == 16_000
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert abs(audio.seconds - 1.0) < 0.01
    # The mix of both channels, resampled: its spectrum peaks at the two tones.
    spectrum = np.abs(np.fft.rfft(audio.samples))
    peaks = sorted(np.argsort(spectrum)[-2:] * 16_000 / len(audio.samples))
    assert peaks == pytest.approx([220.0, 440.0], abs=3.0)


def test_the_same_rate_is_not_resampled() -> None:
    samples = tone(0.5, 16_000)
    audio = decode_audio(encode(samples, 16_000, subtype="FLOAT"), LIMITS, sample_rate=16_000)
    np.testing.assert_array_equal(audio.samples, samples)


def refusal(raw: bytes, limits: AudioLimits = LIMITS) -> str:
    with pytest.raises(RequestError) as caught:
        decode_audio(raw, limits, sample_rate=16_000, field="file")
    assert caught.value.field == "file" and caught.value.status == 400
    return str(caught.value)


def test_more_bytes_than_the_limit_are_refused_before_decoding() -> None:
    raw = encode(tone(2.0, 16_000), 16_000)
    assert "max_audio_bytes" in refusal(raw, AudioLimits(1000, 20.0, 2))


def test_empty_and_foreign_files_are_refused() -> None:
    assert "empty" in refusal(b"")
    assert "no format" in refusal(b"not audio at all, just some text" * 4)
    assert "no format" in refusal(b"\x89PNG\r\n\x1a\n" + bytes(200))


@pytest.mark.parametrize(("fmt", "subtype"), [("FLAC", None), ("OGG", "VORBIS")])
def test_a_truncated_file_is_refused(fmt: str, subtype: str | None) -> None:
    raw = encode(tone(3.0, 16_000), 16_000, fmt, subtype)
    assert "cannot be read" in refusal(raw[:60])  # inside the header
    assert "cannot be read" in refusal(raw[: len(raw) // 2])  # inside the stream


def test_a_truncated_wav_is_refused_in_its_header_and_read_as_far_as_it_goes_after() -> None:
    raw = encode(tone(1.0, 16_000), 16_000)
    assert "cannot be read" in refusal(raw[:30])
    # PCM has no stream to lose sync in: libsndfile reads the samples the file holds.
    assert decode_audio(raw[: len(raw) // 2], LIMITS, sample_rate=16_000).seconds == pytest.approx(0.5, abs=0.01)


def test_hostile_headers_are_refused_or_read_within_the_file() -> None:
    raw = bytearray(encode(tone(0.5, 16_000), 16_000))
    fmt = raw.find(b"fmt ")
    channels = bytearray(raw)
    channels[fmt + 10 : fmt + 12] = (1000).to_bytes(2, "little")
    assert "1000 channels" in refusal(bytes(channels))
    rate = bytearray(raw)
    rate[fmt + 12 : fmt + 16] = (4_000_000_000).to_bytes(4, "little")
    refusal(bytes(rate))
    # Sizes of 4 GB claimed for the file and its samples: what the file holds is read, no more.
    huge = bytearray(raw)
    data = huge.find(b"data")
    huge[4:8] = huge[data + 4 : data + 8] = (0xFFFFFFF0).to_bytes(4, "little")
    assert decode_audio(bytes(huge), LIMITS, sample_rate=16_000).seconds == pytest.approx(0.5, abs=0.01)


def test_too_many_channels_and_seconds_are_refused() -> None:
    assert "channels" in refusal(encode(np.zeros((1600, 3), np.float32), 16_000))
    assert "max_audio_seconds" in refusal(encode(np.zeros(16_000 * 21, np.int16), 16_000, "FLAC"))


def test_a_silence_bomb_never_expands_past_the_limit() -> None:
    """A FLAC of ten minutes of silence is a few kilobytes; with its header's sample count
    erased (a stream of unknown length), only decoding finds its length: it stops one frame
    past the limit."""
    raw = bytearray(encode(np.zeros(16_000 * 600, np.int16), 16_000, "FLAC"))
    assert len(raw) < 60_000
    info = raw.find(b"fLaC") + 8  # STREAMINFO's body
    raw[info + 13] &= 0xF0  # total samples: the low 4 bits of byte 13 and bytes 14..17
    raw[info + 14 : info + 18] = bytes(4)
    with soundfile.SoundFile(io.BytesIO(bytes(raw))) as sound:
        assert sound.frames > 16_000 * 600  # unknown: libsndfile's huge count
    assert "max_audio_seconds" in refusal(bytes(raw))


def test_blocks_are_resampled_as_one_signal() -> None:
    """A file longer than a read block, decoded block by block through one resampling stream,
    equals libsoxr resampling the whole signal at once."""
    import soxr

    from mlxr_core.http.audio import BLOCK_FRAMES

    samples = tone(3.0 * BLOCK_FRAMES / 44_100, 44_100)
    audio = decode_audio(encode(samples, 44_100, subtype="FLOAT"), LIMITS, sample_rate=16_000)
    np.testing.assert_allclose(audio.samples, soxr.resample(samples, 44_100, 16_000), atol=1e-6)
