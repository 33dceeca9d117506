"""Packed-weight matmul by number of input rows: ``mx.quantized_matmul`` vs dequantize + dense matmul.

    python bench/kernels/quantized_rows.py [--rows 1 4 8 16 32 64] [--dtype bfloat16] [--smoke]

Batched decode multiplies B rows by every packed weight. For the Llama-3.2-1B shapes (4-bit,
group 64: the attention and MLP projections and the tied LM head) this times, per row count,
MLX's fused ``mx.quantized_matmul`` against ``mx.dequantize`` followed by a dense matmul in the
activation dtype (the dequantized weight a temporary), synchronously over repeated calls, and
checks the two agree. Prints JSON; the ratio > 1 where dequantizing first is faster.
"""

from __future__ import annotations

import argparse
import json
import time

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
          "lm_head": (2048, 128256)}
SMOKE = {"qkv": (128, 192), "down": (256, 128)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    import mlx.core as mx

    dtype = getattr(mx, args.dtype)
    report: dict[str, object] = {"device": str(mx.default_device()), "dtype": args.dtype, "shapes": {}}
    for name, (k, n) in (SMOKE if args.smoke else SHAPES).items():
        w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
        packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(packed, scales, biases)

        def fused(x: mx.array, packed: mx.array = packed, scales: mx.array = scales,
                  biases: mx.array = biases) -> mx.array:
            return mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)

        def dense(x: mx.array, packed: mx.array = packed, scales: mx.array = scales,
                  biases: mx.array = biases) -> mx.array:
            return x @ mx.dequantize(packed, scales, biases, group_size=64, bits=4).astype(x.dtype).T

        rows_report = {}
        for rows in args.rows:
            x = mx.random.normal((rows, k)).astype(dtype)
            mx.eval(x)
            error = mx.abs(fused(x).astype(mx.float32) - dense(x).astype(mx.float32)).max().item()
            times = {}
            for label, fn in (("quantized_matmul", fused), ("dequantize_matmul", dense)):
                for _ in range(3):
                    mx.eval(fn(x))
                start = time.perf_counter()
                for _ in range(args.iters):
                    mx.eval(fn(x))
                times[label] = (time.perf_counter() - start) / args.iters * 1e6
            rows_report[str(rows)] = {
                **{f"{label}_us": round(us, 1) for label, us in times.items()},
                "dequantize_first_speedup": round(times["quantized_matmul"] / times["dequantize_matmul"], 2),
                "max_abs_difference": error,
            }
        report["shapes"][name] = {"k": k, "n": n, "rows": rows_report}  # type: ignore[index]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
