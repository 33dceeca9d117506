"""The ``gated_delta`` op (Gated DeltaNet's recurrence) per backend: milliseconds per call (``mx.eval``
of out and state, median of repeats after a warm-up) and each backend's largest difference from
the reference, for decode steps and prompts. The fused backend of the machine (``cuda_delta`` on
MLX's CUDA backend, ``metal`` on Apple Silicon) joins ``reference`` and ``mlx_fast``.

    python bench/kernels/gated_delta.py                       # CPU: 4/8 heads of 128, float32
    python bench/kernels/gated_delta.py --heads 16 32 --dtype bfloat16 --cases 1:1 8:1 1:512 1:4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

# isort: off
import mlxr_core  # noqa: F401  (before mlx.core is loaded: it preloads OpenBLAS on Linux CPUs)
import mlx.core as mx

# isort: on
from mlxr_core.kernels import current_platform
from mlxr_core.testing.kernel_check import gated_delta_inputs
from mlxr_plugins.kernels import reference
from mlxr_plugins.kernels.delta_rule import gated_delta as chunked

#: The reference's graph grows with L: longer prompts skip it.
MAX_REFERENCE_L = 512


Inputs = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, "mx.array | None"]


def inputs(B: int, L: int, Hk: int, Hv: int, D: int, dtype: mx.Dtype) -> Inputs:
    """The op's arguments (:func:`~mlxr_core.testing.kernel_check.gated_delta_inputs`),
    evaluated: a state for a decode step (L=1), None (zeros) for a prompt."""
    arrays = gated_delta_inputs(B, L, Hk, Hv, D, D, with_state=L == 1, dtype=dtype, seed=L)
    mx.eval([a for a in arrays if a is not None])
    return arrays  # type: ignore[return-value]


def timed(fn: Callable[..., Any], args: Inputs, repeats: int) -> float:
    """Median milliseconds of ``fn(*args)`` evaluated alone (after a warm-up)."""
    for _ in range(2):
        mx.eval(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs=2, default=[4, 8], metavar=("HK", "HV"))
    parser.add_argument("--dim", type=int, default=128, help="key and value head dim (128)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--cases", nargs="+", default=["1:512", "1:1"], metavar="B:L",
                        help="batch rows and positions; L=1 steps onto a state, longer from zeros")
    args = parser.parse_args()

    device, platform = current_platform()
    backends: dict[str, Callable[..., Any]] = {"reference": reference.gated_delta, "mlx_fast": chunked}
    if platform == "cuda":
        from mlxr_plugins.kernels import cuda_delta

        backends["cuda_delta"] = cuda_delta.gated_delta
    elif platform == "metal":
        from mlxr_plugins.kernels import metal

        backends["metal"] = metal.gated_delta
    Hk, Hv = args.heads
    print(f"MLX {getattr(mx, '__version__', '?')} on {device} ({platform}), {args.dtype}, {Hk}/{Hv} heads of {args.dim}")
    for case in args.cases:
        B, L = (int(part) for part in case.split(":"))
        arrays = inputs(B, L, Hk, Hv, args.dim, getattr(mx, args.dtype))
        expected = reference.gated_delta(*arrays) if L <= MAX_REFERENCE_L else None
        parts = []
        for name, fn in backends.items():
            if name == "reference" and expected is None:
                continue
            text = f"{name} {timed(fn, arrays, 20 if L == 1 else 5):.3g} ms"
            if expected is not None and name != "reference":
                out, state = fn(*arrays)
                off = mx.abs(out.astype(mx.float32) - expected[0].astype(mx.float32)).max()
                drift = mx.abs(state - expected[1]).max() / mx.abs(expected[1]).max()
                text += f" (out {off.item():.1e} off, state {drift.item():.1e} of its scale)"
            parts.append(text)
        print(f"B={B} L={L}: " + "; ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
