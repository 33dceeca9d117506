"""One batched decode step, alone: where its time goes at B rows.

    python bench/batched_step.py [--weights q4] [--rows 1 32] [--steps 200] [--rounds 3]
        [--variants auto quantized_matmul=mlx_fast] [--shape llama-3.2-1b] [--smoke]

Writes the random weights of ``gpu_decode.py`` (``--shape``, the Llama-3.2-1B shape by default), loads them as the engine does
(mlxr's defaults for the device), prefills ``B`` rows and decodes them together through the
model's decode step (``LoadedModel.decode``, what the engine's batch runner calls) on the engine's
batch cache, without the engine: rows of one length (no mask) and rows of different lengths
(each row joined a step later than the one before, as in the engine, so attention takes the
batch's padding mask). Per configuration, the median step when steps are pipelined as the engine
runs them (step n+1 queued before step n's tokens are read), and its host parts: building the
graph, ``mx.async_eval``, and waiting for the previous step's tokens; then the median step when
every step is waited for. ``--variants`` compares kernel choices in one process (one engine
each, alternating per round, so that host drift hits them alike). ``--ncu-steps`` marks a run of
steps for Nsight Compute instead, and ``--summarize-ncu`` sums each run's kernel times per step by
kernel name: the device's busy time, against the step's wall time, and the bandwidth it achieves:
the weight bytes a step of ``B`` rows reads (every weight but the experts, and of each mixture-of-
experts layer the share of experts ``B`` rows choose when routing is uniform,
``1 - (1 - top_k / experts) ** B``) over that busy time. A diagnostic for the engine's
aggregate throughput, not a peer comparison.
"""

from __future__ import annotations

import argparse
import functools
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

    if not padded:  # one prefill of every row
        cache = model.make_cache()
        ids = mx.array([[(i * 37 + row) % 100 + 3 for i in range(prompt)] for row in range(rows)],
                       dtype=mx.int32)
        model.model(ids, cache=cache)
        joined = [layer.to_batch() for layer in cache]
        mx.eval([array for layer in joined for array in layer.state])
        return joined
    caches: list[Any] | None = None
    for row in range(rows):
        length = prompt + (row if padded else 0)
        cache = model.make_cache()
        ids = mx.array([[(i * 37 + row) % 100 + 3 for i in range(length)]], dtype=mx.int32)
        model.model(ids, cache=cache)
        mx.eval([array for layer in cache for array in layer.state])
        joined = [layer.to_batch() for layer in cache]
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


def step_bytes(model: Any, rows: int) -> int:
    """Weight bytes one decode step of ``rows`` rows reads: every weight, except that of each
    mixture-of-experts layer only the experts the rows choose, counted as the expected share of
    distinct experts under uniform routing (``1 - (1 - top_k / experts) ** rows``)."""
    from mlx.utils import tree_flatten

    from mlxr_core.model.layers.moe import active_share

    shares = {prefix: 1 - (1 - share) ** rows for prefix, share in active_share(model).items()}
    total = 0.0
    for name, array in tree_flatten(model.parameters()):
        total += array.nbytes * next((s for prefix, s in shares.items() if name.startswith(prefix)), 1.0)
    return int(total)


@functools.cache
def _marker_kernel() -> Any:
    return mx.fast.cuda_kernel(name="mlxr_marker", input_names=["x"], output_names=["y"],
                               source="y[0] = x[0] + ID;")


def marker(index: int) -> None:
    """A one-thread kernel named after ``index`` (0 closes a range), for ``--summarize-ncu``."""
    x = mx.zeros((1,))
    mx.eval(_marker_kernel()(inputs=[x], template=[("ID", index)], grid=(1, 1, 1),
                             threadgroup=(1, 1, 1), output_shapes=[(1,)],
                             output_dtypes=[mx.float32])[0])


def summarize_ncu(csv_path: Path, labels: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per marked range (see ``--ncu-steps``): device time per step, by kernel name, from an
    ``ncu --csv`` log of ``gpu__time_duration.sum``."""
    import csv
    import re

    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    lines = csv_path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    ranges: dict[int, dict[str, list[float]]] = {}
    current = None
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        found = re.search(r"mlxr_marker_(\d+)", row["Kernel Name"])
        if found:
            current = int(found.group(1)) or None
            continue
        if current in labels:
            name = row["Kernel Name"].split("(")[0].replace("void ", "").replace("mlx::core::cu::", "")
            value = float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
            ranges.setdefault(current, {}).setdefault(name[:80], []).append(value)
    summary = {}
    for index, label in labels.items():
        kernels = ranges.get(index, {})
        steps = label["steps"]
        per_step = {name: sum(us) / steps for name, us in kernels.items()}
        busy = sum(per_step.values())
        summary[label["label"]] = {
            "device_us_per_step": busy,
            "weight_bytes_per_step": label.get("weight_bytes_per_step"),
            "achieved_GBps": (label["weight_bytes_per_step"] / busy * 1e-3
                              if busy and label.get("weight_bytes_per_step") else None),
            "kernels_per_step": sum(len(us) for us in kernels.values()) / steps,
            "top": dict(sorted(per_step.items(), key=lambda item: -item[1])[:25]),
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", default="q4", choices=["bf16", "q4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--variants", nargs="+", default=["auto"], metavar="OP=BACKEND[,OP=BACKEND]",
        help="kernel choices to compare in this process, one engine each ('auto': the defaults)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per variant")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script")
    parser.add_argument("--shape", default="llama-3.2-1b",
                        help="a shape of gpu_decode.py's SHAPES (its 4-bit folder for a mixture of experts)")
    parser.add_argument(
        "--ncu-steps", type=int, default=0,
        help="instead of timing, run this many pipelined steps per variant and row count (rows of "
        "one length) between marker kernels, for `ncu --metrics gpu__time_duration.sum --csv`",
    )
    parser.add_argument("--summarize-ncu", type=Path, metavar="CSV",
                        help="summarize the ncu log of an --ncu-steps run (its --out JSON) and exit")
    args = parser.parse_args()
    if args.summarize_ncu:
        assert args.out is not None, "--out: the --ncu-steps run's JSON"
        labels = {int(k): v for k, v in json.loads(args.out.read_text())["ncu_markers"].items()}
        print(json.dumps(summarize_ncu(args.summarize_ncu, labels), indent=1))
        return 0

    from gpu_decode import SHAPES, smoke_shape, write_folders

    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    report: dict[str, Any] = {"device": str(mx.default_device()), "weights": args.weights,
                              "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPES[args.shape]
        folder = write_folders(Path(tmp), smoke_shape(shape) if args.smoke else shape,
                               (args.weights,))[args.weights]
        report["shape"] = args.shape
        engines = {}
        for variant in args.variants:
            choices = {} if variant == "auto" else dict(c.split("=", 1) for c in variant.split(","))
            config = Config(
                models=[ModelConfig(path=str(folder), name="bench", dtype="bfloat16",
                                    quantization="keep", kernels=choices)],
                engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
            )
            engines[variant] = Engine(config, load_plugins())
            engines[variant].start()
            report["variants"][variant] = {
                "kernels_chosen": dict(engines[variant]._loaded["bench"].kernels.chosen), "rows": {}
            }
        try:
            # Decode on a stream of its own, as the engine does (not the one the model loaded on).
            with mx.stream(mx.new_stream(mx.default_device())):
                if args.ncu_steps:
                    report["ncu_markers"] = {}
                    for variant, engine in engines.items():
                        for rows in args.rows:
                            model = engine._loaded["bench"]
                            caches = batch_caches(model, rows, args.prompt_tokens, False)
                            pipelined(model, caches, 4)
                            index = len(report["ncu_markers"]) + 1
                            report["ncu_markers"][index] = {
                                "label": f"{variant} | {rows} rows", "steps": args.ncu_steps,
                                "weight_bytes_per_step": step_bytes(model.model, rows)}
                            marker(index)
                            pipelined(model, caches, args.ncu_steps)
                            marker(0)
                            del caches
                    args.rows = []
                for rows in args.rows:
                    for padded in (False, True) if rows > 1 else (False,):
                        label = f"{rows} rows" + (", padded" if padded else "")
                        for round_index in range(args.rounds):
                            for variant, engine in engines.items():
                                model = engine._loaded["bench"]
                                caches = batch_caches(model, rows, args.prompt_tokens, padded)
                                pipelined(model, caches, 8)  # first use of the shape
                                result = pipelined(model, caches, args.steps)
                                result["waited_step_ms"] = waited(model, caches, min(args.steps, 50))
                                result["tokens_per_s"] = rows / result["step_ms"] * 1e3
                                report["variants"][variant]["rows"].setdefault(label, []).append(result)
                                print(f"{variant} | {label} | round {round_index + 1}: " + ", ".join(
                                    f"{k} {v:.2f}" for k, v in result.items()), flush=True)
                                del caches
        finally:
            for engine in engines.values():
                engine.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
