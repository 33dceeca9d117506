"""Streamed experts against resident ones on a random Qwen3-MoE-shaped 4-bit GGUF under a memory cap.

``--write`` writes a random ``qwen3moe`` GGUF (Qwen3-30B-A3B's layer: hidden 2048, 32/4 heads of 128,
128 experts of width 768, 8 a token; ``--layers`` of them, a 32,000-token vocabulary; every matrix
Q4_0 from random blocks). Each run then serves it in a child process through the engine: 1 and
``--streams`` greedy streams of ``--tokens`` tokens, and prints decode tokens/s, the experts' cache
hit rate and bytes read per token (``/metrics``' figures). ``--cap`` runs the streamed child inside
a cgroup whose memory limit (``memory.max`` on cgroup v2, ``memory.limit_in_bytes`` on v1) is that
share of the file's size: the page cache counts against it too, so the file cannot sit in memory.

    python bench/expert_stream.py --write /tmp/moe.gguf --layers 6
    python bench/expert_stream.py --model /tmp/moe.gguf --cap 0.33 --cache-share 0.12 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPE = {"hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
         "expert_width": 768, "vocab": 32000}  # fmt: skip


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, lead: tuple[int, ...] = ()) -> np.ndarray:
    """Random Q4_0 blocks ``[*lead, rows, cols / 32 * 18]``: a float16 scale near 1/sqrt(cols)
    and 16 bytes of random nibbles per 32 values."""
    blocks = rng.integers(0, 256, (*lead, rows, cols // 32, 18), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, blocks.shape[:-1]) / np.sqrt(cols) / 4).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(*lead, rows, cols // 32 * 18)


def write_model(path: Path, layers: int, seed: int = 0) -> None:
    import gguf

    from mlxr_core.testing.tiny import tiny_gpt2_vocab

    s, rng = SHAPE, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    H, D, E, W = s["hidden"], s["head_dim"], s["experts"], s["expert_width"]
    for key, value in {"block_count": layers, "context_length": 4096, "embedding_length": H,
                       "feed_forward_length": 6144, "attention.head_count": s["heads"],
                       "attention.head_count_kv": s["kv_heads"], "attention.key_length": D,
                       "attention.value_length": D, "expert_count": E, "expert_used_count": s["top_k"],
                       "expert_feed_forward_length": W}.items():  # fmt: skip
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen3moe.rope.freq_base", 1e6)
    tokens, types, merges = tiny_gpt2_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def norm(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", q4_0_blocks(rng, s["vocab"], H), raw_dtype=q4)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(H))
        for name, rows, cols in (("attn_q", s["heads"] * D, H), ("attn_k", s["kv_heads"] * D, H),
                                 ("attn_v", s["kv_heads"] * D, H), ("attn_output", H, s["heads"] * D)):  # fmt: skip
            writer.add_tensor(f"blk.{i}.{name}.weight", q4_0_blocks(rng, rows, cols), raw_dtype=q4)
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", norm(D))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", norm(D))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(H))
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32))
        for name, rows, cols in (("ffn_gate_exps", W, H), ("ffn_up_exps", W, H), ("ffn_down_exps", H, W)):
            writer.add_tensor(f"blk.{i}.{name}.weight", q4_0_blocks(rng, rows, cols, (E,)), raw_dtype=q4)
    writer.add_tensor("output_norm.weight", norm(H))
    writer.add_tensor("output.weight", q4_0_blocks(rng, s["vocab"], H), raw_dtype=q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def enter_cgroup(limit: int) -> str:
    """Move this process into a fresh child memory cgroup of ours limited to ``limit`` bytes."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in own if line.split(":")[1] == "memory"), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        group, knob = Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / f"mlxr_bench_{os.getpid()}", "memory.limit_in_bytes"
    else:
        v2 = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
        group, knob = Path("/sys/fs/cgroup") / v2.lstrip("/") / f"mlxr_bench_{os.getpid()}", "memory.max"
    group.mkdir()
    (group / knob).write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return f"{group}/{knob}={limit}"


def serve(model: str, streams: int, tokens: int, experts: dict[str, Any]) -> dict[str, Any]:
    """Greedy streams through the engine: generated tokens/s from submission to the last token
    (prompts of 8 tokens: prefill is a small share), the last first token's delay."""
    import mlxr_core  # noqa: F401  (preloads a fast BLAS before MLX)
    from mlxr_core.config.schema import Config, EngineConfig, ExpertsConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    config = ModelConfig(path=str(model), name="bench", context_length=256, experts=ExpertsConfig(**experts))
    started = time.perf_counter()
    # MLX's allocator keeps freed buffers for reuse: bounded here so that the cap measures the model.
    settings = EngineConfig(max_batch_size=max(streams, 1), mlx_cache_limit_bytes=64 * 2**20)
    engine = Engine(Config(models=[config], engine=settings), load_plugins())
    engine.start()
    loaded = time.perf_counter() - started
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, extra={"ignore_eos": True})
        prompts = [[40 + 7 * row + j for j in range(8)] for row in range(streams)]
        begin = time.perf_counter()
        handles = [engine.submit(GenerationRequest(model="bench", prompt_ids=p, params=params)) for p in prompts]
        firsts, counts = [], []
        for handle in handles:
            first, count = None, 0
            for event in handle:
                if isinstance(event, Delta) and event.token_ids:
                    first = first or time.perf_counter()
                    count += len(event.token_ids)
            firsts.append(first)
            counts.append(count)
        end = time.perf_counter()
        stats = engine.stats()["experts"].get("bench")
        rss = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    finally:
        engine.stop()
    return {"streams": streams, "tokens": sum(counts), "load_s": round(loaded, 1),
            "tok_s": round(sum(counts) / (end - begin), 3),
            "first_token_s": round(max(f for f in firsts if f) - begin, 2),
            "wall_s": round(end - begin, 1), "peak_rss_bytes": rss,
            "experts": None if stats is None else {k: stats[k] for k in (
                "hit_rate", "bytes_per_token", "requests", "hits", "waits", "misses", "bytes_read",
                "read_p50_seconds", "read_p99_seconds", "cache_capacity")}}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    cap = enter_cgroup(args.limit) if args.limit else None
    experts = json.loads(args.experts)
    results = [serve(args.model, streams, args.tokens, experts) for streams in args.stream_counts]
    print(json.dumps({"cap": cap, "experts": experts, "runs": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="write the random GGUF here and stop")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--cap", type=float, default=0.33, help="memory limit of the streamed runs, share of the file")
    parser.add_argument("--cache-share", type=float, default=0.12, help="cache_bytes as a share of the file")
    parser.add_argument("--prefetch", nargs="+", default=["previous"], help="read-ahead settings to run, capped")
    parser.add_argument("--policy", default="lru", help="models[].experts.policy of the streamed runs")
    parser.add_argument("--no-resident", action="store_true", help="skip the uncapped resident run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--experts", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--stream-counts", type=int, nargs="+", default=[1], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        write_model(args.write, args.layers)
        print(f"{args.write}: {args.write.stat().st_size / 1e9:.2f} GB")
        return
    if args.child:
        child(args)
        return
    size = args.model.stat().st_size
    counts = [str(n) for n in sorted({1, args.streams})]
    runs: list[tuple[str, int, dict[str, Any]]] = []
    if not args.no_resident:
        runs.append(("resident, no cap", 0, {}))
    for prefetch in args.prefetch:
        runs.append((f"streamed, cap {args.cap:.2f} x file, {args.policy}, prefetch {prefetch}", int(size * args.cap),
                     {"residency": "stream", "cache_bytes": int(size * args.cache_share), "prefetch": prefetch,
                      "policy": args.policy}))  # fmt: skip
    report: dict[str, Any] = {"command": " ".join(sys.argv), "file_bytes": size, "shape": SHAPE, "results": {}}
    for label, limit, experts in runs:
        command = [sys.executable, __file__, "--child", "--model", str(args.model), "--tokens", str(args.tokens),
                   "--limit", str(limit), "--experts", json.dumps(experts), "--stream-counts", *counts]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = process.communicate()
        for group in Path("/sys/fs/cgroup").glob(f"**/mlxr_bench_{process.pid}"):
            group.rmdir()  # the child's cgroup, empty now
        if process.returncode != 0:  # -9: killed at the cap
            report["results"][label] = {"failed": process.returncode, "stderr": stderr[-2000:]}
        else:
            report["results"][label] = json.loads(stdout.strip().splitlines()[-1])
        print(label, json.dumps(report["results"][label])[:600], flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
