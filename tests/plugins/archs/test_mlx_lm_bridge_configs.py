"""The mlx-lm bridge hands mlx-lm's ``ModelArgs`` a config in the form it reads, whichever
transformers wrote it, and refuses, naming the key, a config whose math ``ModelArgs`` would drop.

Tiny models saved by transformers 5.25 from their config classes' defaults (sizes shrunk), served
through the bridge and decoded greedily against transformers: Ministral 3 (YaRN and Llama 4's
attention scaling, only in ``rope_parameters``; also rewritten as transformers 4 spelled RoPE),
LFM2 (no ``block_dim``, which mlx-lm requires), GLM-4.5 (no ``head_dim``, which mlx-lm requires;
half of each head rotated, in ``rope_parameters``). Then the refusals, on transformers' MiniMax and on mlx-lm's own
``ModelArgs`` classes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

pytest.importorskip("mlx_lm", reason="the mlx-lm bridge needs mlx-lm: pip install 'mlxr[mlx-lm]'")

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import greedy_reference, greedy_tokens, load_reference_model
from mlxr_plugins.archs.mlx_lm_bridge.configs import mlx_lm_config

SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 97}
#: Ministral 3's defaults with a pre-training length the prompt passes (Llama 4's scaling of the
#: queries then differs from 1, as it does past 16K tokens in the released model).
MINISTRAL_ROPE = {
    "rope_type": "yarn", "type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8,
    "max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "ministral3": {"rope_parameters": MINISTRAL_ROPE, "max_position_embeddings": 128},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                 "n_group": 1, "topk_group": 1},
}
#: Families a transformers 5 config of which mlx-lm's ModelArgs read wrongly or not at all before
#: the bridge filled what they lack, from their defaults as the zoo check shrinks them: GLM-4.7-Flash
#: (only mlp_layer_types, no first_k_dense_replace), EXAONE-MoE (is_moe_layer), DeepSeek-V2 and
#: MiniCPM3 (no rope_scaling, which their RoPE classes read whatever the config), EXAONE
#: (num_layers, layer_norm_epsilon), MiniMax-M2 (rotary_dim, shared_intermediate_size), Apertus,
#: GPT-NeoX (a quarter of each head rotated: rotary_pct, rotary_emb_base).
FILLED = ("glm4_moe_lite", "exaone_moe", "deepseek_v2", "minicpm3", "exaone", "minimax_m2", "apertus", "gpt_neox")
TOKENS = 12


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def written(request, tmp_path_factory):
    keys = {**SIZES, **FAMILIES[request.param]}
    return greedy_reference(request.param, keys, tmp_path_factory.mktemp(request.param), tokens=TOKENS)


def test_the_config_transformers_5_writes_serves_transformers_tokens(written, registries):
    config = json.loads((written.folder / "config.json").read_text(encoding="utf-8"))
    assert "block_dim" not in config and "rope_theta" not in config
    assert config["model_type"] != "glm4_moe" or "head_dim" not in config
    loaded = load_reference_model(written, registries)
    assert "mlx-lm" in loaded.arch_reason
    assert greedy_tokens(loaded, written.prompt, TOKENS)[0] == written.tokens


@pytest.mark.parametrize("model_type", FILLED)
def test_keys_model_args_lacks_are_filled_as_transformers_computes_them(model_type, registries, tmp_path):
    from mlxr_core.testing.zoo import tiny_keys

    written = greedy_reference(model_type, tiny_keys(model_type), tmp_path, tokens=TOKENS)
    loaded = load_reference_model(written, registries)
    assert "mlx-lm" in loaded.arch_reason
    assert greedy_tokens(loaded, written.prompt, TOKENS)[0] == written.tokens


def test_ministral3_with_a_window_on_every_layer_is_refused(registries, tmp_path):
    """transformers' Ministral 3 slides ``sliding_window`` over every layer; mlx-lm's only over
    the layers ``layer_types`` names sliding (2 of 12 greedy tokens agreed, silently)."""
    keys = {**SIZES, **FAMILIES["ministral3"], "sliding_window": 4}
    written = greedy_reference("ministral3", keys, tmp_path, tokens=1)
    with pytest.raises(ModelLoadError, match="window of 4 in every layer") as caught:
        load_reference_model(written, registries)
    assert caught.value.key == "sliding_window"


def test_ministral3_from_a_config_spelled_as_transformers_4_did(registries, tmp_path):
    """mlx-lm's Ministral 3 reads only ``rope_parameters``: the bridge builds it from
    ``rope_theta`` and ``rope_scaling``."""
    written = greedy_reference("ministral3", {**SIZES, **FAMILIES["ministral3"]}, tmp_path, tokens=TOKENS)
    path = written.folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config), encoding="utf-8")
    loaded = load_reference_model(written, registries)
    assert greedy_tokens(loaded, written.prompt, TOKENS)[0] == written.tokens


def test_transformers_minimax_is_not_mlx_lms_minimax(registries, tmp_path):
    """transformers' ``minimax`` is MiniMax-Text-01 (lightning attention on every other layer);
    mlx-lm's is MiniMax-M2, all softmax attention: refused, naming the key that says so."""
    written = greedy_reference("minimax", {**SIZES, "num_local_experts": 4, "num_experts_per_tok": 2}, tmp_path, tokens=1)
    with pytest.raises(ModelLoadError, match="reads no per-layer pattern") as caught:
        load_reference_model(written, registries)
    assert caught.value.key == "layer_types"


@dataclasses.dataclass
class Args:
    """A ``ModelArgs`` as mlx-lm writes them: required keys first, dropping what it does not declare."""

    hidden_size: int
    rope_theta: float
    first_k_dense_replace: int = 0
    rope_scaling: dict[str, Any] | None = None


@dataclasses.dataclass
class Plain:
    hidden_size: int
    rope_theta: float = 10000.0


@pytest.mark.parametrize(
    ("args_class", "config", "key"),
    [
        (Args, {"rope_parameters": {"rope_theta": 1.0, "rope_type": "default"}}, "hidden_size"),
        (Args, {"hidden_size": 8, "rope_theta": 1.0, "first_k_dense_replace": 1,
                "mlp_layer_types": ["dense", "dense", "sparse"]}, "mlp_layer_types"),
        (Plain, {"hidden_size": 8, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
        (Plain, {"hidden_size": 8, "rope_parameters": {"rope_theta": 1.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        (Plain, {"hidden_size": 8, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ],
)
def test_what_model_args_would_drop_or_lack_is_named(args_class, config, key):
    with pytest.raises(ModelLoadError) as caught:
        mlx_lm_config(config, args_class, "test")
    assert caught.value.key == key


def test_transformers_5_spellings_reach_model_args():
    config = mlx_lm_config(
        {"hidden_size": 8, "rope_parameters": {"rope_theta": 5.0, "rope_type": "linear", "factor": 2.0},
         "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse", "sparse"]},
        Args, "test",
    )
    assert config["rope_theta"] == 5.0 and config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    plain = mlx_lm_config({"hidden_size": 8, "rope_parameters": {"rope_theta": 5.0, "rope_type": "default"}}, Args, "test")
    assert plain["rope_scaling"] is None  # plain RoPE, whatever ModelArgs' own default


def test_a_family_mlx_lm_computes_otherwise_is_refused_naming_where():
    """mlx-lm's ERNIE-4.5-MoE drops the routing correction bias transformers chooses experts
    with (2 of 8 greedy tokens agreed on a tiny model, silently); its Jamba renormalizes the
    chosen experts' weights (the first step's logits 0.2 apart)."""
    with pytest.raises(ModelLoadError, match="correction bias") as caught:
        mlx_lm_config({"hidden_size": 8, "rope_theta": 1.0}, Plain, "ernie4_5_moe")
    assert caught.value.tensor == "mlp.gate.moe_statics.e_score_correction_bias"
    with pytest.raises(ModelLoadError, match="softmax over them alone") as caught:
        mlx_lm_config({"hidden_size": 8, "rope_theta": 1.0}, Plain, "jamba")
    assert caught.value.key == "num_experts_per_tok"
