"""Whisper against transformers 5.25 on a tiny random checkpoint that transformers wrote: the
log-Mel front end against WhisperFeatureExtractor, the encoder's output, and greedy transcript
tokens against WhisperForConditionalGeneration.generate, with and without timestamps; then the
transcription loop over sound longer than one window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import RequestError
from mlxr_core.model.audio import TranscriptionOptions

torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")

from mlxr_core.testing.whisper_reference import tiny_whisper  # noqa: E402
from mlxr_plugins.archs.whisper_audio import LogMel  # noqa: E402

CHUNK = 2  # seconds a window holds: 200 frames, 100 encoder positions
RATE = 16_000


def tones(seconds: float, seed: int = 0) -> np.ndarray:
    """A sequence of tones (a tenth of a second each, random pitches) with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = rng.uniform(200, 2000, int(seconds * 10) + 1)[(t * 10).astype(int)]
    return (0.3 * np.sin(2 * np.pi * pitch * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """transformers' model, the same folder loaded by mlxr (float32), and the folder."""
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    folder = tmp_path_factory.mktemp("whisper")
    reference = tiny_whisper(folder, chunk_length=CHUNK)
    loaded = load_model(ModelConfig(path=str(folder), dtype="float32"), load_plugins().registries)
    return reference, loaded, folder


def reference_features(folder: Path, samples: np.ndarray) -> np.ndarray:
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    return extractor(samples, sampling_rate=RATE, return_tensors="np").input_features[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("seconds", [0.7, CHUNK])
def test_log_mel_features_equal_the_feature_extractor(whisper: Any, seconds: float) -> None:
    _, loaded, folder = whisper
    samples = tones(seconds)
    front_end = loaded.speech.front_end
    got, want = front_end(samples)[:, : front_end.window_frames], reference_features(folder, samples)
    if seconds == CHUNK:
        # Sound filling the window: the extractor reflects its last samples into the final frame;
        # the front end sees the silence that follows (it pads every sound, as long-form does).
        got, want = got[:, :-1], want[:, :-1]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_30_second_defaults_equal_the_feature_extractor() -> None:
    samples = tones(3.0)
    want = transformers.WhisperFeatureExtractor()(samples, sampling_rate=RATE, return_tensors="np").input_features[0]
    np.testing.assert_allclose(LogMel()(samples)[:, :3000], want, atol=1e-4)


def test_encoder_output_equals_transformers(whisper: Any) -> None:
    reference, loaded, folder = whisper
    features = reference_features(folder, tones(1.5))
    with torch.no_grad():
        want = reference.model.encoder(torch.tensor(features[None])).last_hidden_state[0].numpy()
    got = np.array(loaded.model.encode(mx.array(features[None]))[0])
    np.testing.assert_allclose(got, want, atol=1e-4)


def generate(reference: Any, features: np.ndarray, count: int, **kwargs: Any) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor(features[None]), max_new_tokens=count, do_sample=False, **kwargs)
    tokens = out[0].tolist() if hasattr(out, "tolist") else out["sequences"][0].tolist()
    return tokens  # type: ignore[no-any-return]


@pytest.mark.parametrize(("task", "timestamps"), [("transcribe", False), ("translate", False), ("transcribe", True)])
def test_greedy_tokens_equal_generate(whisper: Any, task: str, timestamps: bool) -> None:
    reference, loaded, folder = whisper
    features = reference_features(folder, tones(1.2, seed=3))
    speech = loaded.speech
    count = 20
    want = generate(reference, features, count, language="de", task=task, return_timestamps=timestamps)
    prompt = speech.prompt("de", task, timestamps, [])
    cross = loaded.model.cross(loaded.model.encode(mx.array(features[None])))
    parts = speech.decode(prompt, cross, TranscriptionOptions(task=task, timestamps=timestamps), np.random.default_rng(0), count)
    while True:
        try:
            next(parts)
        except StopIteration as done:
            got = done.value[0]
            break
    if want[: len(prompt)] == prompt:  # generate may return the prompt's tokens too
        want = want[len(prompt) :]
    if timestamps:
        # With timestamps, generate decodes again from the last closed pair of timestamps (a new
        # pass starts with a timestamp right after a pair: three in a row); compare its first pass.
        stamp = [token >= speech.timestamp_begin for token in want]
        cut = next((i for i in range(2, len(want)) if stamp[i] and stamp[i - 1] and stamp[i - 2]), len(want))
        assert cut >= 4 and got[0] >= speech.timestamp_begin  # the rules ran: a timestamp comes first
        got, want = got[:cut], want[:cut]
    else:
        assert len(got) == count
    assert got == want


def test_language_detection_equals_transformers(whisper: Any) -> None:
    reference, loaded, folder = whisper
    features = reference_features(folder, tones(1.0, seed=5))
    with torch.no_grad():
        want = reference.detect_language(torch.tensor(features[None]))[0].item()
    cross = loaded.model.cross(loaded.model.encode(mx.array(features[None])))
    assert loaded.speech.language_ids[loaded.speech.detect_language(cross)] == want


def transcribe(loaded: Any, samples: np.ndarray, **options: Any) -> Any:
    parts = loaded.speech.transcribe(loaded.speech.front_end(samples), len(samples) / RATE, TranscriptionOptions(**options))
    steps = 0
    while True:
        try:
            next(parts)
            steps += 1
        except StopIteration as done:
            return done.value, steps


@pytest.mark.parametrize("timestamps", [False, True])
def test_long_sound_is_decoded_window_by_window_on_one_timeline(whisper: Any, timestamps: bool) -> None:
    _, loaded, _ = whisper
    transcript, steps = transcribe(loaded, tones(5.3, seed=7), language="en", timestamps=timestamps)
    segments = transcript.segments
    assert transcript.duration == pytest.approx(5.3) and transcript.language == "en"
    assert steps > 0 and transcript.tokens >= steps  # one yield per decoder step
    assert [s.id for s in segments] == list(range(len(segments)))
    starts = [s.start for s in segments]
    assert starts == sorted(starts) and all(s.start <= s.end for s in segments)
    assert segments[-1].seek > 0  # more than one window was decoded
    if not timestamps:  # a window per segment, the windows back to back
        assert [(s.start, s.end) for s in segments] == [(0.0, 2.0), (2.0, 4.0), (4.0, 5.3)]
    assert all(s.end <= 5.3 + 2 for s in segments)


def test_a_language_the_model_does_not_know_is_refused(whisper: Any) -> None:
    _, loaded, _ = whisper
    with pytest.raises(RequestError) as caught:
        transcribe(loaded, tones(0.5), language="xx")
    assert caught.value.field == "language" and "de, en, fr" in str(caught.value)


def test_the_language_is_detected_when_not_given(whisper: Any) -> None:
    _, loaded, _ = whisper
    transcript, _ = transcribe(loaded, tones(0.5), temperature=0.7, seed=1)
    assert transcript.language in ("en", "de", "fr")
