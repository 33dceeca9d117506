"""One rank of ``test_tensor_parallel.py``, started by ``mlx.launch`` (not a test module).

Loads each tiny Hugging Face folder split across the ranks, by heads and columns (tensor) and by
layers (pipeline), and writes, from rank 0, the largest difference of its logits (a full forward
pass, and cached decoding one token at a time) from the reference in
``tests/fixtures/tiny_hf/reference.json``, the argmax agreement, and what loading refused. Also
loads a tiny GGUF with its packed weights kept, split by heads and whole.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf

TINY_HF = Path(__file__).parents[2] / "fixtures" / "tiny_hf"


def worst_difference(logits: np.ndarray, expected: dict, offset: int = 0) -> tuple[float, bool]:
    """The largest difference from the reference's rows and top-k logits at positions
    ``offset``..., and whether every argmax agrees."""
    worst, argmax = 0.0, True
    for position, row in expected["rows"].items():
        if int(position) >= offset:
            worst = max(worst, float(np.abs(logits[int(position) - offset] - np.array(row)).max()))
    for position, top in enumerate(expected["top_k"][offset:]):
        ids = [token for token, _ in top]
        worst = max(worst, float(np.abs(logits[position][ids] - np.array([v for _, v in top])).max()))
        argmax = argmax and int(np.argmax(logits[position])) == ids[0]
    return worst, argmax


FOLDERS = ("llama", "qwen2", "qwen3", "gemma3", "llama_mlx_q4")


def compare(folder: str, split: str, group: Any, registries: Any, reference: dict) -> dict[str, Any]:
    groups = {"tensor_group": group} if split == "tensor" else {"pipeline_group": group}
    try:
        model = load_model(ModelConfig(path=str(TINY_HF / folder), quantization="keep"), registries, **groups)
    except ModelLoadError as exc:
        return {"refused": str(exc)}
    ids = reference[folder]["prompts"]["plain"]
    expected = reference[folder]["logits"]["plain"]
    full = worst_difference(np.array(model.model(mx.array([ids]))[0]), expected)
    half = len(ids) // 2
    cache = model.make_cache()
    rows = [np.array(model.model(mx.array([ids[:half]]), cache=cache)[0, -1])]
    for token in ids[half:]:
        rows.append(np.array(model.decode(mx.array([token]), cache)[0]))
    cached = worst_difference(np.stack(rows), expected, offset=half - 1)
    return {"full": full, "cached": cached, "compiled": model.compiled_decode is not None,
            "layers": len(model.model.layers)}  # fmt: skip


def main(out: str) -> None:
    group = mx.distributed.init(strict=True)
    registries = load_plugins().registries
    reference = json.loads((TINY_HF / "reference.json").read_text(encoding="utf-8"))
    results: dict[str, object] = {"size": group.size()}
    for split in ("tensor", "pipeline"):
        results[split] = {folder: compare(folder, split, group, registries, reference) for folder in FOLDERS}
    rank_file = Path(out).with_suffix(f".rank{group.rank()}.gguf")
    for quant in ("q4_0",):
        path = write_tiny_llama_gguf(rank_file, quant=quant)
        split = load_model(ModelConfig(path=str(path), quantization="keep"), registries, tensor_group=group)
        whole = load_model(ModelConfig(path=str(path), quantization="keep"), registries)
        packed = type(split.model.model.layers[0].mlp.down_proj).__name__
        ids = mx.array([[1, 5, 9, 20, 33, 40, 41, 42]])
        difference = float(mx.abs(split.model(ids) - whole.model(ids)).max())
        results[quant] = {"difference": difference, "layer": packed}
    if group.rank() == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
