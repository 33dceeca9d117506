"""One-row (batch-1 decode) packed matmul on MLX's CUDA backend: ``mx.quantized_matmul`` against
``cuda_qmv``'s kernel, per layer shape of Llama-3.2-1B and Qwen3-30B-A3B.

    python bench/kernels/qmv_one_row.py --out $OUT/qmv.json [--check] [--bits 4 8]
        [--dtype bfloat16] [--group-size 64] [--sweep] [--models llama-3.2-1b qwen3-30b-a3b]

``--check`` first compares the kernel with the float64 product of the weights dequantized in
float32 over the benchmark's shapes and odd ones (every dtype, group size and bit width the
kernel takes, several layouts), with ``mx.quantized_matmul``'s error beside it, and exits 1 on a
mismatch before any timing. Timing: each layer is copied until the copies exceed 4x the L2 cache
(weights come from memory, as in a decode step), a batch of calls over the copies is built
lazily, then ``mx.eval`` runs it; the median over repeats of (wall time / calls) is reported, as
``bench/kernels/decode_attention.py`` times (its ``timed``). GB/s counts the packed weights,
scales and biases read per call; the fraction is of the H100's 3.35 TB/s and of the copy bandwidth
measured in the same run. Small layers are bound by the host's per-call work for both: their
device time comes from Nsight Compute:

    ncu --metrics gpu__time_duration.sum --csv --kernel-name regex:"qmv|qmm|gemv|marker" \\
        --log-file $OUT/qmv_ncu.csv python bench/kernels/qmv_one_row.py --ncu-calls 3 --out $OUT/run.json
    python bench/kernels/qmv_one_row.py --ncu-calls 3 --summarize-ncu $OUT/qmv_ncu.csv --out $OUT/qmv_ncu.json

(the same ``--bits``/``--dtype``/``--models`` in both). ``--sweep`` also times every layout
(splits of the reduction x rows per warp) per shape. ``--smoke`` runs tiny shapes, and on a machine
without CUDA stands ``mx.quantized_matmul`` in for the kernel: it checks the script, nothing else.
The mixture-of-experts layers' experts go through ``gather_matmul``, not this op.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# isort: off
import mlxr_core  # noqa: F401  (before mlx.core is loaded: it preloads OpenBLAS on Linux CPUs)
import mlx.core as mx
import numpy as np

# isort: on
from mlxr_core.kernels import current_platform
from mlxr_plugins.kernels import cuda_qmv

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: batched_step's ncu markers
from batched_step import marker, summarize_ncu
from decode_attention import L2_BYTES, copy_bandwidth, timed

#: (reduction K, outputs N) of each packed layer a one-stream decode step multiplies.
MODELS = {
    "llama-3.2-1b": {
        "qkv": (2048, 3072), "k_or_v": (2048, 512), "o": (2048, 2048), "gate_up": (2048, 16384),
        "down": (8192, 2048), "lm_head": (2048, 128256),
    },
    "qwen3-30b-a3b": {
        "qkv": (2048, 5120), "q": (2048, 4096), "k_or_v": (2048, 512), "o": (4096, 2048),
        "router": (2048, 128), "lm_head": (2048, 151936),
    },
}
SMOKE = {"smoke": {"narrow": (512, 96), "wide": (256, 1200)}}
#: Odd shapes for --check besides the benchmark's: a reduction that leaves lanes idle, few rows.
CHECK_EXTRA = [(320, 100), (64, 40), (4096, 1000), (1024, 4096)]
H100_BYTES_PER_S = 3.35e12
TOL = {"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1e-2)}
Layer = tuple[mx.array, mx.array, mx.array]


def make_layer(k: int, n: int, dtype: mx.Dtype, group_size: int, bits: int, seed: int) -> Layer:
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * k**-0.5).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(packed, scales, biases)
    return packed, scales, biases


def layer_copies(k: int, n: int, dtype: mx.Dtype, group_size: int, bits: int, count: int) -> list[Layer]:
    """``count`` different ``[n, k]`` layers (each its own buffers), quantized together."""
    stacked = make_layer(k, count * n, dtype, group_size, bits, seed=n)
    copies = [tuple(mx.contiguous(a[i * n:(i + 1) * n]) for a in stacked) for i in range(count)]
    mx.eval(copies)
    return copies  # type: ignore[return-value]


def kernel_call(cuda: bool, group_size: int, bits: int, **layout: Any) -> Callable[[mx.array, Layer], mx.array]:
    """The one-row kernel (``layout`` overrides its work split); without CUDA (``--smoke``),
    ``mx.quantized_matmul`` behind the same plan."""

    def call(x: mx.array, layer: Layer) -> mx.array:
        plan = cuda_qmv.one_row_plan(x, *layer, group_size=group_size, bits=bits)
        if isinstance(plan, str):
            raise SystemExit(f"the kernel does not take {tuple(layer[0].shape)}: {plan}")
        if layout:
            plan = cuda_qmv.layout(plan.n, plan.k, bits, group_size, **layout)
        if not cuda:
            return mx.quantized_matmul(x, *layer, group_size=group_size, bits=bits)
        return cuda_qmv.one_row_matmul(x, *layer, plan)

    return call


def mlx_call(group_size: int, bits: int) -> Callable[[mx.array, Layer], mx.array]:
    def call(x: mx.array, layer: Layer) -> mx.array:
        return mx.quantized_matmul(x, *layer, transpose=True, group_size=group_size, bits=bits)

    return call


def check_cases(dtypes: list[str], shapes: list[tuple[int, int]]) -> list[tuple[str, int, int, int, int, dict[str, int]]]:
    """(dtype, bits, group size, k, n, layout overrides) to check: every dtype and bit width on the
    benchmark's shapes and odd ones at group 64; groups 32 and 128 in bfloat16; every work split
    on three shapes (each case is one more kernel for NVRTC to compile)."""
    odd = shapes + CHECK_EXTRA
    cases: list[tuple[str, int, int, int, int, dict[str, int]]] = []
    for dtype in dtypes:
        cases += [(dtype, bits, 64, k, n, {}) for bits in cuda_qmv.BITS for k, n in odd if k % 64 == 0]
    dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    for group_size in (32, 128):
        cases += [(dtype, bits, group_size, k, n, {}) for bits in cuda_qmv.BITS
                  for k, n in [*CHECK_EXTRA, (2048, 3072)] if k % group_size == 0]
    for k, n in [(2048, 3072), (8192, 2048), (320, 100)]:
        cases += [(dtype, 4, 64, k, n, {"splits": s, "rows_per_warp": r, "max_blocks": 5})
                  for s in (1, 2, 4, 8) for r in (1, 2) if (k * 4 // 128) % s == 0]
    return cases


def check(dtypes: list[str], shapes: list[tuple[int, int]], cuda: bool) -> list[dict[str, Any]]:
    """The kernel against the float64 product of the weights dequantized in float32."""
    rows = []
    for dtype_name, bits, group_size, k, n, layout in check_cases(dtypes, shapes):
        dtype = getattr(mx, dtype_name)
        atol, rtol = TOL[dtype_name]
        layer = make_layer(k, n, dtype, group_size, bits, seed=k + n + bits)
        x = mx.random.normal((1, k), key=mx.random.key(group_size)).astype(dtype)
        dense = np.array(mx.dequantize(layer[0], layer[1].astype(mx.float32), layer[2].astype(mx.float32),
                                       group_size=group_size, bits=bits), dtype=np.float64)
        exact = np.array(x.astype(mx.float32), dtype=np.float64) @ dense.T
        theirs = np.array(mlx_call(group_size, bits)(x, layer).astype(mx.float32))
        ours = np.array(kernel_call(cuda, group_size, bits, **layout)(x, layer).astype(mx.float32))
        off = np.abs(ours - exact)
        ok = bool((off <= atol + rtol * np.abs(exact)).all())
        row = {"dtype": dtype_name, "bits": bits, "group_size": group_size, "k": k, "n": n, "layout": layout,
               "max_err": float(off.max()), "max_err_mx": float(np.abs(theirs - exact).max()), "ok": ok}
        rows.append(row)
        if not ok:
            print("PARITY FAIL", json.dumps(row), flush=True)
    return rows


def measure(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    dtype = getattr(mx, args.dtype)
    bandwidth = copy_bandwidth(smoke=args.smoke)
    report: dict[str, Any] = {"device": str(mx.default_device()), "dtype": args.dtype,
                              "group_size": args.group_size, "copy_bandwidth_GBps": bandwidth / 1e9,
                              "shapes": {}}
    for model, shapes in models(args).items():
        for name, (k, n) in shapes.items():
            for bits in args.bits:
                weight_bytes = n * k * bits // 8 + 2 * n * (k // args.group_size) * dtype.size
                count = 2 if args.smoke else -(-int(4 * L2_BYTES) // weight_bytes)
                copies = layer_copies(k, n, dtype, args.group_size, bits, count)
                calls = max(len(copies), 32 if not args.smoke else 4)
                calls -= calls % len(copies)
                x = mx.random.normal((1, 1, k)).astype(dtype)  # a one-stream step's [1, 1, K]
                mx.eval(x)
                plan = cuda_qmv.layout(n, k, bits, args.group_size)
                variants = {"mx": mlx_call(args.group_size, bits),
                            "qmv": kernel_call(cuda, args.group_size, bits)}
                if args.sweep:  # every work split, then steps of 1, 2 and 4 vectors on the default one
                    for s in (1, 2, 4, 8):
                        for r in (1, 2):
                            if (k * bits // 128) % s == 0:
                                variants[f"qmv_s{s}_r{r}"] = kernel_call(cuda, args.group_size, bits,
                                                                         splits=s, rows_per_warp=r)
                    for u in (1, 2, 4):
                        if u != plan.in_flight and u * plan.rows_per_warp <= 4 and u <= plan.vectors_per_lane:
                            variants[f"qmv_u{u}"] = kernel_call(cuda, args.group_size, bits, splits=plan.splits,
                                                                rows_per_warp=plan.rows_per_warp, in_flight=u)
                row: dict[str, Any] = {"model": model, "layer": name, "k": k, "n": n, "bits": bits,
                                       "weight_bytes": weight_bytes, "copies": len(copies),
                                       "calls": calls, "plan": {
                                           "splits": plan.splits, "rows_per_warp": plan.rows_per_warp,
                                           "in_flight": plan.in_flight, "blocks": plan.blocks}}
                for label, fn in variants.items():
                    seconds, build = timed(functools.partial(_batch, fn, x, copies), calls)
                    row[f"{label}_us"] = round(seconds * 1e6, 2)
                    row[f"{label}_build_us"] = round(build * 1e6, 2)
                    row[f"{label}_GBps"] = round(weight_bytes / seconds / 1e9, 1)
                    row[f"{label}_of_3.35TBps"] = round(weight_bytes / seconds / H100_BYTES_PER_S, 3)
                    row[f"{label}_of_copy_bw"] = round(weight_bytes / seconds / bandwidth, 3)
                row["qmv_speedup"] = round(row["mx_us"] / row["qmv_us"], 2)
                if args.sweep:
                    best = min((label for label in variants if label.startswith(("qmv_s", "qmv_u"))),
                               key=lambda label: row[f"{label}_us"])
                    row["best_layout"] = best
                    row["best_layout_speedup"] = round(row["mx_us"] / row[f"{best}_us"], 2)
                print(f"{model:14s} {name:8s} {bits}-bit [{n} x {k}] {weight_bytes / 1e6:7.2f} MB: "
                      f"mx {row['mx_us']:8.2f} us ({row['mx_GBps']:7.1f} GB/s), qmv {row['qmv_us']:8.2f} us "
                      f"({row['qmv_GBps']:7.1f} GB/s, {row['qmv_of_3.35TBps']:.2f} of 3.35 TB/s): "
                      f"{row['qmv_speedup']:.2f}x" + (f"; best {row['best_layout']} {row['best_layout_speedup']:.2f}x"
                                                      if args.sweep else ""), flush=True)
                report["shapes"][f"{model}/{name}/{bits}bit"] = row
    return report


def _batch(fn: Callable[[mx.array, Layer], mx.array], x: mx.array, copies: list[Layer], calls: int) -> list[mx.array]:
    return [fn(x, copies[i % len(copies)]) for i in range(calls)]


def models(args: argparse.Namespace) -> dict[str, dict[str, tuple[int, int]]]:
    return SMOKE if args.smoke else {name: MODELS[name] for name in args.models}


def ncu_labels(args: argparse.Namespace) -> list[tuple[str, int, int, int, str]]:
    """(label, k, n, bits, variant) per marked range, in order (the same for both ncu steps)."""
    out = []
    for model, shapes in models(args).items():
        for name, (k, n) in shapes.items():
            for bits in args.bits:
                for variant in ("mx", "qmv"):
                    out.append((f"{model}/{name}/{bits}bit/{variant}", k, n, bits, variant))
    return out


def ncu_run(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Each (shape, variant) between marker kernels, ``--ncu-calls`` calls each evaluated alone
    (Nsight Compute flushes the caches before each kernel by default)."""
    dtype = getattr(mx, args.dtype)
    for index, (_, k, n, bits, variant) in enumerate(ncu_labels(args), start=1):
        layer = make_layer(k, n, dtype, args.group_size, bits, seed=n)
        x = mx.random.normal((1, 1, k)).astype(dtype)
        fn = mlx_call(args.group_size, bits) if variant == "mx" else kernel_call(cuda, args.group_size, bits)
        mx.eval(fn(x, layer))  # compiled before the range
        if cuda:
            marker(index)
        for _ in range(args.ncu_calls):
            mx.eval(fn(x, layer))
        if cuda:
            marker(0)
    return {"labels": [label for label, *_ in ncu_labels(args)], "calls": args.ncu_calls}


def summarize(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(mx, args.dtype)
    labels = {}
    for index, (label, k, n, bits, _) in enumerate(ncu_labels(args), start=1):
        groups = k // args.group_size
        weight_bytes = n * k * bits // 8 + 2 * n * groups * dtype.size
        labels[index] = {"label": label, "steps": args.ncu_calls or 3, "weight_bytes_per_step": weight_bytes}
    summary = summarize_ncu(args.summarize_ncu, labels)
    for label, row in summary.items():
        row["of_3.35TBps"] = (row["achieved_GBps"] * 1e9 / H100_BYTES_PER_S) if row["achieved_GBps"] else None
        print(f"{label:40s} {row['device_us_per_step']:9.2f} us  "
              f"{row['achieved_GBps'] or 0:8.1f} GB/s  {row['of_3.35TBps'] or 0:.3f}", flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    parser.add_argument("--check", action="store_true", help="parity first; exit 1 on a mismatch")
    parser.add_argument("--bits", type=int, nargs="+", default=[4], choices=cuda_qmv.BITS)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TOL))
    parser.add_argument("--group-size", type=int, default=64, choices=cuda_qmv.GROUP_SIZES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", action="store_true", help="also time every work split")
    parser.add_argument("--ncu-calls", type=int, default=0, help="mark calls for Nsight Compute instead")
    parser.add_argument("--summarize-ncu", type=Path, metavar="CSV")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    args = parser.parse_args()

    if args.summarize_ncu:
        report: dict[str, Any] = {"ncu": summarize(args)}
    else:
        cuda = current_platform()[1] == "cuda"
        if not cuda and not args.smoke:
            print(f"needs MLX's CUDA backend (this machine: {current_platform()}); --smoke checks the script",
                  file=sys.stderr)
            return 2
        report = {"device": str(mx.default_device()), "cuda": cuda}
        if args.check:
            shapes = sorted({shape for shapes in models(args).values() for shape in shapes.values()})
            rows = check(sorted(TOL) if not args.smoke else ["float32"], shapes, cuda)
            failed = [row for row in rows if not row["ok"]]
            report["check"] = {"cases": len(rows), "failed": len(failed), "rows": rows}
            print(f"check: {len(rows) - len(failed)} of {len(rows)} within tolerance", flush=True)
            if failed:
                args.out.write_text(json.dumps(report, indent=1))
                return 1
        if args.ncu_calls:
            report["ncu_run"] = ncu_run(args, cuda)
        else:
            report.update(measure(args, cuda))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
