"""Tiny Hugging Face and mlx-lm folders through our safetensors format and graphs, against the
logits an independent implementation computed on the same files.

The folders and ``reference.json`` under ``tests/fixtures/tiny_hf/`` were written by
``tests/fixtures/make_transformers_reference.py``: transformers (PyTorch, float32, CPU) for
``qwen2`` (q/k/v biases, tied embeddings), ``qwen3`` (per-head q/k norms, head_dim != hidden /
heads) and ``llama`` (llama3 rope scaling, sharded, transformers 5's ``rope_parameters``), ``gemma3``
(sliding-window and global layers, per-layer-type rope bases, logit soft-capping); mlx-lm
for ``llama_mlx_q4`` (mlx-lm's own 4-bit conversion with an 8-bit ``lm_head`` and a module left in
float). Neither needs torch or mlx-lm here.

Tolerance: ``ATOL = 1e-4`` on logits of magnitude ~1-4, in float32. Measured when recorded, with
both kernel backends: at most 7e-6 against transformers and 5e-7 against mlx-lm. A wrong rope
scaling moves these logits by ~0.5, a wrong rope base by ~1.6.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.checkpoint import Checkpoint
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

TINY_HF = Path(__file__).parents[2] / "fixtures" / "tiny_hf"
REFERENCE = json.loads((TINY_HF / "reference.json").read_text(encoding="utf-8"))
FOLDERS = ["qwen2", "qwen3", "llama", "gemma3", "llama_mlx_q4"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@cache
def checkpoint(folder: str) -> Checkpoint:
    return SafetensorsFormat().load(TINY_HF / folder, dtype="float32")


def build(folder: str, registries: Any, backend: str) -> tuple[nn.Module, Any]:
    """The folder's model with packed modules kept packed, as the checkpoint describes them."""
    ckpt = checkpoint(folder)
    arch = registries.archs.get(ckpt.config["model_type"])
    kernels = bind_kernels(
        registries.kernels,
        dtype="float32",
        shapes=arch.kernel_context(ckpt.config),
        choices=dict.fromkeys(OPS, backend),
    )
    model = arch.build(ckpt.config, kernels)
    specs = ckpt.quantization
    if specs:
        nn.quantize(
            model,
            class_predicate=lambda path, _: (
                {"bits": specs[path].bits, "group_size": specs[path].group_size}
                if path in specs
                else False
            ),
        )
    model.load_weights(list(arch.sanitize(ckpt.weights, ckpt.config).items()), strict=True)
    mx.eval(model.parameters())
    return model, arch


def assert_matches(logits: np.ndarray, expected: dict[str, Any], offset: int = 0) -> float:
    """Compare ``logits`` (positions ``offset``...) with the reference's rows and top-k entries;
    return the largest difference seen."""
    worst = 0.0
    for position, row in expected["rows"].items():
        if int(position) >= offset:
            diff = np.abs(logits[int(position) - offset] - np.array(row, dtype=np.float32))
            worst = max(worst, float(diff.max()))
    for position, top in enumerate(expected["top_k"][offset:]):
        ids = [token for token, _ in top]
        diff = np.abs(logits[position][ids] - np.array([logit for _, logit in top]))
        worst = max(worst, float(diff.max()))
        assert int(np.argmax(logits[position])) == ids[0], f"argmax at position {position + offset}"
    assert worst < ATOL, worst
    return worst


def test_the_reference_covers_every_folder_and_is_not_trivial():
    assert set(FOLDERS) <= set(REFERENCE)
    assert REFERENCE["llama_mlx_q4"]["implementation"] == "mlx-lm"
    for folder in FOLDERS:
        prompts = REFERENCE[folder]["prompts"]
        assert {"plain", "chat"} <= set(prompts) and all(len(ids) > 40 for ids in prompts.values())
        row = next(iter(REFERENCE[folder]["logits"]["plain"]["rows"].values()))
        assert max(map(abs, row)) > 1.0


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
@pytest.mark.parametrize("folder", FOLDERS)
def test_logits_match_the_reference(folder, backend, registries):
    model, _ = build(folder, registries, backend)
    for name, ids in REFERENCE[folder]["prompts"].items():
        logits = np.array(model(mx.array([ids]))[0])
        assert_matches(logits, REFERENCE[folder]["logits"][name])


@pytest.mark.parametrize("folder", FOLDERS)
def test_cached_decoding_matches_the_reference(folder, registries):
    """Prefill half the prompt, then one token at a time: rope offsets through the cache."""
    model, arch = build(folder, registries, "mlx_fast")
    ids = REFERENCE[folder]["prompts"]["plain"]
    half = len(ids) // 2
    cache = arch.make_cache(model)
    steps = [model(mx.array([ids[:half]]), cache=cache)]
    steps += [model(mx.array([[token]]), cache=cache) for token in ids[half:]]
    logits = np.array(mx.concatenate(steps, axis=1)[0])
    assert_matches(logits, REFERENCE[folder]["logits"]["plain"])


@pytest.mark.parametrize(
    ("folder", "quantization"),
    [
        ("qwen2", "auto"),
        ("llama", "auto"),
        ("gemma3", "auto"),
        ("llama_mlx_q4", "keep"),
        ("llama_mlx_q4", "dequantize"),
    ],
)
def test_the_served_model_matches_too(folder, quantization, registries):
    """Through the loader (format detection, tokenizer, quantization policy, strict weights)."""
    config = ModelConfig(
        path=str(TINY_HF / folder),
        dtype="float32",
        quantization=quantization,
        kernels=dict.fromkeys(OPS, "mlx_fast"),
    )
    loaded = load_model(config, registries)
    assert loaded.format == "safetensors"
    text = REFERENCE[folder]["texts"]["chat"] if folder != "llama_mlx_q4" else None
    ids = REFERENCE[folder]["prompts"]["chat"]
    if text is not None:
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == ids
    logits = np.array(loaded.model(mx.array([ids]))[0])
    assert_matches(logits, REFERENCE[folder]["logits"]["chat"])
