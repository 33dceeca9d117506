"""OpenAI's /v1/audio/transcriptions and /v1/audio/translations over the real engine serving a
tiny Whisper that transformers wrote: every response format, the form's bad fields and hostile
files as 400s in OpenAI's shape (the server healthy after), and the official client against a
live ``mlxr serve``."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

soundfile = pytest.importorskip("soundfile")
pytest.importorskip("torch", reason="the tiny Whisper is written by transformers")
pytest.importorskip("transformers", reason="the tiny Whisper is written by transformers")

from scripted import live_server  # noqa: E402

from mlxr_core.config.schema import Config, ModelConfig  # noqa: E402
from mlxr_core.testing.pytest_plugin import wait_for_url  # noqa: E402

RATE = 16_000


def tone_wav(seconds: float, rate: int = RATE) -> bytes:
    """A tone sequence (a quarter second each, rising) as a 16-bit WAV."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 300.0 + 100.0 * (t * 4).astype(int)
    out = io.BytesIO()
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.whisper_reference import tiny_whisper

    folder = tmp_path_factory.mktemp("whisper-api")
    tiny_whisper(folder, chunk_length=2)
    return folder


@pytest.fixture(scope="module")
def client(whisper_folder: Path) -> Iterator[httpx.Client]:
    config = Config(models=[ModelConfig(path=str(whisper_folder), name="whisper")], apis=["openai"])
    config.server.max_audio_seconds = 10.0
    with live_server(config) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http


def post(client: httpx.Client, data: dict[str, Any], audio: bytes | None = None, path: str = "/v1/audio/transcriptions") -> Any:
    files = {"file": ("clip.wav", audio if audio is not None else tone_wav(3.1), "audio/wav")}
    return client.post(path, data={"model": "whisper", **data}, files=files)


def test_json_and_text(client: httpx.Client) -> None:
    r = post(client, {"language": "en"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["text"], str) and body["usage"] == {"type": "duration", "seconds": pytest.approx(3.1)}
    r = post(client, {"language": "en", "response_format": "text"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == body["text"] + "\n"  # greedy: the same transcript


def test_verbose_json_segments_cover_the_sound(client: httpx.Client) -> None:
    r = post(client, {"language": "de", "response_format": "verbose_json", "timestamp_granularities[]": "segment"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["task"] == "transcribe" and body["language"] == "german" and body["duration"] == pytest.approx(3.1)
    segments = body["segments"]
    assert segments and [s["id"] for s in segments] == list(range(len(segments)))
    for segment in segments:
        assert set(segment) >= {"id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                                "compression_ratio", "no_speech_prob"}  # fmt: skip
        assert 0 <= segment["start"] <= segment["end"]
    assert max(s["seek"] for s in segments) > 0  # 3.1 s is more than the 2 s window
    assert body["text"] == "".join(s["text"] for s in segments).strip()


@pytest.mark.parametrize("granularities", [["word"], ["word", "segment"]])
def test_verbose_json_words(client: httpx.Client, granularities: list[str]) -> None:
    form = {"language": "en", "response_format": "verbose_json", "timestamp_granularities[]": granularities}
    r = post(client, form)
    assert r.status_code == 200, r.text
    body = r.json()
    words = body["words"]
    assert words and all(set(word) == {"word", "start", "end"} for word in words)
    assert all(isinstance(w["word"], str) and w["word"] == w["word"].strip() for w in words)
    assert all(0 <= w["start"] <= w["end"] <= 3.1 + 2 for w in words) and words[-1]["end"] > 2.0  # both windows
    assert [w["start"] for w in words[:3]] == sorted(w["start"] for w in words[:3])
    assert ("segments" in body) == ("segment" in granularities)  # only words were asked for: no segments
    assert "".join(w["word"] for w in words) == "".join(body["text"].split())


@pytest.mark.parametrize("kind", ["srt", "vtt"])
def test_subtitles(client: httpx.Client, kind: str) -> None:
    r = post(client, {"language": "en", "response_format": kind})
    assert r.status_code == 200, r.text
    cue = r"\d\d:\d\d:\d\d[.,]\d\d\d --> \d\d:\d\d:\d\d[.,]\d\d\d"
    assert re.search(cue, r.text)
    assert r.text.startswith("WEBVTT\n\n" if kind == "vtt" else "1\n")
    assert ("," in r.text.split("-->")[0]) == (kind == "srt")


def test_translations(client: httpx.Client) -> None:
    r = post(client, {"response_format": "verbose_json"}, path="/v1/audio/translations")
    assert r.status_code == 200, r.text
    assert r.json()["task"] == "translate" and r.json()["language"] in ("english", "german", "french")


def refused(r: Any, field: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    return str(error["message"])


@pytest.mark.parametrize(
    ("audio", "words"),
    [
        (b"", "empty"),
        (b"this is not audio at all" * 10, "no format"),
        (tone_wav(1.0)[:30], "cannot be read"),
        (tone_wav(11.0), "max_audio_seconds"),
    ],
)
def test_hostile_files_are_400s_and_the_server_keeps_serving(client: httpx.Client, audio: bytes, words: str) -> None:
    assert words in refused(post(client, {}, audio), "file")
    assert client.get("/health").status_code == 200
    assert post(client, {"language": "en"}, tone_wav(0.5)).status_code == 200


def test_bad_fields_are_400s(client: httpx.Client) -> None:
    assert "response_format" in refused(post(client, {"response_format": "xml"}), "response_format")
    for form in ({"timestamp_granularities[]": "word"}, {"timestamp_granularities[]": "word", "response_format": "srt"}):
        assert "verbose_json" in refused(post(client, form), "timestamp_granularities")  # as OpenAI refuses it
    assert "segment or word" in refused(post(client, {"timestamp_granularities[]": "phoneme"}), "timestamp_granularities")
    assert "xx" in refused(post(client, {"language": "xx"}), "language")
    refused(post(client, {"temperature": "hot"}), "temperature")
    assert "4096" in refused(post(client, {"prompt": "word " * 1000}), "prompt")  # tokenized on the event loop
    r = client.post("/v1/audio/transcriptions", data={"model": "whisper"})
    refused(r, "file")


def test_text_requests_to_a_speech_model_are_refused(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400  # no chat template; a prompt of ids is refused at admission
    r = client.post("/v1/completions", json={"model": "whisper", "prompt": [5, 6, 7], "max_tokens": 2})
    assert "transcribes audio" in refused(r, "model")
    r = client.post("/v1/embeddings", json={"model": "whisper", "input": [5, 6, 7]})
    assert "transcribes audio" in refused(r, "model")


def test_transcriptions_past_their_limit_or_a_full_queue_are_429s(
    whisper_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxr_core.engine.client import EngineCaller
    from mlxr_core.engine.engine import Engine

    entered, release = threading.Event(), threading.Event()
    transcribe_async = EngineCaller.transcribe_async

    async def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.to_thread(release.wait, 60)
        return await transcribe_async(self, *args, **kwargs)

    monkeypatch.setattr(EngineCaller, "transcribe_async", held)
    config = Config(models=[ModelConfig(path=str(whisper_folder), name="whisper")], apis=["openai"])
    config.engine.max_transcriptions = 1
    config.engine.max_queue = 2
    with live_server(config) as url, httpx.Client(base_url=url, timeout=120) as http:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, http, {"language": "en"})
            assert entered.wait(60)
            for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
                r = post(http, {}, path=path)
                assert r.status_code == 429 and r.headers["retry-after"], r.text
                error = r.json()["error"]
                assert "engine.max_transcriptions" in error["message"] and error["type"] == "rate_limit_error"
            release.set()
            assert first.result(120).status_code == 200
        assert post(http, {"language": "en"}, tone_wav(0.5)).status_code == 200  # its slot was given back
        # Generation requests filling the queue refuse a transcription as they refuse one another.
        monkeypatch.setattr(Engine, "queue_depth", property(lambda self: 2))
        r = post(http, {"language": "en"}, tone_wav(0.5))
        assert r.status_code == 429 and "engine.max_queue" in r.json()["error"]["message"], r.text
        monkeypatch.undo()


def test_the_document_states_the_form(client: httpx.Client) -> None:
    document = client.get("/schema/openapi.json").json()
    operation = document["paths"]["/v1/audio/transcriptions"]["post"]
    form = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["file"]["format"] == "binary" and set(form["required"]) == {"file", "model"}


@pytest.mark.slow
def test_the_openai_client_transcribes_from_a_live_server(whisper_folder: Path, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {whisper_folder}\n    name: whisper\napis: [openai]\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        url = wait_for_url(process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        wav = tmp_path / "tones.wav"
        wav.write_bytes(tone_wav(2.5))
        with wav.open("rb") as file:
            plain = client.audio.transcriptions.create(model="whisper", file=file, language="en")
        assert isinstance(plain.text, str)
        with wav.open("rb") as file:
            verbose = client.audio.transcriptions.create(
                model="whisper", file=file, response_format="verbose_json", timestamp_granularities=["segment"]
            )
        assert verbose.duration == pytest.approx(2.5) and verbose.segments
        assert all(segment.start <= segment.end for segment in verbose.segments)
        for granularities in (["word"], ["word", "segment"]):
            with wav.open("rb") as file:
                timed = client.audio.transcriptions.create(
                    model="whisper", file=file, response_format="verbose_json", timestamp_granularities=granularities
                )
            assert timed.words and all(0 <= w.start <= w.end and isinstance(w.word, str) for w in timed.words)
            assert bool(timed.segments) == ("segment" in granularities)
    finally:
        process.terminate()
        process.communicate(timeout=30)
