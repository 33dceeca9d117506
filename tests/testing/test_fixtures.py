"""The fixtures mlxr's pytest plugin gives every project that installs mlxr."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams


def test_plugin_host_is_fresh_and_sees_fake_dists(plugin_host, fake_plugin_dist):
    assert plugin_host.plugins["openai"].state == "ok"
    fake_plugin_dist("mlxr-test-late", modules={"mlxr_test_late": ""}, entry_points={"late": "mlxr_test_late"})
    assert "late" not in plugin_host.plugins  # loaded before the dist existed: a snapshot


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_model_of_a_registered_arch(tiny_model, model_type):
    model = tiny_model(model_type)
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 97)
    assert float(mx.std(logits).item()) > 0.1


def test_toy_tokenizer_round_trips_and_templates(toy_tokenizer):
    ids = toy_tokenizer.encode("the water", add_special_tokens=False)
    assert toy_tokenizer.decode(ids) == "the water"
    prompt = toy_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_engine_generates(tiny_engine, toy_tokenizer):
    assert tiny_engine.state == "ready" and "tiny" in tiny_engine.models
    handle = tiny_engine.submit(
        GenerationRequest(
            model="tiny", prompt_ids=toy_tokenizer.encode("the"), params=SamplingParams(max_tokens=3, temperature=0.0)
        )
    )
    events = list(handle)
    assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens > 0


@pytest.mark.slow
def test_live_server_answers(live_server):
    import httpx

    url = live_server(apis=["openai"])
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
