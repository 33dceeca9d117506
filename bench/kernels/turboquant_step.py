"""Where a TurboQuant decode step's time goes, one attention layer at a time (GPU or CPU).

One layer of a Llama-3.2-1B shape (8 KV heads, 32 query heads, head size 64) holding ``--context``
positions: the time of a whole ``update_and_attend`` decode call, and of its parts alone (writing
the new position: encoding and storing it; the scores; the weighted values), on the fused kernels
and on the reference backend, beside full-precision attention over an ordinary cache. Each figure
is the median over ``--iters`` calls of a synchronized call (``mx.eval`` after each), so it holds
the host's launch work as a decode step pays it.

    python bench/kernels/turboquant_step.py --context 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

# isort: split
import mlx.core as mx

from mlxr_core.model.cache import KVCache
from mlxr_plugins.kv_caches import turboquant
from mlxr_plugins.kv_caches.turboquant import TurboQuantKV, TurboQuantKVCache

HQ, HKV, D = 32, 8, 64


def timed(fn, iters: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    runs = []
    for _ in range(iters):
        started = time.perf_counter()
        mx.eval(fn())
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--bits", type=int, default=3)
    args = parser.parse_args()
    S = args.context
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    mx.random.seed(0)
    keys, values = (mx.random.normal((1, HKV, S, D)).astype(dtype) for _ in range(2))
    q, k, v = (mx.random.normal((1, h, 1, D)).astype(dtype) for h in (HQ, HKV, HKV))
    sdpa = mx.fast.scaled_dot_product_attention
    report: dict[str, float] = {}

    full = KVCache()
    full.update_and_fetch(keys, values)

    def full_step():
        fk, fv = full.update_and_fetch(k, v)
        out = sdpa(q, fk, fv, scale=D**-0.5)
        full.trim(1)
        return out

    report["full_precision_step_us"] = timed(full_step, args.iters)
    cache = TurboQuantKVCache(TurboQuantKV(args.bits), 0)
    rows = cache.rows
    rows.write(keys, values)
    mx.eval(rows.arrays)
    codec = rows.codec(D)
    for fused in (True, False):
        turboquant.FUSED = fused
        name = "fused" if fused else "reference"

        def step():
            out = rows.update_and_attend(q, k, v, scale=D**-0.5, mask=None, window=None, attention=sdpa)
            cache.trim(1)
            return out

        report[f"{name}_step_us"] = timed(step, args.iters)
    turboquant.FUSED = True

    def write():
        rows.write(k, v)
        cache.trim(1)
        return rows.arrays

    report["write_us"] = timed(write, args.iters)
    stored = [a[:, :, :S] for a in rows.arrays]
    K = codec.key_arrays
    grouped = q.reshape(1, HKV, HQ // HKV, 1, D).astype(mx.float32)
    probs = mx.softmax(codec.scores(grouped, *stored[:K]), axis=-1)
    mx.eval(probs)
    report["reference_scores_us"] = timed(lambda: codec.scores(grouped, *stored[:K]), args.iters)
    report["reference_values_us"] = timed(lambda: codec.weighted_values(probs, *stored[K:]), args.iters)
    kernels = turboquant.fused_backend()
    if kernels is not None and not kernels.reasons(grouped):
        report["fused_scores_us"] = timed(lambda: kernels.scores(codec, grouped, *stored[:K]), args.iters)
        report["fused_values_us"] = timed(lambda: kernels.weighted_values(codec, probs, *stored[K:]), args.iters)
    print(json.dumps({"context": S, "bits": args.bits, "device": str(mx.default_device()), **report}, indent=1))


if __name__ == "__main__":
    main()
