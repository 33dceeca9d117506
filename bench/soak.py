"""A soak of ``mlxr serve``: many mixed streaming clients for minutes, some leaving mid-stream.

Starts ``mlxr serve`` (the default model unless ``--model``) on a free port and runs ``--clients``
concurrent clients for ``--seconds``. Each client loops over requests drawn at random: OpenAI
chat completions, Anthropic messages and Ollama chat, all streamed, and OpenAI embeddings; a
share of the streams (``--disconnect``) is dropped by the client after its first events. Counted:
completed requests (a stream's final event, an embedding's 200), intended disconnects, explicit
rejections (429 or 503: the queue is full, in the API's error shape), bad requests answered with
their 4xx (``--bad``: broken JSON, an unknown model, a schema or grammar past the constraint
limits, a negative ``max_tokens``), and lost ones (any other status, a stream that ends without its
final event, a transport error). After the run the server's gauges (``mlxr_requests_inflight``,
``_running``, ``mlxr_queue_depth``, KV bytes) must return to 0; its resident memory is sampled every
``--sample`` seconds through the run and compared with its value after the warm-up (the samples
and their least-squares slope, in MB per minute, are in the report). The server's own output (warnings
and errors) goes to ``--out`` with the suffix ``.log``.

    python bench/soak.py --clients 64 --seconds 600 --out bench/results/soak_smollm2_cpu.json
    python bench/soak.py --clients 64 --seconds 600 --core process --out bench/results/soak_smollm2_cpu_process.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

GAUGES = ("mlxr_requests_inflight", "mlxr_requests_running", "mlxr_queue_depth", "mlxr_kv_cache_bytes")
#: What ends each kind of stream (a line containing it).
FINAL = {"openai": "[DONE]", "anthropic": "message_stop", "ollama": '"done":true'}


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start(model: str | None, core: str = "thread", log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``mlxr serve``; once it is ready, its output is copied to ``log`` (or dropped) by a
    thread, so that a server that logs a lot never blocks on a full pipe."""
    command = [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--port", "0", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLXR_ENGINE__CORE": core, **({"MLXR_MODEL": model} if model else {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    deadline = time.monotonic() + 300
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if match := re.search(r"serving .* at (http://\S+)", line):
            threading.Thread(target=drain, args=(process.stdout, log, seen), daemon=True).start()
            return process, match[1]
    process.kill()
    raise SystemExit("mlxr serve did not become ready:\n" + "".join(seen[-20:]))


def drain(stream: Any, log: Path | None, seen: list[str]) -> None:
    """Copy the server's output to ``log`` until it closes."""
    with open(log or os.devnull, "w") as out:
        out.writelines(seen)
        for line in stream:
            out.write(line)
            out.flush()


def request(kind: str, model: str, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """(method path, stream kind, body) of one request of ``kind``."""
    text = rng.choice(["Tell me a story.", "What is 2 + 2?", "Name three colours.", "Say hello in French."])
    tokens = rng.randint(4, 48)
    if kind == "openai":
        return "/v1/chat/completions", kind, {"model": model, "messages": [{"role": "user", "content": text}],
                                              "max_tokens": tokens, "stream": True}
    if kind == "anthropic":
        return "/v1/messages", kind, {"model": model, "max_tokens": tokens, "stream": True,
                                      "messages": [{"role": "user", "content": text}]}
    if kind == "ollama":
        return "/api/chat", kind, {"model": model, "messages": [{"role": "user", "content": text}],
                                   "stream": True, "options": {"num_predict": tokens}}
    return "/v1/embeddings", kind, {"model": model, "input": [text] * rng.randint(1, 4)}


def bad_request(model: str, rng: random.Random) -> tuple[str, bytes]:
    """(path, body) of a request the server must refuse with a 4xx."""
    deep = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)}
    deep["d3000"] = {"type": "integer"}
    chat = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "JSON"}]}
    bodies: list[tuple[str, Any]] = [
        ("/v1/chat/completions", b'{"model": "' + model.encode() + b'", "messages": ['),
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("/v1/chat/completions", {**chat, "max_tokens": -1}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$defs": deep, "$ref": "#/$defs/d0"}}}}),
        ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}], "format": {"$defs": deep, "$ref": "#/$defs/d0"}}),
        ("/v1/messages", {"model": model, "messages": [{"role": "user", "content": "x"}]}),  # no max_tokens
    ]
    path, body = rng.choice(bodies)
    return path, body if isinstance(body, bytes) else json.dumps(body).encode()


async def client(
    index: int, url: str, model: str, until: float, disconnect: float, bad: float, tally: dict[str, Any]
) -> None:
    rng = random.Random(index)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            if rng.random() < bad:
                path, content = bad_request(model, rng)
                try:
                    reply = await http.post(path, content=content, headers={"content-type": "application/json"})
                except httpx.HTTPError as exc:
                    tally["lost"] += 1
                    tally["lost_detail"].append(f"bad {path}: {type(exc).__name__}: {exc}")
                    continue
                if 400 <= reply.status_code < 500:
                    tally["refused_bad"] += 1
                else:
                    tally["lost"] += 1
                    tally["lost_detail"].append(f"bad {path}: {reply.status_code} {reply.text[:200]}")
                continue
            kind = rng.choice(["openai", "anthropic", "ollama", "embeddings"])
            path, stream, body = request(kind, model, rng)
            leave = kind != "embeddings" and rng.random() < disconnect
            try:
                if kind == "embeddings":
                    reply = await http.post(path, json=body)
                    if reply.status_code in (429, 503):
                        tally["rejected"] += 1
                        continue
                    ok = reply.status_code == 200 and len(reply.json()["data"]) == len(body["input"])
                    tally["completed" if ok else "lost"] += 1
                    if not ok:
                        tally["lost_detail"].append(f"{kind} {reply.status_code} {reply.text[:200]}")
                    continue
                async with http.stream("POST", path, json=body) as reply:
                    if reply.status_code in (429, 503):
                        tally["rejected"] += 1
                        continue
                    if reply.status_code != 200:
                        tally["lost"] += 1
                        tally["lost_detail"].append(f"{kind} {reply.status_code}")
                        continue
                    seen, final, last = 0, False, []
                    async for line in reply.aiter_lines():
                        seen += 1
                        last = [*last[-2:], line[:200]] if line else last
                        if FINAL[stream] in line.replace(" ", ""):
                            final = True
                        if leave and seen >= 3:
                            break
                    if leave:
                        tally["disconnected"] += 1
                    elif final:
                        tally["completed"] += 1
                    else:
                        tally["lost"] += 1
                        tally["lost_detail"].append(f"{kind}: no final event after {seen} lines: {last}")
            except httpx.HTTPError as exc:
                tally["lost"] += 1
                tally["lost_detail"].append(f"{kind}: {type(exc).__name__}: {exc}")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for name in GAUGES:
        found = [float(m[1]) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        values[name] = sum(found)
    return values


async def soak(url: str, model: str, clients: int, seconds: float, disconnect: float, bad: float) -> dict[str, Any]:
    tally: dict[str, Any] = {
        "completed": 0, "disconnected": 0, "rejected": 0, "refused_bad": 0, "lost": 0, "lost_detail": []
    }
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(i, url, model, until, disconnect, bad, tally) for i in range(clients)))
    return tally


def sample_rss(pids: list[int], every: float, stop: threading.Event, samples: list[tuple[float, int]]) -> None:
    """Append (seconds since start, resident bytes of ``pids`` together) every ``every`` seconds."""
    started = time.monotonic()
    while not stop.wait(every):
        samples.append((round(time.monotonic() - started, 1), sum(rss(pid) for pid in pids)))


def slope_mb_per_minute(samples: list[tuple[float, int]]) -> float | None:
    """The least-squares slope of the samples, in MB per minute."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if not var:
        return None
    cov = sum((t - mean_t) * (b - mean_b) for t, b in samples)
    return round(cov / var * 60 / 1e6, 3)


def server_pids(pid: int) -> list[int]:
    """The server's process and its children (the engine process under ``--core process``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [pid]
    if children.exists():
        for child in children.read_text().split():
            found += server_pids(int(child))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model path, as MLXR_MODEL takes it (default: mlxr serve's default)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--warmup", type=float, default=60, help="seconds of load before the memory baseline")
    parser.add_argument("--disconnect", type=float, default=0.2, help="share of streams the client drops")
    parser.add_argument("--bad", type=float, default=0.1, help="share of requests that are bad (a 4xx expected)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--core", choices=("thread", "process"), default="thread", help="engine.core")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    process, url = start(args.model, args.core, args.out.with_suffix(".log") if args.out else None)
    try:
        model = httpx.get(f"{url}/health").json()["models"][0]
        warm = asyncio.run(soak(url, model, args.clients, args.warmup, args.disconnect, args.bad))
        pids = server_pids(process.pid)
        baseline = sum(rss(pid) for pid in pids)
        samples: list[tuple[float, int]] = [(0.0, baseline)]
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(pids, args.sample, stop, samples), daemon=True)
        sampler.start()
        started = time.perf_counter()
        tally = asyncio.run(soak(url, model, args.clients, args.seconds, args.disconnect, args.bad))
        elapsed = time.perf_counter() - started
        stop.set()
        sampler.join()
        deadline, after = time.monotonic() + 60, gauges(url)
        while any(after.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            after = gauges(url)
        final = sum(rss(pid) for pid in pids)
        report = {
            "model": model,
            "core": args.core,
            "clients": args.clients,
            "seconds": round(elapsed, 1),
            "disconnect_share": args.disconnect,
            "bad_share": args.bad,
            "warmup": {k: v for k, v in warm.items() if k != "lost_detail"},
            **{k: v for k, v in tally.items() if k != "lost_detail"},
            "lost_examples": tally["lost_detail"][:20],
            "gauges_after": after,
            "rss_after_warmup_bytes": baseline,
            "rss_at_end_bytes": final,
            "rss_change": (final - baseline) / baseline if baseline else None,
            "rss_slope_mb_per_minute": slope_mb_per_minute(samples),
            "rss_samples_mb": [(t, round(b / 1e6, 1)) for t, b in samples],
        }
    finally:
        process.terminate()
        process.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = report["lost"] == 0 and not any(report["gauges_after"].values()) and abs(report["rss_change"] or 0) <= 0.10
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
