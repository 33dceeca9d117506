"""What the mlx-lm bridge costs: mlxr's engine serving mlx-lm's graph against mlx-lm's own decode
loop on the same weights, back to back, as ratios.

    python bench/mlx_lm_bridge.py [--shape olmoe|llama] [--prompt-tokens 128] [--gen-tokens 256]
                                  [--rounds 3] [--out bench/results/mlx_lm_bridge_olmoe_cpu.json]

The weights are random, in the shape given (speed does not depend on their values), written as an
mlx-lm folder by mlx-lm's own model class. Peers, taking turns within each round (the order
rotates between rounds), one greedy stream each, timed as ``mlxr bench`` times a stream
(:class:`mlxr_core.cli.bench.StreamTiming`: decode tok/s = tokens after the first / their time):

- ``mlx-lm``: ``mlx_lm.generate.generate_step`` on the folder (mlx-lm's graph and caches);
- ``mlxr-bridge``: the engine serving the folder through the bridge (mlx-lm's graph, mlxr's caches,
  scheduler, sampler and detokenizer), with ``models[].arch: mlx-lm`` where mlxr has a native
  graph for the type;
- ``mlxr-native`` (``--shape llama`` only): the engine on mlxr's own Llama graph (compiled decode
  step, fused projections), for what a native architecture buys over the bridge.

Ratios are taken within a round, then the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

SHAPES: dict[str, dict[str, Any]] = {
    "olmoe": {
        "model_type": "olmoe", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama": {
        "model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}


def write_folder(config: dict[str, Any], folder: Path) -> None:
    """Random weights in mlx-lm's own names and layout, a config and a word-level tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxr_core.testing.hf_reference import write_tokenizer

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_tokenizer(folder, config["vocab_size"])


class MlxLm:
    def __init__(self, folder: Path):
        from mlx_lm.utils import load_model

        self.model, _ = load_model(folder)

    def run(self, prompt: list[int], gen_tokens: int) -> Any:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        from mlxr_core.cli.bench import StreamTiming

        submitted = time.perf_counter()
        first, tokens = 0.0, []
        steps = generate_step(
            mx.array(prompt), self.model, max_tokens=gen_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        for token, _ in steps:
            first = first or time.perf_counter()
            tokens.append(int(token))
        return StreamTiming(len(prompt), submitted, first, time.perf_counter(), tuple(tokens))

    def close(self) -> None:
        pass


class Mlxr:
    def __init__(self, folder: Path, arch: str):
        from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
        from mlxr_core.engine.engine import Engine
        from mlxr_core.plugins import hookimpl, load_plugins

        class Observer:
            @hookimpl
            def mlxr_model_loaded(self, name: str, model: Any) -> None:
                self.path = f"{model.arch_reason}; decode step " + (
                    "compiled" if model.compiled_decode is not None else "eager"
                )

        observer = Observer()
        model = ModelConfig(path=str(folder), name="bench", dtype="float32", arch=arch)
        engine = EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False))
        host = load_plugins(extra=[("mlx-lm-bridge-bench", observer)])
        self.engine = Engine(Config(models=[model], engine=engine), host)
        self.engine.start()
        self.path = observer.path

    def run(self, prompt: list[int], gen_tokens: int) -> Any:
        from mlxr_core.cli.bench import measure_stream

        return measure_stream(self.engine, "bench", prompt, gen_tokens)

    def close(self) -> None:
        self.engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="olmoe", choices=list(SHAPES))
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()

    import mlx.core as mx
    import numpy as np

    from mlxr_core.blas import ensure_fast_blas

    config = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_folder(config, folder)
        peers: dict[str, Any] = {"mlx-lm": MlxLm(folder)}
        if args.shape == "llama":
            peers["mlxr-bridge"] = Mlxr(folder, "mlx-lm")
            peers["mlxr-native"] = Mlxr(folder, "auto")
        else:
            peers["mlxr-bridge"] = Mlxr(folder, "auto")
        prompt = np.random.default_rng(0).integers(2, config["vocab_size"], args.prompt_tokens).tolist()
        try:
            for peer in peers.values():  # warm-up
                peer.run(prompt, 8)
            rounds: list[dict[str, Any]] = []
            names = list(peers)
            for index in range(args.rounds):
                order = names[index % len(names) :] + names[: index % len(names)]
                timings = {name: peers[name].run(prompt, args.gen_tokens) for name in order}
                rounds.append({name: timing.as_dict() for name, timing in timings.items()})
                tokens = {name: timing.tokens for name, timing in timings.items()}
                rounds[-1]["same_tokens"] = len(set(tokens.values())) == 1
        finally:
            for peer in peers.values():
                peer.close()

    def median(name: str, field: str) -> float:
        return statistics.median(r[name][field] for r in rounds)

    report = {
        "benchmark": "mlx_lm_bridge",
        "shape": args.shape,
        "config": config,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "device": f"{platform.machine()} {mx.default_device()}",
        "blas": ensure_fast_blas(),
        "versions": {"mlx": version("mlx"), "mlx-lm": version("mlx-lm")},
        "paths": {name: getattr(peer, "path", "mlx-lm generate_step") for name, peer in peers.items()},
        "decode_tps": {name: median(name, "decode_tps") for name in peers},
        "prompt_tps": {name: median(name, "prompt_tps") for name in peers},
        "decode_ratio_vs_mlx_lm": {
            name: statistics.median(r[name]["decode_tps"] / r["mlx-lm"]["decode_tps"] for r in rounds)
            for name in peers if name != "mlx-lm"
        },
        "same_tokens_every_round": all(r["same_tokens"] for r in rounds),
        "rounds": rounds,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
