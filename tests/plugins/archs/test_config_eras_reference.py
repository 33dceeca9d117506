"""Every native text architecture from its config as transformers 5.25 writes it and as released
checkpoints (transformers 4) wrote it for the same model, against transformers' greedy tokens.

The reference tests elsewhere pass their shapes explicitly (``head_dim`` among them); here only the
sizes are shrunk and every other key keeps the config class's default, as a user saving a model
gets it: Qwen3-MoE's config then has no ``head_dim`` (its attention divides the hidden size),
Qwen3-Next's RoPE shape is inside ``rope_parameters``, Gemma 3's bases are per layer type. The
transformers 4 form of each folder is the same weights with the config rewritten as that release
spelled it (:func:`transformers4_config`). Each is loaded through mlxr's safetensors format and
loader and decoded greedily: its 12 tokens must be transformers' and the first step's logits
within ``ATOL``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from mlxr_core.testing.hf_reference import (
    GreedyReference,
    greedy_reference,
    greedy_tokens,
    load_reference_model,
)

SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 97}
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
#: DeltaNet's sizes shrunk (its defaults are 16 and 32 heads of 128), the attention's left alone.
DELTA = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
#: model_type -> keys over SIZES (only sizes, and what a family needs to be tiny or to load).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": MOE,
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 48},
    "mixtral": MOE,
    "phi3": {"pad_token_id": 0},
    "gemma3_text": {"sliding_window": 8},
    "gpt_oss": {**MOE, "sliding_window": 8},
    "gemma4_text": {"sliding_window": 8, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97},
    "gemma3n_text": {"sliding_window": 8, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97,
                     "num_kv_shared_layers": 2, "laurel_rank": 8,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    "qwen3_next": {**MOE, **DELTA, "shared_expert_intermediate_size": 48},
    "qwen3_5_text": DELTA,
    "qwen3_5_moe_text": {**MOE, **DELTA},
}
#: Families transformers 4 never wrote a config for (released with transformers 5).
FIVE_ONLY = {"gemma4_text", "qwen3_5_text", "qwen3_5_moe_text"}
TOKENS = 12
#: Logits of magnitude ~1-5 in float32; the hybrids' recurrence differs between transformers' own
#: chunked and step forms by ~1e-4 (see test_hybrid_reference.py).
ATOL = 1e-3


def transformers4_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as transformers 4 wrote it: ``rope_theta``, ``partial_rotary_factor`` and
    ``rope_scaling`` at the top (Gemma 3's local base as ``rope_local_base_freq``), Qwen3-MoE's
    expert count as ``num_experts``."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    if "full_attention" in rope:
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    scaling = {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor")}
    config["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope["partial_rotary_factor"]
    config["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
    if config["model_type"] == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    return config


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


#: The hybrids' reference runs transformers' recurrence in Python: 5-12 s each here.
SLOW = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


@pytest.fixture(
    scope="module",
    params=[pytest.param(family, marks=pytest.mark.slow) if family in SLOW else family for family in FAMILIES],
)
def written(request, tmp_path_factory) -> GreedyReference:
    folder = tmp_path_factory.mktemp(request.param)
    return greedy_reference(request.param, {**SIZES, **FAMILIES[request.param]}, folder, tokens=TOKENS)


@pytest.mark.parametrize("era", ["transformers 5", "transformers 4"])
def test_greedy_tokens_are_transformers(written, era, registries, tmp_path):
    reference = written
    if era == "transformers 4":
        config = json.loads((reference.folder / "config.json").read_text(encoding="utf-8"))
        if config["model_type"] in FIVE_ONLY:
            pytest.skip(f"transformers 4 wrote no {config['model_type']} config")
        folder = Path(shutil.copytree(reference.folder, tmp_path / "four"))
        (folder / "config.json").write_text(json.dumps(transformers4_config(config)), encoding="utf-8")
        reference = attrs.evolve(reference, folder=folder)
    tokens, logits = greedy_tokens(load_reference_model(reference, registries), reference.prompt, TOKENS)
    worst = float(np.abs(logits - reference.logits).max())
    assert worst <= ATOL, f"the first step's logits differ from transformers' by {worst:.3g}"
    assert tokens == reference.tokens
