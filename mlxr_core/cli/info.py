"""``mlxr info MODEL``: what a model is and what serving it costs.

Format, architecture, parameter count, the storage type of each tensor in the file and what the
quantization policy makes of it, resident weight size, KV-cache bytes per token and the memory needed
at a given context length. The model is built exactly as ``mlxr serve`` builds it (same policy), so
the sizes are the served ones; its tokenizer is not built.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from mlxr_core.cli.commands import Subparsers
from mlxr_core.config.schema import (
    DTYPES,
    QUANTIZATION_POLICIES,
    ExpertsConfig,
    KVCacheConfig,
    ModelConfig,
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _setting(text: str, schema: type[Any], key: str) -> Any:
    """A ``models[].<key>`` mapping in YAML's inline form, checked as the config checks it."""
    import yaml

    from mlxr_core.config.loader import structure_strict
    from mlxr_core.errors import ConfigError

    try:
        return structure_strict(yaml.safe_load(text), schema, where=(key,))
    except (ConfigError, yaml.YAMLError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_cache(text: str) -> KVCacheConfig:
    """``--kv-cache``: a ``models[].kv_cache`` mapping."""
    setting: KVCacheConfig = _setting(text, KVCacheConfig, "kv_cache")
    return setting


def _experts(text: str) -> ExpertsConfig:
    """``--experts``: a ``models[].experts`` mapping."""
    setting: ExpertsConfig = _setting(text, ExpertsConfig, "experts")
    return setting


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``info`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "info",
        help="describe a model: format, architecture, parameters, quantization, memory",
        description=(
            "Load MODEL as `mlxr serve` would and print its format, architecture, parameter count, "
            "per-type quantization, resident weight size, KV bytes per token and the memory "
            "needed at a context length."
        ),
    )
    parser.add_argument(
        "model", metavar="MODEL", help="a model file or folder, or pkg:DISTRIBUTION[/path]"
    )
    parser.add_argument(
        "--context",
        type=_positive,
        metavar="N",
        help="context length to size (default: the model's)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="activation dtype (as models[].dtype)"
    )
    parser.add_argument("--quantization", choices=QUANTIZATION_POLICIES, default="auto",
                        help="weight policy (as models[].quantization; default auto)")  # fmt: skip
    parser.add_argument(
        "--kv-cache", type=_kv_cache, metavar="SETTING",
        help="size keys and values stored as models[].kv_cache, e.g. '{method: turboquant, bits: 3}' "
        "(default: full precision)",
    )  # fmt: skip
    parser.add_argument(
        "--mmproj", metavar="PATH",
        help="llama.cpp's vision projector file served with MODEL (as models[].mmproj; default: the "
        "one mmproj*.gguf beside a GGUF model file; none: text only)",
    )  # fmt: skip
    parser.add_argument(
        "--experts", type=_experts, metavar="SETTING",
        help="size a mixture of experts served as models[].experts, e.g. '{residency: stream, cache_bytes: "
        "4000000000}': what stays resident, what the experts hold in the files (default: resident)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def describe_model(
    model: str,
    *,
    dtype: str = "auto",
    quantization: str = "auto",
    context: int | None = None,
    kv_cache: KVCacheConfig | None = None,
    mmproj: str | None = None,
    experts: ExpertsConfig | None = None,
) -> dict[str, Any]:
    """The facts ``mlxr info`` prints, as a dict; KV bytes as ``kv_cache`` stores them (the
    checks of ``mlxr serve``: a setting the model cannot take is a ConfigError naming the key);
    with ``experts`` streaming, the resident part, the experts' bytes in the files and the cache."""
    import attrs
    from mlx.utils import tree_flatten

    from mlxr_core.model.cache import position_bytes, reserve_bytes
    from mlxr_core.model.experts.layer import StreamedExperts
    from mlxr_core.model.experts.store import ExpertStore
    from mlxr_core.model.experts.wiring import is_expert_tensor
    from mlxr_core.model.layers.moe import active_share
    from mlxr_core.model.loader import DTYPES, build_model, kv_quantization, leave_in_files
    from mlxr_core.model.paths import resolve_model_path
    from mlxr_core.model.progress import step
    from mlxr_core.model.stages import open_checkpoint, plan
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    path = resolve_model_path(model)
    with step(f"loading {path.name}"):
        streams = experts is not None and experts.residency == "stream"
        opened = open_checkpoint(path, registries, dtype=dtype, mmproj=mmproj,
                                 leave=leave_in_files(path, registries, streams=streams))  # fmt: skip
    planned = plan(opened, registries)
    checkpoint, chosen, arch, config = planned.checkpoint, planned.chosen, planned.arch, planned.config
    dtype = opened.dtype
    shapes = arch.kernel_context(config)
    report: Counter[str] = Counter()
    store = ExpertStore(experts, DTYPES[dtype]) if experts is not None and streams else None
    with step(f"building the {config.get('model_type')} graph ({quantization} policy)"):
        try:
            built = build_model(checkpoint, arch, planned.kernels, quantization, dtype, report, experts=store)
        finally:
            if store is not None:
                store.close()

    flat: list[tuple[str, Any]] = tree_flatten(built.parameters())  # type: ignore[assignment]
    bits = {name: module.bits for name, module in built.named_modules() if hasattr(module, "bits")}
    # Mixtures of experts: a token runs top_k of each layer's stacked experts.
    shares = active_share(built)
    parameters, active = 0, 0.0
    for name, array in flat:
        module, _, part = name.rpartition(".")
        if module in bits and part in ("scales", "biases"):
            continue
        packed = module in bits and part == "weight"  # uint32 words of `bits`-bit integers
        count = array.size * 32 // bits[module] if packed else array.size
        parameters += count
        share = next((s for prefix, s in shares.items() if name.startswith(prefix)), 1.0)
        active += count * share
    streamed = [module for _, module in built.named_modules() if isinstance(module, StreamedExperts)]
    for layer in streamed:  # the experts in the files count as the resident layer would hold them
        parameters += layer.expert_parameters
        active += layer.expert_parameters * (layer.top_k or layer.experts) / layer.experts
    resident = sum(array.nbytes for _, array in flat)
    stored_bytes = sum({id(part.source): part.source.nbytes for name, part in checkpoint.stored.items()
                        if is_expert_tensor(name)}.values())  # fmt: skip
    cache = store.cache.capacity if store is not None else 0
    caches = arch.make_cache(built)
    layers = len(caches)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    attention = sum(1 for cache in caches if cache.attends)
    # A cache may declare its width (a latent, not heads): see position_bytes.
    full_per_token = position_bytes(caches, int(shapes["n_kv_heads"]), int(shapes["head_dim"]), itemsize)
    state = reserve_bytes(caches, 0, 0, itemsize)  # recurrent layers' fixed state per sequence
    context = context or arch.context_length(config)
    kv_per_token, kept = full_per_token, 0
    storage = kv_quantization(ModelConfig(path=model, kv_cache=kv_cache), built, chosen, path.name, registries)
    if storage is not None:
        heads, head_dim = int(shapes["n_kv_heads"]), int(shapes["head_dim"])
        kv_per_token = attention * storage.bytes_per_position(heads, head_dim, itemsize)
        kept = storage.full_precision_positions(context) * full_per_token  # a window's copy, say
    kv_at_context = kv_per_token * context + kept + state
    return {
        **_vision_facts(checkpoint, arch, DTYPES[dtype]),
        "path": str(path),
        "format": opened.format,
        "architecture": config.get("model_type"),
        "architecture_path": chosen.path,
        "architecture_reason": chosen.reason,
        "name": checkpoint.metadata.get("name"),
        "parameters": int(parameters),
        "active_parameters": int(active),
        "dtype": dtype,
        "quantization_policy": quantization,
        "tensor_types": dict(Counter(checkpoint.source_types.values())),
        "quantization": dict(sorted(report.items())),
        "resident_bytes": int(resident),
        "experts": None if store is None else {
            "residency": "stream", "stored_bytes": stored_bytes, "cache_bytes": cache, "policy": experts.policy,  # type: ignore[union-attr]
        },
        "layers": layers,
        "kv_cache": attrs.asdict(storage) if storage is not None else None,
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_token_full_precision": full_per_token,
        "context_length": context,
        "recurrent_layers": layers - attention,
        "state_bytes_per_sequence": state,
        "kv_bytes_at_context": kv_at_context,
        "memory_at_context_bytes": int(resident) + cache + kv_at_context,
    }


def _vision_facts(checkpoint: Any, arch: Any, dtype: Any) -> dict[str, Any]:
    """The vision side's parameters and bytes and how many tokens an image takes (None: it
    follows the image's size), under ``vision``; nothing for a text-only model."""
    from mlx.utils import tree_flatten

    from mlxr_core.model.vision import load_vision

    vision = load_vision(checkpoint, arch, dtype)
    if vision is None:
        return {}
    flat: list[tuple[str, Any]] = tree_flatten(vision.module.parameters())  # type: ignore[assignment]
    tokens = vision.tokens
    return {"vision": {
        "parameters": sum(array.size for _, array in flat),
        "resident_bytes": sum(array.nbytes for _, array in flat),
        "tokens_per_image": tokens.tokens_per_image if tokens.grid is None else None,
        "image_token_id": tokens.image_token_id,
    }}  # fmt: skip


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def run(args: argparse.Namespace) -> int:
    from mlxr_core.model.progress import enable

    enable()  # a spinner on stderr while the model loads, on a terminal only
    facts = describe_model(
        args.model, dtype=args.dtype, quantization=args.quantization, context=args.context,
        kv_cache=args.kv_cache, mmproj=args.mmproj, experts=args.experts,
    )  # fmt: skip
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    out = sys.stdout
    params = facts["parameters"]
    print(f"model:        {facts['path']}", file=out)
    print(f"format:       {facts['format']}    architecture: {facts['architecture']}", file=out)
    print(f"served by:    {facts['architecture_reason']}", file=out)
    print(f"parameters:   {params:,} ({params / 1e6:.1f} M)    layers: {facts['layers']}", file=out)
    if facts["active_parameters"] != params:
        active = facts["active_parameters"]
        print(f"active:       {active:,} ({active / 1e6:.1f} M) per token (mixture of experts)", file=out)
    types = ", ".join(f"{kind} x{count}" for kind, count in sorted(facts["tensor_types"].items()))
    print(f"tensor types: {types or '-'}", file=out)
    print(f"weights ({facts['quantization_policy']} policy, {facts['dtype']}):", file=out)
    for outcome, count in facts["quantization"].items():
        print(f"  {outcome}: {count}", file=out)
    print(f"resident:     {_size(facts['resident_bytes'])}", file=out)
    if facts["experts"] is not None:
        streamed = facts["experts"]
        print(f"experts:      streamed: {_size(streamed['stored_bytes'])} in the files, read into a "
              f"{_size(streamed['cache_bytes'])} cache ({streamed['policy']})", file=out)  # fmt: skip
    if "vision" in facts:
        vision = facts["vision"]
        per_image = vision["tokens_per_image"]
        tokens = f"{per_image} tokens per image" if per_image else "tokens per image from its size"
        print(f"vision:       {vision['parameters']:,} parameters ({_size(vision['resident_bytes'])}), {tokens}",
              file=out)  # fmt: skip
    stored = facts["kv_cache"]
    how = "" if stored is None else f" ({stored.get('method', 'affine')} {stored['bits']}-bit; full precision {_size(facts['kv_bytes_per_token_full_precision'])})"
    print(f"KV cache:     {_size(facts['kv_bytes_per_token'])} per token{how}", file=out)
    if facts["recurrent_layers"]:
        print(
            f"recurrent:    {facts['recurrent_layers']} layers, "
            f"{_size(facts['state_bytes_per_sequence'])} of state per sequence at any length",
            file=out,
        )
    print(
        f"at {facts['context_length']} tokens: {_size(facts['memory_at_context_bytes'])} "
        f"(weights{' + expert cache' if facts['experts'] else ''} + {_size(facts['kv_bytes_at_context'])} KV, "
        "one sequence)",
        file=out,
    )
    return 0
