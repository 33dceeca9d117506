"""One mixture-of-experts layer's decode step at the Qwen3-30B-A3B shape (4-bit, group 64), its
parts timed alone: the router's top-k, and the experts' three projections through each way of
running them. Prints microseconds per call (median of repeats) as JSON.

    python bench/kernels/moe_step.py [--rows 1 8 32] [--experts 128 --top-k 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

import mlxr_core  # noqa: F401  (before mlx work: a fast BLAS on Linux CPUs)
from mlxr_core.model.fuse import swiglu
from mlxr_core.model.layers.moe import route


def timed(fn: Callable[[], mx.array], repeats: int = 50) -> float:
    """Median microseconds of ``fn`` evaluated alone (after a warm-up)."""
    for _ in range(5):
        mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chain", type=int, default=48, help="layers chained per evaluation")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    H, W, E, k = args.hidden, args.width, args.experts, args.top_k
    mx.random.seed(0)
    stacks = {}
    for name, (out_dims, in_dims) in {"gate": (W, H), "up": (W, H), "down": (H, W)}.items():
        w = (mx.random.normal((E, out_dims, in_dims)) * in_dims**-0.5).astype(dtype)
        stacks[name] = mx.quantize(w, 64, 4)
    router = (mx.random.normal((E, H)) * H**-0.5).astype(dtype)
    mx.eval(stacks, router)
    report: dict[str, object] = {"device": str(mx.default_device()), "shape": [H, W, E, k]}

    def measure(rows: int) -> None:
        x = mx.random.normal((rows, H)).astype(dtype)
        indices, weights = route(x @ router.T, k)
        mx.eval(x, indices, weights)

        def gqmm(inp: mx.array, name: str, idx: mx.array, sort: bool = False) -> mx.array:
            w, s, b = stacks[name]
            return mx.gather_qmm(inp, w, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4,
                                 sorted_indices=sort)

        def unsorted() -> mx.array:
            inp = x.reshape(rows, 1, 1, H)
            h = swiglu(gqmm(inp, "gate", indices), gqmm(inp, "up", indices))
            return gqmm(h, "down", indices)

        def sorted_rows() -> mx.array:
            flat = indices.flatten()
            order = mx.argsort(flat)
            inp = x.reshape(rows, 1, H)[order // k]
            idx = flat[order]
            h = swiglu(gqmm(inp, "gate", idx, True), gqmm(inp, "up", idx, True))
            return gqmm(h, "down", idx, True)[mx.argsort(order)]

        def dequantized() -> mx.array:
            # Each row's experts taken out of the stack (packed), dequantized, then dense matmuls.
            def dense(name: str) -> mx.array:
                w, s, b = stacks[name]
                return mx.dequantize(w[indices], s[indices], b[indices], group_size=64, bits=4)

            inp = x.reshape(rows, 1, 1, H)
            h = swiglu(inp @ dense("gate").swapaxes(-1, -2), inp @ dense("up").swapaxes(-1, -2))
            return h @ dense("down").swapaxes(-1, -2)

        def router_only() -> mx.array:
            return route(x @ router.T, k)[1]

        def one_expert_qmm() -> mx.array:
            # A lower bound per projection: one dense quantized matmul of the same bytes as k experts.
            w, s, b = stacks["gate"]
            return mx.quantized_matmul(x, w[:k].reshape(k * W, -1), s[:k].reshape(k * W, -1),
                                       b[:k].reshape(k * W, -1), transpose=True, group_size=64, bits=4)

        def chained(step: Callable[[mx.array], mx.array]) -> Callable[[], mx.array]:
            # ``--chain`` layers back to back and one evaluation, as a decode step runs them: the
            # per-layer cost without a host round trip between layers.
            def run() -> mx.array:
                h = x
                for _ in range(args.chain):
                    h = h + step(h).reshape(h.shape) * 0.01
                return h

            return run

        def experts_of(h: mx.array, idx: mx.array) -> mx.array:
            inp = h.reshape(rows, 1, 1, H)
            out = gqmm(swiglu(gqmm(inp, "gate", idx), gqmm(inp, "up", idx)), "down", idx)
            return out.reshape(rows, k, H).sum(axis=1)

        def full_layer(h: mx.array) -> mx.array:
            idx, _ = route(h @ router.T, k)
            return experts_of(h, idx)

        def fixed_experts(h: mx.array) -> mx.array:
            return experts_of(h, indices)

        def router_layer(h: mx.array) -> mx.array:
            _, w = route(h @ router.T, k)
            return w.sum(axis=-1, keepdims=True) * h

        def argsort_router_layer(h: mx.array) -> mx.array:
            scores = mx.softmax((h @ router.T).astype(mx.float32), axis=-1)
            idx = mx.argsort(-scores, axis=-1)[..., :k]
            return experts_of(h, idx.astype(mx.uint32))

        variants: dict[str, Callable[[mx.array], mx.array]] = {}
        if mx.default_device() == mx.gpu and not mx.metal.is_available():
            from mlxr_plugins.kernels import cuda_moe

            def cuda_layer(h: mx.array) -> mx.array:
                idx, _ = cuda_moe.route(h @ router.T, top_k=k)
                return experts_of(h, idx)

            def cuda_router_layer(h: mx.array) -> mx.array:
                _, w = cuda_moe.route(h @ router.T, top_k=k)
                return w.sum(axis=-1, keepdims=True).astype(h.dtype) * h

            variants = {"cuda_moe_router_and_experts": cuda_layer, "cuda_moe_router_only": cuda_router_layer}
        report[f"chain={args.chain} rows={rows} per layer"] = {
            name: round(timed(chained(step), repeats=10) / args.chain, 1)
            for name, step in {
                **variants,
                "router_and_experts": full_layer,
                "experts_fixed_indices": fixed_experts,
                "router_only": router_layer,
                "argsort_router_and_experts": argsort_router_layer,
                "compiled_router_and_experts": mx.compile(full_layer),
            }.items()
        }
        print(json.dumps({f"chain rows={rows}": report[f"chain={args.chain} rows={rows} per layer"]}), flush=True)

        report[f"rows={rows}"] = {
            name: round(timed(fn), 1)
            for name, fn in {
                "router_topk": router_only,
                "gather_qmm_unsorted": unsorted,
                "gather_qmm_sorted": sorted_rows,
                "take_dequantize_matmul": dequantized,
                "qmm_same_bytes_one_projection": one_expert_qmm,
            }.items()
        }
        print(json.dumps({f"rows={rows}": report[f"rows={rows}"]}), flush=True)
    for rows in args.rows:
        measure(rows)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
