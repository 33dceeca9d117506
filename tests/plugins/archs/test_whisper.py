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


def speech_with(loaded: Any, folder: Path, **generation: Any) -> Any:
    """The model's speech side, read from a generation_config.json changed by ``generation``."""
    import json

    from mlxr_plugins.archs.whisper_decoding import WhisperSpeech

    settings = {**json.loads((folder / "generation_config.json").read_text()), **generation}
    return WhisperSpeech(loaded.model, loaded.tokenizer, loaded.speech.front_end, settings, "generation_config.json")


@pytest.mark.parametrize(("language", "heads"), [("de", None), ("en", [[0, 1], [1, 3], [0, 2]])])
def test_token_times_equal_generate(whisper: Any, language: str, heads: list[list[int]] | None) -> None:
    """transformers' token timestamps: each generated token's time is where the warped path first
    reaches the row that reads it (the prompt's rows and the last token's left out)."""
    import copy

    from mlxr_plugins.archs.whisper_timing import SECONDS_PER_POSITION, row_positions

    reference, loaded, folder = whisper
    speech = speech_with(loaded, folder, alignment_heads=heads) if heads else loaded.speech
    if heads is None:  # none in the folder: the last half of the decoder's layers, every head
        assert speech.alignment_heads == [(1, 0), (1, 1), (1, 2), (1, 3)]
    features = reference_features(folder, tones(CHUNK, seed=11))  # a whole window of sound
    config = copy.deepcopy(reference.generation_config)
    config.alignment_heads = [list(pair) for pair in speech.alignment_heads]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor(features[None]), generation_config=config, max_new_tokens=16, do_sample=False,
            language=language, task="transcribe", return_token_timestamps=True,
        )  # fmt: skip
    tokens, want = out["sequences"][0].tolist(), out["token_timestamps"][0].numpy()
    prompt = speech.prompt(language, "transcribe", False, [])
    cross = loaded.model.cross(loaded.model.encode(mx.array(features[None])))
    weights = speech.cross_weights([*prompt, *tokens[:-1]], cross)[:, len(prompt) :]
    got = row_positions(weights, weights.shape[-1], speech.median_filter_width) * SECONDS_PER_POSITION
    assert len(got) == len(tokens) - 1 and want[-1] == want[-2]  # the last token repeats the one before
    np.testing.assert_allclose(got, want[:-1], atol=SECONDS_PER_POSITION + 1e-6)


def openai_alignment(reference: Any, features: np.ndarray, tokens: list[int], heads: list[tuple[int, int]],
                     text_start: int, positions: int) -> np.ndarray:  # fmt: skip
    """OpenAI's find_alignment on transformers' model: the heads' cross-attention over the sound
    (renormalized: a softmax over the sound's positions), standardized over the tokens, transformers'
    median filter, averaged, the rows from <|notimestamps|> to the last text token warped by
    transformers' DTW; each row's first position."""
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    with torch.no_grad():
        out = reference(input_features=torch.tensor(features[None]), decoder_input_ids=torch.tensor([tokens]),
                        output_attentions=True)  # fmt: skip
    weights = torch.stack([out.cross_attentions[layer][0, head] for layer, head in heads])[..., :positions].double()
    weights = weights / weights.sum(-1, keepdim=True)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    matrix = _median_filter((weights - mean) / std, 7).mean(0)[text_start - 1 : -1]
    rows, frames = _dynamic_time_warping(-matrix.numpy())
    return frames[np.diff(rows, prepend=-1).astype(bool)]  # type: ignore[no-any-return]


def test_word_times_follow_openai_find_alignment(whisper: Any) -> None:
    from transformers.models.whisper.tokenization_whisper import _split_tokens_on_spaces

    from mlxr_plugins.archs.whisper_timing import SECONDS_PER_POSITION

    reference, loaded, folder = whisper
    speech = loaded.speech
    seconds = 1.3  # part of the window: the weights are cut to its 65 positions
    features = reference_features(folder, tones(seconds, seed=2))
    text = loaded.tokenizer.encode(' Hello, world "this" is (a) test', add_special_tokens=False)
    prompt = speech.prompt("en", "transcribe", False, [])
    starts = openai_alignment(reference, features, [*prompt, *text, speech.eot], speech.alignment_heads,
                              len(prompt), round(seconds * 100) // 2) * SECONDS_PER_POSITION  # fmt: skip
    cross = loaded.model.cross(loaded.model.encode(mx.array(features[None])))
    words = speech.align_words(text, cross, "en", "transcribe", round(seconds * 100))

    class Decoder:
        eos_token_id = speech.eot

        def decode(self, tokens: list[int], **_: Any) -> str:
            return loaded.tokenizer.decode(tokens, skip_special_tokens=False)  # type: ignore[no-any-return]

    pieces = _split_tokens_on_spaces(Decoder(), text)[2]  # the words before punctuation joins them
    spans = {(round(starts[p[0]], 2), round(starts[p[-1] + 1], 2)) for p in pieces}
    assert "".join(w.word for w in words) == ' Hello, world "this" is (a) test'
    assert [w.word for w in words] == [" Hello,", " world", ' "this"', " is", " (a)", " test"]
    for word in words:  # each keeps the times of the word that punctuation joined
        assert (round(word.start, 2), round(word.end, 2)) in spans
    assert words[0].start == pytest.approx(starts[0]) and words[-1].end == pytest.approx(starts[-1])


def test_words_leave_the_transcript_as_it_was(whisper: Any) -> None:
    _, loaded, _ = whisper
    sound = tones(5.3, seed=7)
    plain, _ = transcribe(loaded, sound, language="en", timestamps=True)
    timed, _ = transcribe(loaded, sound, language="en", timestamps=True, words=True)
    assert timed.segments == plain.segments and not plain.words
    assert "".join(w.word for w in timed.words) == "".join(s.text for s in timed.segments)
    assert all(0 <= w.start <= w.end <= 5.3 + CHUNK for w in timed.words)
    assert timed.words[-1].end > CHUNK  # words of later windows too, on one timeline


@pytest.mark.parametrize("heads", [[[2, 0]], [[0, 4]], "all", []])
def test_bad_alignment_heads_name_the_key(whisper: Any, heads: Any) -> None:
    from mlxr_core.errors import ModelLoadError

    _, loaded, folder = whisper
    with pytest.raises(ModelLoadError) as caught:
        speech_with(loaded, folder, alignment_heads=heads)
    assert caught.value.key == "alignment_heads"
