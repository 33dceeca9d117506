"""How many primitives one decode step is, by kind: what MLX replays and evaluates per token.

    python bench/step_graph.py [--smoke] [--weights bf16 q4] [--out FILE]

Loads the Llama-3.2-1B-shaped random weights of ``gpu_decode.py`` with mlxr's defaults for the
device (its kernels, the compiled step), prefills four tokens, builds one single-stream decode step
and exports its graph (``mx.export_to_dot``), then counts the graph's primitives by name. A
one-token step on a GPU is bound by the host, which pays for every primitive (a view like
``Reshape`` as well as a kernel), so fewer primitives per step is a faster step. Prints JSON.
A diagnostic, not a peer comparison.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: A primitive's node in MLX's DOT export; arrays are the other nodes.
_PRIMITIVE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def count_primitives(dot: str) -> collections.Counter[str]:
    """Primitives of an exported graph by name."""
    return collections.Counter(_PRIMITIVE.findall(dot))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["bf16", "q4"], choices=["bf16", "q4"])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from gpu_decode import LLAMA_1B, SMOKE, write_folders

    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    report: dict[str, object] = {"device": str(mx.default_device())}
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_folders(Path(tmp), SMOKE if args.smoke else LLAMA_1B)
        for name in args.weights:
            config = Config(
                models=[ModelConfig(path=str(folders[name]), name="bench", dtype="bfloat16", quantization="keep")],
                engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
            )
            engine = Engine(config, load_plugins())
            engine.start()
            try:
                model = engine._loaded["bench"]
                cache = model.make_cache()
                model.model(mx.array([[1, 2, 3, 4]], dtype=mx.int32), cache=cache)
                mx.eval([array for layer in cache for array in layer.state])
                logits = model.decode(mx.array([5], dtype=mx.int32), cache)
                dot = Path(tmp) / f"{name}.dot"
                mx.export_to_dot(str(dot), logits)
                counts = count_primitives(dot.read_text())
                report[name] = {
                    "decode_step": "compiled" if model.compiled_decode else "eager",
                    "kernels": dict(model.kernels.chosen),
                    "layers": len(cache),
                    "primitives": sum(counts.values()),
                    "by_name": dict(counts.most_common()),
                }
            finally:
                engine.stop()
            print(json.dumps({name: report[name]}, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
