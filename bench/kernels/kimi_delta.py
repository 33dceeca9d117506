"""The ``kimi_delta`` op (Kimi delta attention's recurrence) per backend: milliseconds per call
(``mx.eval`` of out and state, median of repeats after a warm-up) and ``mlx_fast``'s largest
difference from the reference, for decode steps and prompts.

    python bench/kernels/kimi_delta.py                        # CPU: 8 heads of 128, float32
    python bench/kernels/kimi_delta.py --heads 32 --cases 1:1 8:1 1:512 --decay 30
"""

from __future__ import annotations

import argparse

# isort: off
import mlxr_core  # noqa: F401  (before mlx.core is loaded: it preloads OpenBLAS on Linux CPUs)
import mlx.core as mx

# isort: on
from gated_delta import timed  # the same timing (this folder is on the path of a script run)

from mlxr_core.kernels import current_platform
from mlxr_core.testing.kernel_check import kimi_delta_inputs
from mlxr_plugins.kernels import reference
from mlxr_plugins.kernels.kimi_delta import kimi_delta as chunked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128, help="key and value head dim (128)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--decay", type=float, default=0.5, help="log decays drawn from [-decay, 0]")
    parser.add_argument("--cases", nargs="+", default=["1:512", "1:1"], metavar="B:L",
                        help="batch rows and positions; L=1 steps onto a state, longer from zeros")
    args = parser.parse_args()
    device, platform = current_platform()
    H, D = args.heads, args.dim
    print(f"MLX {getattr(mx, '__version__', '?')} on {device} ({platform}), {args.dtype}, {H} heads of {D}")
    for case in args.cases:
        B, L = (int(part) for part in case.split(":"))
        arrays = kimi_delta_inputs(B, L, H, D, D, with_state=L == 1, dtype=getattr(mx, args.dtype), seed=L,
                                   decay=args.decay)
        mx.eval([a for a in arrays if a is not None])
        repeats = 20 if L == 1 else 5
        slow, fast = timed(reference.kimi_delta, arrays, repeats), timed(chunked, arrays, repeats)
        (out, state), (want, want_state) = chunked(*arrays), reference.kimi_delta(*arrays)
        off = mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()
        drift = (mx.abs(state - want_state).max() / mx.abs(want_state).max()).item()
        print(f"B={B} L={L}: reference {slow:.3g} ms; mlx_fast {fast:.3g} ms ({slow / fast:.2f}x; out {off:.1e} off, "
              f"state {drift:.1e} of its scale)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
