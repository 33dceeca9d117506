"""One-row packed matmuls of ``cpu_native`` with float32, bfloat16 and float16 scales and biases.

A half-precision model's packed layers keep their scales in its dtype, and GGUF's Q4_0/Q4_1/Q8_0
block scales are float16 in the file: read in place they are 10-17% fewer bytes a token than
float32, if the kernel converts them for less than that. This prints, per shape and scale dtype,
the best time of ``--reps`` calls per round (median over ``--rounds``), the bytes read and the rate.
``--library`` loads a given build of the extension instead of this checkout's (for an A/B of two
builds, run once with each, alternating); ``--int8`` times each case also with the input rounded
to int8 (``cpu_int8``: integer dot products), in the same process, alternating. A diagnostic, not
a peer comparison.

    python bench/cpu_qmm_scales.py [--rounds 3] [--out FILE] [--library PATH] [--int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import mlxr_core  # noqa: F401  (before mlx work: preloads a fast BLAS on Linux CPUs)

#: (N, K, bits, group size): a large 4-bit layer, Gemma 3's 8-bit LM head, SmolLM2's MLP up.
SHAPES = [(32768, 2048, 4, 64), (262144, 640, 8, 32), (1536, 576, 4, 32)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--library", type=Path, help="a built _mlxr_qmm library to load instead")
    parser.add_argument("--int8", action="store_true", help="also with int8 inputs (cpu_int8)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from mlxr_plugins.kernels import native

    if args.library is not None:
        module = native._import(args.library)
    else:
        module, why = native.load()
        if module is None:
            raise SystemExit(f"the native kernels are unavailable: {why}")
    module.set_num_threads(args.threads)
    rows = []
    for n, k, bits, group_size in SHAPES:
        mx.random.seed(0)
        w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=bits)
        x = mx.random.normal((1, k))
        reps = 200 if n < 5000 else 10
        for dtype in (mx.float32, mx.bfloat16, mx.float16):
            s, b = scales.astype(dtype), biases.astype(dtype)
            mx.eval(w, x, s, b)
            modes = (False, True) if args.int8 else (False,)
            for int8 in modes:
                for _ in range(3):
                    mx.eval(module.quantized_matmul(x, w, s, b, group_size, bits, int8))
            per_round: dict[bool, list[float]] = {int8: [] for int8 in modes}
            for _ in range(args.rounds):
                for int8 in modes:
                    best = float("inf")
                    for _ in range(reps):
                        start = time.perf_counter()
                        mx.eval(module.quantized_matmul(x, w, s, b, group_size, bits, int8))
                        best = min(best, time.perf_counter() - start)
                    per_round[int8].append(best)
            for int8 in modes:
                seconds = statistics.median(per_round[int8])
                nbytes = w.nbytes + s.nbytes + b.nbytes
                rows.append({
                    "shape": [n, k], "bits": bits, "group_size": group_size,
                    "scales": str(dtype).split(".")[-1], "int8": int8,
                    "us": seconds * 1e6, "rounds_us": [t * 1e6 for t in per_round[int8]],
                    "bytes": nbytes, "GBps": nbytes / seconds / 1e9,
                })
                print(f"{n:>7} x {k:<5} {bits}-bit g{group_size:<3} {rows[-1]['scales']:>8}"
                      f"{' int8' if int8 else '     '}: {seconds * 1e6:9.1f} us  {nbytes / 1e6:6.1f} MB  "
                      f"{nbytes / seconds / 1e9:5.1f} GB/s")
    report = {
        "command": " ".join(["python", "bench/cpu_qmm_scales.py", *(argv if argv is not None else sys.argv[1:])]),
        "isa": module.isa(), "threads": args.threads, "library": str(args.library or "this checkout"),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
