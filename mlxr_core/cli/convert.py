"""``mlxr convert MODEL OUT``: write any loadable model as an MLX-native (mlx-lm style) folder.

The model is read by its format plugin and built by its architecture exactly as ``mlxr serve``
would, under ``--quantize`` (a ``models[].quantization`` policy: ``keep`` the file's exact packings,
``q8``/``q4``/``q4_g64``, MLX's float modes ``nvfp4``/``mxfp8``/``mxfp4``, or ``none`` for dense
weights, which makes a plain Hugging Face folder).
OUT gets ``model.safetensors`` with the module's own (Hugging Face) tensor names, ``config.json``
with mlx-lm's ``quantization`` block (per-module overrides where packings differ) and the
end-of-generation ids, and the tokenizer: a folder's tokenizer files are copied; a GGUF's
vocabulary is written as ``tokenizer.json`` + ``tokenizer_config.json`` (chat template included)
by mlxr's own GGUF tokenizer, through the ``tokenizers`` library: no transformers, no torch.

The folder is written beside OUT under a temporary name and renamed to OUT when complete: a
convert that fails or is interrupted leaves nothing half-written behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from mlxr_core.cli.commands import Subparsers
from mlxr_core.errors import MlxrError
from mlxr_core.model.tokenizer import Tokenizer, WritesHFFiles

log = logging.getLogger(__name__)

POLICIES = {
    "none": "dequantize", "keep": "keep", "q8": "q8", "q4": "q4", "q4_g64": "q4_g64",
    "nvfp4": "nvfp4", "mxfp8": "mxfp8", "mxfp4": "mxfp4",
}
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
                             "q8/q4/q4_g64: MLX 8/4-bit, group 32/32/64; nvfp4: MLX's NVFP4 (e2m1 "
                             "values, an e4m3 scale per 16); mxfp8/mxfp4: e4m3/e2m1 values, a "
                             "power-of-two scale per 32 (default none)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16",
                        help="dtype of float weights, scales and biases (default float16)")  # fmt: skip
    parser.set_defaults(handler=run)


def convert(model: str, out: str | Path, *, quantize: str = "none", dtype: str = "float16") -> Path:
    """Write ``model`` to the folder ``out``; return it. ``out`` appears only once complete."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise MlxrError(f"{target} exists and is not an empty folder; choose a new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()
    try:
        config = _write_folder(model, staging, quantize=quantize, dtype=dtype)
        if target.is_dir():
            target.rmdir()  # empty, checked above; a rename does not replace a folder everywhere
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("wrote %s (%s, %s)", target, config["model_type"], quantize)
    return target


def _write_folder(model: str, folder: Path, *, quantize: str, dtype: str) -> dict[str, Any]:
    """Write the converted model into ``folder``; return its config.json."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxr_core.model.loader import build_model
    from mlxr_core.model.paths import resolve_model_path
    from mlxr_core.model.progress import step
    from mlxr_core.model.stages import build_tokenizer, open_checkpoint, plan
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    path = resolve_model_path(model)
    with step(f"loading {path.name}"):
        # The text model alone: a projector beside a GGUF is not converted.
        opened = open_checkpoint(path, registries, dtype=dtype, mmproj="none")
    planned = plan(opened, registries)
    checkpoint = planned.checkpoint
    with step(f"building the {checkpoint.config.get('model_type')} graph ({quantize})"):
        built = build_model(checkpoint, planned.arch, planned.kernels, POLICIES[quantize], dtype)

    flat: list[tuple[str, mx.array]] = tree_flatten(built.parameters())  # type: ignore[assignment]
    with step("writing model.safetensors"):
        mx.save_safetensors(str(folder / "model.safetensors"), dict(flat), metadata={"format": "mlx"})
    tokenizer = build_tokenizer(planned, registries)
    config = mlx_config(checkpoint.config, built)
    if tokenizer is not None:
        # mlx-lm stops on config.json's eos_token_id: every id that ends a turn, not only EOS.
        eos = sorted(tokenizer.eos_token_ids)
        config.setdefault("eos_token_id", eos[0] if len(eos) == 1 else eos)
        if tokenizer.bos_token_id is not None:
            config.setdefault("bos_token_id", tokenizer.bos_token_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(path, folder, tokenizer)
    return config


def mlx_config(config: dict[str, Any], model: Any) -> dict[str, Any]:
    """The checkpoint config for mlx-lm: its model_type, and a ``quantization`` block describing
    every packed module (the most common packing by default, others per module, ``false`` for a
    quantizable module left in float)."""
    out = {key: value for key, value in config.items() if key != "quantization_config"}
    out["model_type"] = MLX_LM_MODEL_TYPES.get(config["model_type"], config["model_type"])
    packings: dict[str, tuple[int, int, str]] = {}
    dense: list[str] = []
    for name, module in model.named_modules():
        if hasattr(module, "bits"):
            packings[name] = (module.group_size, module.bits, getattr(module, "mode", "affine"))
        elif hasattr(module, "to_quantized"):
            dense.append(name)
    if not packings:
        out.pop("quantization", None)
        return out
    counts: dict[tuple[int, int, str], int] = {}
    for packing in packings.values():
        counts[packing] = counts.get(packing, 0) + 1
    common = max(counts, key=lambda key: counts[key])
    block: dict[str, Any] = _packing(common)
    for name, packing in sorted(packings.items()):
        if packing != common:
            block[name] = _packing(packing)
    block.update(dict.fromkeys(sorted(dense), False))
    out["quantization"] = block
    out["quantization_config"] = block  # mlx-lm writes both spellings
    return out


def _packing(packing: tuple[int, int, str]) -> dict[str, Any]:
    """One packing as mlx-lm's ``quantization`` block spells it (``mode`` only when not affine,
    which is also what mlx-lm releases before the float modes read)."""
    group_size, bits, mode = packing
    spec: dict[str, Any] = {"group_size": group_size, "bits": bits}
    if mode != "affine":
        spec["mode"] = mode
    return spec


def write_tokenizer(source: Path, target: Path, tokenizer: Tokenizer | None) -> None:
    """Write a tokenizer mlxr built from a vocabulary (a GGUF's) as Hugging Face files; else copy
    the tokenizer files of the checkpoint's folder as they are."""
    if isinstance(tokenizer, WritesHFFiles):
        for name, text in tokenizer.hf_files().items():
            (target / name).write_text(text, encoding="utf-8")
        return
    folder = source if source.is_dir() else source.parent
    copied = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    for name in copied:
        shutil.copy2(folder / name, target / name)
    if tokenizer is not None and not copied:
        raise MlxrError(
            f"{source}: no tokenizer files to copy, and its {type(tokenizer).__name__} cannot write "
            "them: the folder would load nowhere"
        )


def run(args: argparse.Namespace) -> int:
    from mlxr_core.model.progress import enable

    enable()  # spinners on stderr, on a terminal only: stdout gets the folder's path alone
    out = convert(args.model, args.out, quantize=args.quantize, dtype=args.dtype)
    print(out)
    return 0
