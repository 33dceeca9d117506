"""The ``ssd`` op (Mamba-2's selective state space recurrence) per backend: milliseconds per call
(``mx.eval`` of out and state, median of repeats after a warm-up) and ``mlx_fast``'s largest
difference from the reference, for decode steps and prompts.

    python bench/kernels/ssd.py                    # CPU: 16 heads of 64, a state of 128, float32
    python bench/kernels/ssd.py --heads 128 --cases 1:1 8:1 1:512
"""

from __future__ import annotations

import argparse

# isort: off
import mlxr_core  # noqa: F401  (before mlx.core is loaded: it preloads OpenBLAS on Linux CPUs)
import mlx.core as mx

# isort: on
from gated_delta import timed  # the same timing (this folder is on the path of a script run)

from mlxr_core.kernels import current_platform
from mlxr_core.testing.kernel_check import ssd_inputs
from mlxr_plugins.kernels import reference
from mlxr_plugins.kernels.ssd import ssd as chunked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=128, help="SSD state channels N (128)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--cases", nargs="+", default=["1:512", "1:1"], metavar="B:L",
                        help="batch rows and positions; L=1 steps onto a state, longer from zeros")
    args = parser.parse_args()
    device, platform = current_platform()
    H, P, N = args.heads, args.head_dim, args.state
    print(f"MLX {getattr(mx, '__version__', '?')} on {device} ({platform}), {args.dtype}, {H} heads of {P}, N={N}")
    for case in args.cases:
        B, L = (int(part) for part in case.split(":"))
        arrays = ssd_inputs(B, L, H, P, N, with_state=L == 1, dtype=getattr(mx, args.dtype), seed=L)
        mx.eval([a for a in arrays if a is not None])
        repeats = 20 if L == 1 else 5
        slow, fast = timed(reference.ssd, arrays, repeats), timed(chunked, arrays, repeats)
        (out, state), (want, want_state) = chunked(*arrays), reference.ssd(*arrays)
        off = mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()
        scale = mx.abs(want_state).max().item() or 1.0
        state_off = mx.abs(state - want_state).max().item() / scale
        print(f"B={B} L={L}: reference {slow:.3g} ms; mlx_fast {fast:.3g} ms ({slow / fast:.2f}x; "
              f"out {off:.1e} off, state {state_off:.1e} of its scale)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
