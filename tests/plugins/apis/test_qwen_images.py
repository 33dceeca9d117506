"""Images through the APIs to a live server with a tiny random Qwen2.5-VL or Qwen3-VL model, whose
image token count follows from the image's size: the official clients send a PNG made here, and
``usage`` counts exactly the image's tokens (a 40x30 PNG is resized to 40x32 pixels, a grid of
5x4 tokens, between ``<|vision_start|>`` and ``<|vision_end|>``)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from scripted import live_server

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.testing.tiny_vision import qwen2_5_vl_model, qwen3_vl_model

Image = pytest.importorskip("PIL.Image", reason="image input needs Pillow")

#: A 40x30 PNG's tokens: 5x4 image tokens, <|vision_start|> and <|vision_end|>.
IMAGE_TOKENS = 5 * 4 + 2
TEXT = [{"type": "text", "text": "t5 t6"}]


def png(width: int = 40, height: int = 30) -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    torch = pytest.importorskip("torch", reason="the tiny vision model is written by transformers")
    transformers = pytest.importorskip("transformers", reason="the tiny vision model is written by transformers")
    folder = tmp_path_factory.mktemp(request.param)
    writer = qwen2_5_vl_model if request.param == "qwen2_5_vl" else qwen3_vl_model
    writer(folder, torch, transformers)
    config = Config(
        models=[ModelConfig(path=str(folder), name="vl", dtype="float32")],
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    with live_server(config) as url:
        yield url


@pytest.mark.slow
def test_the_openai_client_sends_an_image(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    uri = "data:image/png;base64," + base64.b64encode(png()).decode()
    content: Any = [*TEXT, {"type": "image_url", "image_url": {"url": uri}}]
    reply = client.chat.completions.create(
        model="vl", max_tokens=3, temperature=0, messages=[{"role": "user", "content": content}]
    )
    text_only = client.chat.completions.create(model="vl", max_tokens=2, messages=[{"role": "user", "content": TEXT}])
    assert reply.usage is not None and text_only.usage is not None
    assert reply.usage.completion_tokens == 3
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    # A larger image has more tokens: 48x32 pixels, a grid of 6x4.
    uri = "data:image/png;base64," + base64.b64encode(png(48, 32)).decode()
    content = [*TEXT, {"type": "image_url", "image_url": {"url": uri}}]
    larger = client.chat.completions.create(model="vl", max_tokens=1, messages=[{"role": "user", "content": content}])
    assert larger.usage is not None and larger.usage.prompt_tokens == text_only.usage.prompt_tokens + 6 * 4 + 2


@pytest.mark.slow
def test_the_anthropic_and_ollama_clients_send_an_image(server: str) -> None:
    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()}}
    messages: Any = [{"role": "user", "content": [*TEXT, block]}]
    counted = client.messages.count_tokens(model="vl", messages=messages).input_tokens
    text_only = client.messages.count_tokens(model="vl", messages=[{"role": "user", "content": TEXT}]).input_tokens
    assert counted == text_only + IMAGE_TOKENS
    reply = client.messages.create(model="vl", max_tokens=3, messages=messages, extra_body={"temperature": 0})
    assert reply.usage.output_tokens == 3 and reply.usage.input_tokens == counted
    chat = ollama.Client(host=server, timeout=60).chat(
        model="vl", messages=[{"role": "user", "content": "t5 t6", "images": [png()]}], options={"num_predict": 2, "temperature": 0}
    )
    assert chat.eval_count == 2 and chat.prompt_eval_count >= IMAGE_TOKENS + 2
