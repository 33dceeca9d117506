"""Where a single-stream decode step's time goes, and what the levers on it buy.

    python bench/decode_profile.py [--smoke] [--weights bf16 q4] [--ops-per-buffer 20 100] --out F
    python bench/decode_profile.py --settings default MLX_USE_CUDA_GRAPHS=0 \
        MLX_CUDA_USE_CUDNN_SDPA=0,MLX_USE_CUDA_GRAPHS=0 --variants mlx_lm mlxr_fused_compiled

Writes random weights in the Llama-3.2-1B shape as mlx-lm folders (bf16, and mlx-lm's 4-bit group-64
quantization of them), then, for each MLX setting (a worker process each: MLX reads them once), runs
the same bare greedy loop (double-buffered with ``mx.async_eval``, like mlx-lm's ``generate_step``)
over the variants. ``--ops-per-buffer N`` is the setting ``MLX_MAX_OPS_PER_BUFFER=N`` (MLX's CUDA
backend launches its kernels as CUDA graphs of that many nodes; 20 by default); ``--settings`` takes
any comma-separated ``NAME=VALUE`` lists (``MLX_USE_CUDA_GRAPHS=0``: launch kernels one by one;
``MLX_CUDA_USE_CUDNN_SDPA=0``: MLX's own attention kernels instead of cuDNN's). The variants:

- ``mlx_lm``: mlx-lm's own Llama module on the folder;
- ``mlxr_eager``: mlxr's model loaded from the same folder by ``mlxr_core.model.loader.load_model``,
  neither fused nor compiled;
- ``mlxr_fused``: with its query/key/value and gate/up projections joined
  (``models[].fuse_projections``, :mod:`mlxr_core.model.fuse`);
- ``mlxr_compiled``: with its decode step compiled between attentions
  (``models[].compile_decode``, :mod:`mlxr_core.model.compiled`);
- ``mlxr_fused_compiled``: both (mlxr's default on a GPU);
- ``mlxr_cuda_attention``: both, with the ``cuda`` attention kernel (one launch of mlxr's
  flash-decoding kernel per layer instead of ``mx.fast.scaled_dot_product_attention``);
- ``mlxr_two_kernel_norm``: both, with each block's residual add and RMS norm as two kernels
  (``kernels: {add_rms_norm: mlx_fast}``; on CUDA the default is one, ``cuda_norm``);
- ``mlxr_cache_step_256``: both, with KV caches grown in steps of 256 positions (mlx-lm's) instead
  of ``mlxr_core.model.cache.CACHE_STEP``, so that MLX's CUDA attention decodes through cuDNN.

Per variant it reports decode tokens/s (rounds alternate the variants) and, from a synchronous
loop, the per-token milliseconds spent building the graph in Python (``build_ms``), in
``mx.async_eval`` encoding and launching it (``encode_ms``) and waiting for the device after that
(``wait_ms``): when ``build_ms + encode_ms`` is close to the pipelined time per token, the host
bounds decode, not the device. Prints JSON; this is a profiling tool, not a peer comparison (see
``gpu_decode.py`` and ``compare_mlx_lm.py`` for those).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))


def bare_loop(step: Any, prompt: list[int], gen: int) -> tuple[list[int], float]:
    """``gen`` greedy tokens after the prompt's; the tokens and decode tokens/s."""
    import mlx.core as mx

    cache = step.make_cache()
    token = step(mx.array(prompt, dtype=mx.int32)[None], cache)
    mx.eval(token)
    out = []
    start = time.perf_counter()
    following = step(token[:, None], cache)
    mx.async_eval(following)
    for _ in range(gen):
        out.append(int(token.item()))
        token = following
        following = step(token[:, None], cache)
        mx.async_eval(following)
    return out, gen / (time.perf_counter() - start)


def breakdown(step: Any, prompt: list[int], gen: int) -> dict[str, float]:
    """Per-token milliseconds of a synchronous loop: build, encode (async_eval), wait (eval)."""
    import mlx.core as mx

    cache = step.make_cache()
    token = step(mx.array(prompt, dtype=mx.int32)[None], cache)
    mx.eval(token)
    build = encode = wait = 0.0
    for _ in range(gen):
        t0 = time.perf_counter()
        following = step(token[:, None], cache)
        t1 = time.perf_counter()
        mx.async_eval(following)
        t2 = time.perf_counter()
        mx.eval(following)
        t3 = time.perf_counter()
        build, encode, wait = build + t1 - t0, encode + t2 - t1, wait + t3 - t2
        token = following
    return {
        "build_ms": 1e3 * build / gen,
        "encode_ms": 1e3 * encode / gen,
        "wait_ms": 1e3 * wait / gen,
    }


class Step:
    """``step(tokens [B, L], cache) -> [B]`` greedy tokens of one model, and its cache maker."""

    def __init__(self, model: Any, make_cache: Any):
        self.model = model
        self.make_cache = make_cache

    def __call__(self, tokens: Any, cache: Any) -> Any:
        import mlx.core as mx

        return mx.argmax(self.model(tokens, cache=cache)[:, -1, :], axis=-1)


class LoadedStep(Step):
    """mlxr's model as loaded, stepping through :meth:`LoadedModel.decode` (compiled or eager)."""

    def __init__(self, loaded: Any):
        super().__init__(loaded.model, loaded.make_cache)
        self.loaded = loaded

    def __call__(self, tokens: Any, cache: Any) -> Any:
        import mlx.core as mx

        if tokens.shape[1] != 1:
            return super().__call__(tokens, cache)
        return mx.argmax(self.loaded.decode(tokens[:, 0], cache), axis=-1)


def variants(folder: Path, names: list[str] | None = None) -> dict[str, Step]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    peer, _ = mlx_lm_load(folder)
    mx.eval(peer.parameters())
    registries = load_plugins().registries

    def ours(fuse: bool, compile_decode: bool, **kernels: str) -> Any:
        def build() -> LoadedStep:
            config = ModelConfig(
                path=str(folder),
                name="bench",
                dtype="bfloat16",
                quantization="keep",
                fuse_projections=fuse,
                compile_decode=compile_decode,
                kernels=kernels,
            )
            return LoadedStep(load_model(config, registries))

        return build

    def cache_step(positions: int) -> Any:
        def build() -> LoadedStep:
            step = ours(fuse=True, compile_decode=True)()
            make = step.make_cache

            def make_cache() -> Any:
                caches = make()
                for cache in caches:
                    cache.step = positions
                return caches

            step.make_cache = make_cache
            return step

        return build

    makers = {
        "mlx_lm": lambda: Step(peer, lambda: make_prompt_cache(peer)),
        "mlxr_eager": ours(fuse=False, compile_decode=False),
        "mlxr_fused": ours(fuse=True, compile_decode=False),
        "mlxr_compiled": ours(fuse=False, compile_decode=True),
        "mlxr_fused_compiled": ours(fuse=True, compile_decode=True),
        "mlxr_cuda_attention": ours(fuse=True, compile_decode=True, attention="cuda"),
        "mlxr_two_kernel_norm": ours(fuse=True, compile_decode=True, add_rms_norm="mlx_fast"),
        "mlxr_cache_step_256": cache_step(256),
    }
    return {name: make() for name, make in makers.items() if names is None or name in names}


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from gpu_decode import alternate

    prompt = [(i * 37) % 100 + 3 for i in range(args.prompt_tokens)]
    report: dict[str, Any] = {
        "device": str(mx.default_device()),
        "ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default"),
        "settings": args.setting,
    }
    for name in args.weights:
        steps = variants(Path(args.folders) / name, args.variants)
        for step in steps.values():  # warm-up: kernels compiled, graphs cached, clocks up
            bare_loop(step, prompt, 128)
            bare_loop(step, prompt, args.gen_tokens)
        rounds, tokens = alternate(
            {variant: functools.partial(bare_loop, step, prompt, args.gen_tokens) for variant, step in steps.items()},
            args.rounds,
        )
        base = tokens.get("mlx_lm", next(iter(tokens.values())))
        report[name] = {
            variant: {
                "decode_tps": tps,
                "best_tps": max(tps),
                **breakdown(steps[variant], prompt, 64),
                "tokens_equal_mlx_lm": tokens[variant] == base,
            }
            for variant, tps in rounds.items()
        }
        best = report[name].get("mlx_lm", next(iter(report[name].values())))["best_tps"]
        for variant in steps:
            report[name][variant]["best_over_mlx_lm"] = report[name][variant]["best_tps"] / best
        del steps
        mx.clear_cache()
    print(json.dumps(report), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", nargs="+", default=["bf16", "q4"])
    parser.add_argument("--ops-per-buffer", nargs="+", default=[])
    parser.add_argument("--settings", nargs="+", default=[], metavar="NAME=VALUE[,NAME=VALUE]")
    parser.add_argument(
        "--variants", nargs="+", default=None, help="variants to run (default: all)"
    )
    parser.add_argument("--setting", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the script")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folders", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from gpu_decode import LLAMA_1B, SMOKE, write_folders

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_folders(Path(tmp), SMOKE if args.smoke else LLAMA_1B)
        settings = [
            value if value == "default" else f"MLX_MAX_OPS_PER_BUFFER={value}"
            for value in args.ops_per_buffer
        ] + args.settings
        for setting in settings or ["default"]:
            env = dict(os.environ)
            if setting != "default":
                env.update(item.split("=", 1) for item in setting.split(","))
            command = [
                sys.executable,
                __file__,
                "--worker",
                "--folders",
                tmp,
                "--setting",
                setting,
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--gen-tokens",
                str(args.gen_tokens),
                "--rounds",
                str(args.rounds),
                "--weights",
                *args.weights,
                *(["--variants", *args.variants] if args.variants else []),
            ]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return done.returncode
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1], indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
