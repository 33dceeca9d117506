"""One batched decode step, alone: where its time goes at B rows.

    python bench/batched_step.py [--weights q4] [--rows 1 32] [--steps 200] [--smoke]

Writes the Llama-3.2-1B-shaped random weights of ``gpu_decode.py``, loads them as the engine does
(mlxr's defaults for the device), prefills ``B`` rows and decodes them together through the
model's decode step (``LoadedModel.decode``, what the engine's batch runner calls) on the engine's
batch cache, without the engine: rows of one length (no mask) and rows of different lengths
(each row joined a step later than the one before, as in the engine, so attention takes the
batch's padding mask). Per configuration, the median step when steps are pipelined as the engine
runs them (step n+1 queued before step n's tokens are read), and its host parts: building the
graph, ``mx.async_eval``, and waiting for the previous step's tokens; then the median step when
every step is waited for. Under ``nsys profile`` the kernels of the pipelined steps dominate the
trace (``--steps`` long). A diagnostic for the engine's aggregate throughput, not a peer
comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))


def batch_caches(model: Any, rows: int, prompt: int, padded: bool) -> list[Any]:
    """The engine's batch cache of ``rows`` prefilled rows: ``prompt`` tokens each, or with
    ``padded``, row ``i`` ``prompt + i`` tokens (so every row but the longest is left-padded)."""
    from mlxr_core.model.cache import BatchKVCache

    caches: list[Any] | None = None
    for row in range(rows):
        length = prompt + (row if padded else 0)
        cache = model.make_cache()
        ids = mx.array([[(i * 37 + row) % 100 + 3 for i in range(length)]], dtype=mx.int32)
        model.model(ids, cache=cache)
        mx.eval([array for layer in cache for array in layer.state])
        joined = [BatchKVCache.from_cache(layer) for layer in cache]
        if caches is None:
            caches = joined
        else:
            for batch, one in zip(caches, joined, strict=True):
                batch.extend(one)
    assert caches is not None
    mx.eval([array for layer in caches for array in layer.state])
    return caches


def pipelined(model: Any, caches: list[Any], steps: int) -> dict[str, float]:
    """Median per step of the whole step and its host parts, steps queued one ahead."""
    rows = caches[0].batch_size
    tokens = mx.zeros((rows,), dtype=mx.int32)
    parts: dict[str, list[float]] = {"step": [], "build": [], "async_eval": [], "wait": []}
    for _ in range(steps):
        start = time.perf_counter()
        mask = caches[0].mask() if caches[0].padded else None
        following = mx.argmax(model.decode(tokens, caches, mask), axis=-1).astype(mx.int32)
        built = time.perf_counter()
        mx.async_eval(following)
        queued = time.perf_counter()
        tokens.tolist()
        end = time.perf_counter()
        tokens = following
        for key, seconds in (("step", end - start), ("build", built - start),
                             ("async_eval", queued - built), ("wait", end - queued)):
            parts[key].append(seconds)
    mx.eval(tokens)
    skip = min(10, steps // 4)
    return {f"{key}_ms": statistics.median(values[skip:]) * 1e3 for key, values in parts.items()}


def waited(model: Any, caches: list[Any], steps: int) -> float:
    """Median ms of a step built, run and waited for before the next (latency, no overlap)."""
    rows = caches[0].batch_size
    tokens = mx.zeros((rows,), dtype=mx.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = caches[0].mask() if caches[0].padded else None
        tokens = mx.argmax(model.decode(tokens, caches, mask), axis=-1).astype(mx.int32)
        mx.eval(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times[min(5, steps // 4):]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", default="q4", choices=["bf16", "q4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kernels", nargs="*", default=[], metavar="OP=BACKEND")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script")
    args = parser.parse_args()

    from gpu_decode import LLAMA_1B, SMOKE, write_folders

    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    report: dict[str, Any] = {"device": str(mx.default_device()), "weights": args.weights,
                              "kernels": args.kernels, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folders(Path(tmp), SMOKE if args.smoke else LLAMA_1B)[args.weights]
        config = Config(
            models=[ModelConfig(path=str(folder), name="bench", dtype="bfloat16", quantization="keep",
                                kernels=dict(choice.split("=", 1) for choice in args.kernels))],
            engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
        )
        engine = Engine(config, load_plugins())
        engine.start()
        try:
            model = engine._loaded["bench"]
            report["kernels_chosen"] = dict(model.kernels.chosen)
            # Decode on a stream of its own, as the engine does (not the one the model loaded on).
            with mx.stream(mx.new_stream(mx.default_device())):
                for rows in args.rows:
                    for padded in (False, True) if rows > 1 else (False,):
                        caches = batch_caches(model, rows, args.prompt_tokens, padded)
                        pipelined(model, caches, 8)  # first use of the shape
                        result = pipelined(model, caches, args.steps)
                        result["waited_step_ms"] = waited(model, caches, min(args.steps, 50))
                        result["tokens_per_s"] = rows / result["step_ms"] * 1e3
                        label = f"{rows} rows" + (", padded" if padded else "")
                        report["rows"][label] = result
                        print(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()),
                              flush=True)
                        del caches
        finally:
            engine.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
