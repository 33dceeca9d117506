"""A request's templating and tokenizing run on daemon threads that a shutdown abandons: the request
ends with a 503 as the drain begins, and the process exits without waiting for the thread."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

from mlxr_core.errors import EngineStopped
from mlxr_core.http.offload import offload
from mlxr_core.model.template_budget import interrupt_renders


def test_offload_returns_what_the_work_returns_and_raises_what_it_raises() -> None:
    def fails() -> None:
        raise ValueError("no")

    async def run() -> None:
        assert await offload(lambda: 42) == 42
        with pytest.raises(ValueError, match="no"):
            await offload(fails)

    asyncio.run(run())


def test_a_shutdown_lets_the_request_go_while_its_thread_runs_on() -> None:
    started, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def work() -> str:
        threads.append(threading.current_thread())
        started.set()
        release.wait(10)  # work that no interrupt reaches (a tokenizer, a native call)
        return "late"

    async def run() -> None:
        limiter = anyio.CapacityLimiter(1)
        waiting = asyncio.ensure_future(offload(work, limiter=limiter))
        while not started.is_set():
            await asyncio.sleep(0.01)
        interrupt_renders()
        with pytest.raises(EngineStopped, match="shutting down"):
            await asyncio.wait_for(waiting, 2)
        assert limiter.borrowed_tokens == 1  # the thread keeps its token until it ends
        release.set()
        for _ in range(200):
            if not limiter.borrowed_tokens:
                break
            await asyncio.sleep(0.01)
        assert limiter.borrowed_tokens == 0
        assert await offload(lambda: "after") == "after"  # later work runs

    asyncio.run(run())
    assert threads[0].daemon


def test_a_cancelled_request_does_not_wait_for_its_thread() -> None:
    release = threading.Event()

    async def run() -> None:
        waiting = asyncio.ensure_future(offload(lambda: release.wait(10)))
        await asyncio.sleep(0.05)
        waiting.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert time.monotonic() - started < 1

    try:
        asyncio.run(run())
    finally:
        release.set()


#: A render that only its deadline (5 s in a server) or a shutdown stops: 1M items through 24 maps.
LONG_RENDER = "{{ ((range(100000)|list)*10)" + "|map('string')|map('length')" * 12 + "|sum }}"


@pytest.mark.slow
def test_sigterm_during_a_long_render_answers_503_and_exits_promptly(tmp_path: Path) -> None:
    """Before, such a render ran on for minutes: uvicorn cut its request with a 500 and the process
    waited for the thread long after "Finished server process"."""
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    model = write_tiny_llama_gguf(tmp_path / "slow.gguf", chat_template=LONG_RENDER)
    config = tmp_path / "server.yaml"
    config.write_text(
        f"models:\n  - path: {model}\n    name: slow\n    context_length: 4096\n"
        "apis: [openai]\nserver:\n  shutdown_timeout: 1.0\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    lines: list[str] = []
    try:
        while not (served := re.search(r"serving .* at (http://\S+)", lines[-1] if lines else "")):
            line = process.stdout.readline()
            assert line, "mlxr serve ended before serving:\n" + "".join(lines)
            lines.append(line)
        url = served[1]
        replies: list[httpx.Response] = []
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        client = threading.Thread(
            target=lambda: replies.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)), daemon=True
        )
        client.start()
        time.sleep(1.0)  # the render is under way
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        took = time.monotonic() - sent
        client.join(10)
    finally:
        process.kill()
    output = "".join(lines) + output
    assert process.returncode == 0 and took < 1.0 + 4, (took, output[-2000:])
    assert replies and replies[0].status_code == 503, (replies, output[-2000:])
    assert "shutting down" in replies[0].json()["error"]["message"]
    assert "Traceback" not in output and "CancelledError" not in output
