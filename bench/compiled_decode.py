"""Would a compiled decode step pay? mlxr's Llama graph, greedy, three ways on the same weights.

    python bench/compiled_decode.py [--shape llama-3.2-1b|smoke] [--dtype bfloat16] [--gen-tokens 256]

- ``eager``: the model over mlxr's growing KV cache, one step per token, double-buffered with
  ``mx.async_eval`` (what the engine's decode does for one stream);
- ``compiled``: the same model's step under ``mx.compile`` over a fixed-capacity cache whose write
  position is an array (``mx.slice_update``), the rotary offset an array and attention masked to
  the filled positions, so one traced graph serves every position;
- both from the same prefill; the tokens are compared (float32 must agree exactly).

Random weights in the shape (speed does not depend on their values). Prints JSON.
This is an experiment for the engine's decode path, not a peer comparison.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    "smoke": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    },
}


class StaticCache:
    """One layer's K/V in buffers of fixed capacity; ``state = [keys, values, offset]`` with the
    write position as an int32 array, so a compiled step reads and advances it."""

    def __init__(self, keys: Any, values: Any, offset: Any):
        self.state = [keys, values, offset]

    @property
    def offset(self) -> Any:
        return self.state[2]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        start = mx.reshape(self.state[2], (1,))
        self.state[0] = mx.slice_update(self.state[0], keys, start, axes=(2,))
        self.state[1] = mx.slice_update(self.state[1], values, start, axes=(2,))
        self.state[2] = self.state[2] + keys.shape[2]
        return self.state[0], self.state[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import mlx.core as mx

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.plugins import load_plugins
    from mlxr_core.testing.conformance import random_model

    registries = load_plugins().registries
    config = {**SHAPES[args.shape], "model_type": "llama"}
    arch = registries.archs.get("llama")
    kernels = bind_kernels(registries.kernels, dtype=args.dtype, shapes=arch.kernel_context(config))
    model = random_model(arch, config, kernels)
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    prompt = mx.array([[(i * 37) % 200 + 3 for i in range(args.prompt_tokens)]], dtype=mx.int32)
    capacity = args.capacity

    def prefill() -> tuple[list[Any], Any]:
        cache = arch.make_cache(model)
        logits = model(prompt, cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token, [c.state for c in cache])
        return cache, token

    def timed(step: Any, token: Any, gen: int) -> tuple[list[int], float]:
        """``gen`` greedy tokens from ``step``, double-buffered; the tokens and the seconds taken."""
        out = []
        start = time.perf_counter()
        following = step(token)
        mx.async_eval(following)
        for _ in range(gen):
            out.append(int(token.item()))
            token = following
            following = step(token)
            mx.async_eval(following)
        return out, time.perf_counter() - start

    def eager(gen: int) -> tuple[list[int], float]:
        cache, token = prefill()

        def step(t: Any) -> Any:
            return mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1)

        return timed(step, token, gen)

    def compiled(gen: int) -> tuple[list[int], float]:
        cache, token = prefill()
        statics = []
        for layer in cache:
            keys, values = layer.state[0], layer.state[1]
            length = layer.offset
            pad = [(0, 0), (0, 0), (0, capacity - length), (0, 0)]
            statics.append(StaticCache(mx.pad(keys[..., :length, :], pad), mx.pad(values[..., :length, :], pad),
                                       mx.array(length, dtype=mx.int32)))
        state = [c.state for c in statics]
        positions = mx.arange(capacity)

        def step(t: Any) -> Any:
            mask = (positions <= statics[0].offset)[None, None, None, :]
            return mx.argmax(model(t[:, None], cache=statics, mask=mask)[:, -1, :], axis=-1)

        return timed(mx.compile(step, inputs=state, outputs=state), token, gen)

    assert args.prompt_tokens + args.gen_tokens + 2 <= capacity
    eager(8)
    compiled(8)  # warm-up: traces and compiles once
    report: dict[str, Any] = {"device": str(mx.default_device()), "shape": args.shape, "dtype": args.dtype,
                              "gen_tokens": args.gen_tokens, "capacity": capacity, "rounds": []}
    for _ in range(args.rounds):
        a, ta = eager(args.gen_tokens)
        b, tb = compiled(args.gen_tokens)
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        report["rounds"].append({"eager_tps": args.gen_tokens / ta, "compiled_tps": args.gen_tokens / tb,
                                 "speedup": ta / tb, "first_difference": first})
    report["speedup_median"] = sorted(r["speedup"] for r in report["rounds"])[len(report["rounds"]) // 2]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
