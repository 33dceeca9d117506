"""The mixture-of-experts families against transformers on tiny random weights: Qwen3-MoE
(renormalized top-k, one dense layer among sparse ones), Qwen2-MoE (a shared expert behind a
sigmoid gate, no renormalization) and Mixtral (per-expert ``w1``/``w3``/``w2``, a sliding window).

Each folder is written by transformers (its hub layout: one tensor per expert), loaded through
mlxr's safetensors format and loader, and compared on logits, cached decoding, a left-padded batch
and a prefix-cache hit (:func:`mlxr_core.testing.hf_reference.check_reference`); packed experts
(``quantization: q8``) stay close to the reference and keep its greedy choices.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.model.layers.moe import QuantizedSwitchLinear
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import check_reference, tiny_reference

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 6, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "mlp_only_layers": [1]},
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {"num_experts": 6, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "norm_topk_prob": False},
    ),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 6, "sliding_window": 12}),
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    model_class, config_class, extra = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return tiny_reference(model_class, config_class, {**BASE, **extra}, folder)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend)


def test_packed_experts_stay_packed_and_close(reference, registries):
    """8-bit experts multiplied packed (``gather_qmm``): near the float32 reference, same argmax."""
    loaded = load_model(
        ModelConfig(path=str(reference.folder), dtype="float32", quantization="q8"), registries
    )
    packed = [m for _, m in loaded.model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert packed and all(m.bits == 8 for m in packed)
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        got = np.array(loaded.model(mx.array([ids]))[0])
        # 8-bit groups of 32 in every linear layer, the router included: ~1% of the largest
        # logit on average. A near tie between two experts' router scores may flip a choice at
        # some position (that position then moves by O(1)), so the bound is on the mean; a wrong
        # expert layout or a dropped shared expert moves every position by O(1).
        assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_a_missing_expert_is_named(reference, registries, tmp_path):
    """A checkpoint that lacks one expert's tensor fails naming it, not with a shape error."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(reference.folder, folder)
    tensors = load_file(folder / "model.safetensors")
    victim = next(name for name in sorted(tensors) if ".experts.3." in name)
    del tensors[victim]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"lacks 1 expert tensor\(s\) of 6 experts: model\.layers\.\d\.mlp\.experts\.3\."):
        load_model(ModelConfig(path=str(folder), dtype="float32"), registries)
