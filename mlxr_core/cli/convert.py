"""``mlxr convert MODEL OUT``: write any loadable model as an MLX-native (mlx-lm style) folder.

The model is read by its format plugin and built by its architecture exactly as ``mlxr serve``
would, under ``--quantize`` (a ``models[].quantization`` policy: ``keep`` the file's exact packings,
``q8``/``q4``/``q4_g64``, or ``none`` for dense weights, which makes a plain Hugging Face folder).
OUT gets ``model.safetensors`` with the module's own (Hugging Face) tensor names, ``config.json``
with mlx-lm's ``quantization`` block (per-module overrides where packings differ), and the tokenizer:
a folder's tokenizer files are copied; a GGUF's vocabulary is converted by transformers when it is
installed (``pip install transformers``), otherwise the folder has no tokenizer and says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from mlxr_core.cli.commands import Subparsers
from mlxr_core.errors import MlxrError

log = logging.getLogger(__name__)

POLICIES = {"none": "dequantize", "keep": "keep", "q8": "q8", "q4": "q4", "q4_g64": "q4_g64"}
#: Tokenizer and generation files a Hugging Face / mlx-lm folder may hold, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
#: Our model_type -> the one mlx-lm loads the same text model as (its ``gemma3`` is multimodal).
MLX_LM_MODEL_TYPES = {"gemma3": "gemma3_text"}


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``convert`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "convert",
        help="write a model as an MLX-native folder (mlx-lm can load it), optionally quantized",
        description=(
            "Read MODEL (any format mlxr loads) and write OUT: model.safetensors, config.json "
            "(with mlx-lm's quantization block) and the tokenizer."
        ),
    )
    parser.add_argument(
        "model", metavar="MODEL", help="a model file or folder, or pkg:DISTRIBUTION[/path]"
    )
    parser.add_argument(
        "out", metavar="OUT", help="the folder to write (must not exist, or be empty)"
    )
    parser.add_argument("--quantize", choices=tuple(POLICIES), default="none",
                        help="none: dense (a Hugging Face folder); keep: the file's exact packings; "
                             "q8/q4/q4_g64: MLX 8/4-bit, group 32/32/64 (default none)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16",
                        help="dtype of float weights, scales and biases (default float16)")  # fmt: skip
    parser.set_defaults(handler=run)


def convert(model: str, out: str | Path, *, quantize: str = "none", dtype: str = "float16") -> Path:
    """Write ``model`` to the folder ``out``; return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.loader import build_model, pick_arch, pick_format
    from mlxr_core.model.paths import resolve_model_path
    from mlxr_core.plugins import load_plugins

    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise MlxrError(f"{target} exists and is not an empty folder; choose a new one")
    registries = load_plugins().registries
    path = resolve_model_path(model)
    format_name, fmt = pick_format(path, registries)
    checkpoint = fmt.load(path, dtype=dtype)
    arch = pick_arch(checkpoint, registries)
    kernels = bind_kernels(
        registries.kernels, dtype=dtype, shapes=arch.kernel_context(checkpoint.config)
    )
    built = build_model(checkpoint, arch, kernels, POLICIES[quantize], dtype)

    flat: list[tuple[str, mx.array]] = tree_flatten(built.parameters())  # type: ignore[assignment]
    target.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(target / "model.safetensors"), dict(flat), metadata={"format": "mlx"})
    config = mlx_config(checkpoint.config, built)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(path, format_name, target, checkpoint.chat_template)
    log.info("wrote %s (%s, %s)", target, config["model_type"], quantize)
    return target


def mlx_config(config: dict[str, Any], model: Any) -> dict[str, Any]:
    """The checkpoint config for mlx-lm: its model_type, and a ``quantization`` block describing
    every packed module (the most common packing by default, others per module, ``false`` for a
    quantizable module left in float)."""
    out = {key: value for key, value in config.items() if key != "quantization_config"}
    out["model_type"] = MLX_LM_MODEL_TYPES.get(config["model_type"], config["model_type"])
    packings: dict[str, dict[str, int]] = {}
    dense: list[str] = []
    for name, module in model.named_modules():
        if hasattr(module, "bits"):
            packings[name] = {"group_size": module.group_size, "bits": module.bits}
        elif hasattr(module, "to_quantized"):
            dense.append(name)
    if not packings:
        out.pop("quantization", None)
        return out
    counts: dict[tuple[int, int], int] = {}
    for spec in packings.values():
        key = (spec["group_size"], spec["bits"])
        counts[key] = counts.get(key, 0) + 1
    group_size, bits = max(counts, key=lambda key: counts[key])
    block: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for name, spec in sorted(packings.items()):
        if (spec["group_size"], spec["bits"]) != (group_size, bits):
            block[name] = spec
    block.update(dict.fromkeys(sorted(dense), False))
    out["quantization"] = block
    out["quantization_config"] = block  # mlx-lm writes both spellings
    return out


def write_tokenizer(
    source: Path, format_name: str, target: Path, chat_template: str | None
) -> None:
    """Copy a folder's tokenizer files, or convert a GGUF's vocabulary with transformers."""
    folder = source if source.is_dir() else source.parent
    if format_name != "gguf":
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
        return
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning(
            "%s: no tokenizer written (converting a GGUF vocabulary needs transformers: "
            "pip install transformers)",
            target,
        )
        return
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=source.name)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(target))


def run(args: argparse.Namespace) -> int:
    out = convert(args.model, args.out, quantize=args.quantize, dtype=args.dtype)
    print(out)
    return 0
