"""Where the engine thread's time goes during single-stream decode: cProfile of the scheduler loop.

    python bench/engine_profile.py [--smoke] [--weights bf16] [--gen-tokens 256] [--top 30]

Writes the Llama-3.2-1B-shaped random weights of ``gpu_decode.py``, serves them from an engine
(mlxr's defaults for the device), decodes one greedy stream and prints the engine thread's profile
(sorted by own time), beside the decode tokens/s of the engine (its events read by a consumer
thread, and on the calling thread) and of the same loaded model in a bare loop (on the calling
thread, on a thread of its own, decoding from the engine's batch cache, and handing each token to
a reader thread through a queue, and on one stream reused by every run; and the engine's batch
runner stepped on the calling thread, without the scheduler), each with the median,
90th percentile and longest time between the starts of two decode steps (a steady gap or
occasional stalls), the runners in a rotated order each round; with ``--streams``, the engine's
aggregate decode at those stream counts and where its step's host time goes (building the graph,
encoding it); then of the engine under the profiler. A diagnostic, not a peer comparison.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))


def engine_on_this_thread(engine: Any, prompt: list[int], gen: int) -> float:
    """Single-stream decode tokens/s with the events read on the calling thread (no consumer
    thread: one thread fewer asking for the GIL each token)."""
    from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=gen, temperature=0.0, extra={"ignore_eos": True})
    events = list(engine.submit(GenerationRequest(model="bench", prompt_ids=prompt, params=params)))
    done = events[-1]
    assert isinstance(done, Finished)
    return (gen - 1) / (done.total_s - done.ttft_s)


def runner_on_this_thread(engine: Any, prompt: list[int], gen: int) -> float:
    """The engine's batch runner for this model, stepped on the calling thread without the
    scheduler and its thread (the engine must be idle): the runner's cost without the loop's."""
    import mlx.core as mx

    from mlxr_core.engine.batch import BatchRunner
    from mlxr_core.engine.request import Finished, GenerationRequest, RequestHandle, SamplingParams

    runner = BatchRunner(engine._loaded["bench"], engine.config.engine, engine.host.registries.samplers, None)
    params = SamplingParams(max_tokens=gen, temperature=0.0, extra={"ignore_eos": True})
    handle = RequestHandle(GenerationRequest(model="bench", prompt_ids=prompt, params=params))
    runner.add(handle)
    with mx.stream(mx.new_stream(mx.default_device())):
        while runner.busy:
            runner.step()
    done = list(handle)[-1]
    assert isinstance(done, Finished)
    return (gen - 1) / (done.total_s - done.ttft_s)


def on_a_thread(fn: Callable[..., float], *args: Any) -> float:
    """``fn(*args)`` run on a thread of its own."""
    import threading

    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    return result[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--weights", default="bf16", choices=["bf16", "q4"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="*", default=[],
                        help="also time batched decode at these stream counts (aggregate tok/s, step phases)")
    parser.add_argument("--profile-streams", type=int, default=1, help="streams of the profiled run")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script")
    args = parser.parse_args()

    from gpu_decode import LLAMA_1B, SMOKE, mlxr_bare_decode, mlxr_decode, write_folders

    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine import batch, scheduler
    from mlxr_core.engine.engine import Engine
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.plugins import load_plugins

    profile = cProfile.Profile()
    active = {"on": False}
    original = scheduler.BatchRunner.step

    def profiled_step(self: Any) -> None:
        if not active["on"]:
            return original(self)
        profile.enable()
        try:
            return original(self)
        finally:
            profile.disable()

    scheduler.BatchRunner.step = profiled_step  # type: ignore[method-assign]
    marks: list[float] = []  # when each decode step starts, engine and bare loop alike
    # Per engine decode step, seconds in: the whole step, building the model's graph
    # (LoadedModel.decode), and encoding and launching it (mx.async_eval).
    phases: dict[str, float] = {"step": 0.0, "build": 0.0, "encode": 0.0}
    decode = batch.BatchRunner._decode
    build = LoadedModel.decode
    encode = batch.mx.async_eval

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[key] += time.perf_counter() - start

        return run

    def marked_decode(self: Any) -> None:
        marks.append(time.perf_counter())
        timed("step", decode)(self)

    batch.BatchRunner._decode = marked_decode  # type: ignore[method-assign]
    LoadedModel.decode = timed("build", build)  # type: ignore[method-assign]
    batch.mx = types.SimpleNamespace(**{**vars(batch.mx), "async_eval": timed("encode", encode)})  # type: ignore[assignment]
    prompt = [(i * 37) % 100 + 3 for i in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folders(Path(tmp), SMOKE if args.smoke else LLAMA_1B)[args.weights]
        config = Config(
            models=[ModelConfig(path=str(folder), name="bench", dtype="bfloat16", quantization="keep")],
            engine=EngineConfig(
                max_batch_size=max([1, args.profile_streams, *args.streams]),
                prefix_cache=PrefixCacheConfig(enabled=False),
            ),
        )
        engine = Engine(config, load_plugins())
        engine.start()
        try:
            mlxr_decode(engine, prompt, 16, 1)
            mlxr_bare_decode(engine, prompt, 16)
            gen = args.gen_tokens
            kept_stream = batch.mx.new_stream(batch.mx.default_device())  # reused, as the engine's is
            runners: dict[str, Callable[[], float]] = {
                "engine": lambda: mlxr_decode(engine, prompt, gen, 1)["decode_tps"],
                "engine read here": lambda: engine_on_this_thread(engine, prompt, gen),
                "bare": lambda: mlxr_bare_decode(engine, prompt, gen, marks=marks)["decode_tps"],
                "bare on a thread": lambda: on_a_thread(
                    lambda: mlxr_bare_decode(engine, prompt, gen, marks=marks)["decode_tps"]
                ),
                "bare, batch cache": lambda: mlxr_bare_decode(
                    engine, prompt, gen, batch_cache=True, marks=marks
                )["decode_tps"],
                "bare, tokens to a thread": lambda: mlxr_bare_decode(
                    engine, prompt, gen, marks=marks, handoff=True
                )["decode_tps"],
                "bare, one stream for all runs": lambda: mlxr_bare_decode(
                    engine, prompt, gen, marks=marks, stream=kept_stream
                )["decode_tps"],
                "batch runner here": lambda: runner_on_this_thread(engine, prompt, gen),
                "batch runner on a thread": lambda: on_a_thread(runner_on_this_thread, engine, prompt, gen),
            }
            speeds: dict[str, list[float]] = {name: [] for name in runners}
            steps: dict[str, list[float]] = {name: [] for name in runners}
            names = list(runners)
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                line = []
                for name in names[shift:] + names[:shift]:
                    marks.clear()
                    speeds[name].append(runners[name]())
                    gaps = [b - a for a, b in itertools.pairwise(marks[1:])]  # the first step prefills
                    if gaps:
                        steps[name].append(statistics.median(gaps) * 1e3)
                    line.append(f"{name} {speeds[name][-1]:.0f}"
                                + (f" ({steps[name][-1]:.2f} ms/step median, p90 "
                                   f"{statistics.quantiles(gaps, n=10)[-1] * 1e3:.2f}, max {max(gaps) * 1e3:.1f})"
                                   if gaps else ""))
                print(f"round {round_index + 1}: " + "; ".join(line), flush=True)
            print("medians over rounds: " + "; ".join(
                f"{name} {statistics.median(speeds[name]):.0f} tok/s"
                + (f" ({statistics.median(steps[name]):.2f} ms/step)" if steps[name] else "")
                for name in names
            ), flush=True)
            for streams in args.streams:
                mlxr_decode(engine, prompt, 8, streams)  # first use of the batch shape
                for _ in range(args.rounds):
                    marks.clear()
                    phases.update(step=0.0, build=0.0, encode=0.0)
                    result = mlxr_decode(engine, prompt, gen, streams)
                    tps = result["aggregate_decode_tps" if streams > 1 else "decode_tps"]
                    n = max(len(marks), 1)
                    gaps = [b - a for a, b in itertools.pairwise(marks[1:])]
                    print(f"{streams} streams: {tps:.0f} tok/s aggregate, {len(marks)} decode steps, "
                          f"{statistics.median(gaps) * 1e3:.2f} ms apart (median); per step "
                          f"{phases['step'] / n * 1e3:.2f} ms in the step, of which building "
                          f"{phases['build'] / n * 1e3:.2f} ms and encoding {phases['encode'] / n * 1e3:.2f} ms",
                          flush=True)
            active["on"] = True
            profiled = mlxr_decode(engine, prompt, args.gen_tokens, args.profile_streams)[
                "decode_tps" if args.profile_streams == 1 else "aggregate_decode_tps"
            ]
            active["on"] = False
            print(f"engine under the profiler, {args.profile_streams} stream(s): {profiled:.0f} tok/s "
                  f"(decode step: {'compiled' if engine.model('bench').compiled_decode else 'eager'})")
        finally:
            engine.stop()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
