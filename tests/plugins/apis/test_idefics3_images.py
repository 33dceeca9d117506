"""Images through the APIs to a live server with a tiny random Idefics3 model, whose image tokens
follow from the image's tiles: the official clients send a PNG made here, and ``usage`` counts
exactly the processor's text for it. A 40x30 PNG is resized to 64x48, rounded up to 2x2 tiles of
32 pixels: each tile ``<fake_token_around_image><row_i_col_j>`` and 4 image tokens, then the whole
image between ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>`` (the
tiny tokenizer drops the newlines between rows); a 90x30 PNG gives 1x2 tiles."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from scripted import live_server
from test_qwen_images import TEXT, png

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.testing.tiny_vision import idefics3_model

TILE, WHOLE = 2 + 4, 3 + 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    torch = pytest.importorskip("torch", reason="the tiny vision model is written by transformers")
    transformers = pytest.importorskip("transformers", reason="the tiny vision model is written by transformers")
    folder = tmp_path_factory.mktemp("idefics3")
    idefics3_model(folder, torch, transformers)
    config = Config(
        models=[ModelConfig(path=str(folder), name="vl", dtype="float32")],
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    with live_server(config) as url:
        yield url


@pytest.mark.slow
def test_the_openai_and_ollama_clients_send_tiled_images(server: str) -> None:
    ollama = pytest.importorskip("ollama")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    text_only = client.chat.completions.create(model="vl", max_tokens=1, messages=[{"role": "user", "content": TEXT}])
    assert text_only.usage is not None
    for (width, height), tokens in (((40, 30), 4 * TILE + WHOLE), ((90, 30), 2 * TILE + WHOLE)):
        uri = "data:image/png;base64," + base64.b64encode(png(width, height)).decode()
        content: Any = [*TEXT, {"type": "image_url", "image_url": {"url": uri}}]
        reply = client.chat.completions.create(
            model="vl", max_tokens=3, temperature=0, messages=[{"role": "user", "content": content}]
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + tokens
    chat = ollama.Client(host=server, timeout=60).chat(
        model="vl", messages=[{"role": "user", "content": "t5 t6", "images": [png()]}], options={"num_predict": 2, "temperature": 0}
    )
    assert chat.eval_count == 2 and chat.prompt_eval_count == text_only.usage.prompt_tokens + 4 * TILE + WHOLE
