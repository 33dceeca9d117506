"""Packed-weight matmul by number of input rows: ``mx.quantized_matmul`` vs dequantize + dense matmul
(and, on CUDA, mlxr's ``cuda_qmm`` kernel where it takes the layer).

    python bench/kernels/quantized_rows.py [--rows 1 4 8 16 32 64] [--dtype bfloat16] [--smoke]

Batched decode multiplies B rows by every packed weight. For the Llama-3.2-1B shapes (4-bit,
group 64: the attention and MLP projections and the tied LM head) this times, per row count,
MLX's fused ``mx.quantized_matmul`` against ``mx.dequantize`` followed by a dense matmul in the
activation dtype (the dequantized weight a temporary), synchronously over repeated calls, and
checks the two agree. Prints JSON; the ratio > 1 where dequantizing first is faster.
``quantized_matmul_b1k`` is ``mx.quantized_matmul`` given the same rows as ``[B, 1, K]`` (how a
batched decode step's activations arrive) instead of ``[B, K]``.

``--pipelined`` times ``--iters`` calls queued as one evaluation instead of one call at a time (the
device's throughput, as in a decode step, rather than one call's latency), and ``--split-k 2 4``
adds split-reduction variants: the packed weight cut into that many contiguous pieces along the
reduction (at load time, as a kernel would keep them), one ``mx.quantized_matmul`` per piece and
their sum (more blocks for a layer with few outputs and a long reduction, like the down projection).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)
from mlxr_core.kernels import current_platform
from mlxr_plugins.kernels import cuda_qmm

SHAPES = {
    "qkv": (2048, 3072),
    "o": (2048, 2048),
    "gate_up": (2048, 16384),
    "down": (8192, 2048),
    "lm_head": (2048, 128256),
}
SMOKE = {"qkv": (128, 192), "down": (256, 128)}
L2_BYTES = 60e6  # H200 60 MB, H100 50 MB


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--pipelined", action="store_true", help="queue --iters calls per evaluation"
    )
    parser.add_argument(
        "--split-k", type=int, nargs="*", default=[], help="split-reduction variants"
    )
    parser.add_argument(
        "--rotate", action="store_true",
        help="rotate over copies of each layer (4x the L2 cache), as a decode step's weights come "
        "from memory; without it a layer small enough stays in the L2 cache between calls",
    )
    args = parser.parse_args()

    import mlx.core as mx

    dtype = getattr(mx, args.dtype)
    cuda = current_platform()[1] == "cuda"
    report: dict[str, object] = {
        "device": str(mx.default_device()),
        "dtype": args.dtype,
        "pipelined": args.pipelined,
        "shapes": {},
    }
    def fused(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64, bits=4)

    def dense(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return x @ mx.dequantize(packed, scales, biases, group_size=64, bits=4).astype(x.dtype).T

    def fused_3d(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        """The rows as a batch of one-row inputs (``[B, 1, K]``, a batched decode step's shape)."""
        return fused(x[:, None], packed, scales, biases)[:, 0]

    def split(x: mx.array, parts: list[tuple[mx.array, ...]], step: int) -> mx.array:
        """One fused matmul per contiguous piece of the reduction, summed."""
        pieces = [fused(x[:, i * step : (i + 1) * step], *part) for i, part in enumerate(parts)]
        total = pieces[0]
        for piece in pieces[1:]:
            total = total + piece
        return total

    def variants_for(packed: mx.array, scales: mx.array, biases: mx.array) -> dict[str, Any]:
        weight = {"packed": packed, "scales": scales, "biases": biases}
        return {
            "quantized_matmul": functools.partial(fused, **weight),
            "dequantize_matmul": functools.partial(dense, **weight),
            "quantized_matmul_b1k": functools.partial(fused_3d, **weight),
        }

    for name, (k, n) in (SMOKE if args.smoke else SHAPES).items():
        w = (mx.random.normal((n, k)) / k**0.5).astype(dtype)
        packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(packed, scales, biases)
        weight_args: dict[str, Any] = {"w": packed, "scales": scales, "biases": biases, "group_size": 64}
        variants = variants_for(packed, scales, biases)
        # Copies of the layer to rotate over, so that weights come from memory, not the L2 cache.
        copies = [(packed, scales, biases)]
        if args.rotate:
            layer_bytes = packed.nbytes + scales.nbytes + biases.nbytes
            for _ in range(-(-int(4 * L2_BYTES) // layer_bytes) - 1):
                copies.append(mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=64, bits=4))
            mx.eval(copies)
        rotated = [variants_for(*copy) for copy in copies]
        for pieces in args.split_k:
            if k % (pieces * 64):
                continue
            step = k // pieces
            parts = [
                tuple(
                    mx.contiguous(a[:, i * step // per : (i + 1) * step // per])
                    for a, per in ((packed, 8), (scales, 64), (biases, 64))
                )
                for i in range(pieces)
            ]
            mx.eval(parts)
            variants[f"split_k{pieces}"] = functools.partial(split, parts=parts, step=step)

        rows_report = {}
        for rows in args.rows:
            x = mx.random.normal((rows, k)).astype(dtype)
            mx.eval(x)
            reference = variants["dequantize_matmul"](x).astype(mx.float32)
            times = {}
            errors = {}
            chosen = dict(variants)
            # mlxr's split-reduction kernel, where it takes the layer (CUDA only).
            if cuda and not isinstance(cuda_qmm.rows_plan(x, **weight_args), str):
                chosen["cuda_qmm"] = functools.partial(cuda_qmm.quantized_matmul, **weight_args)
                for copy, copy_variants in zip(copies, rotated, strict=True):
                    copy_variants["cuda_qmm"] = functools.partial(
                        cuda_qmm.quantized_matmul, w=copy[0], scales=copy[1], biases=copy[2],
                        group_size=64,
                    )
            for label, fn in chosen.items():
                errors[label] = mx.abs(fn(x).astype(mx.float32) - reference).max().item()
                calls = [copy.get(label, fn) for copy in rotated]
                for call in calls[:3]:
                    mx.eval(call(x))
                start = time.perf_counter()
                if args.pipelined:
                    mx.eval([calls[i % len(calls)](x) for i in range(args.iters)])
                else:
                    for i in range(args.iters):
                        mx.eval(calls[i % len(calls)](x))
                times[label] = (time.perf_counter() - start) / args.iters * 1e6
            rows_report[str(rows)] = {
                **{f"{label}_us": round(us, 1) for label, us in times.items()},
                "dequantize_first_speedup": round(
                    times["quantized_matmul"] / times["dequantize_matmul"], 2
                ),
                "max_abs_difference": errors["quantized_matmul"],
                **{
                    f"{label}_max_abs_difference": e
                    for label, e in errors.items()
                    if label.startswith("split") or label == "cuda_qmm"
                },
                **(
                    {"cuda_qmm_speedup": round(times["quantized_matmul"] / times["cuda_qmm"], 2)}
                    if "cuda_qmm" in times else {}
                ),
            }
        report["shapes"][name] = {"k": k, "n": n, "rows": rows_report}  # type: ignore[index]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
