"""Configs from both eras, read in one place (``mlxr_core.model.layers.config_eras`` and
``ConfigArgs.from_config``): transformers 5's spellings reach every config class under the keys it
declares, ambiguity and math a graph does not compute are refused naming the key."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers import TransformerArgs
from mlxr_core.model.layers.config_eras import current_config, decode_floats, file_spellings
from mlxr_plugins.archs.gemma3 import Gemma3Args
from mlxr_plugins.archs.llama import LlamaArgs
from mlxr_plugins.archs.qwen3_moe import Qwen3MoeArgs

SHAPE = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 97}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
PER_LAYER = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}


def test_rope_parameters_become_the_keys_a_class_declares():
    placed = current_config({"rope_parameters": {**YARN, "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
                            {"rope_theta", "rope_scaling", "partial_rotary_factor"})
    assert placed["rope_theta"] == 5e5 and placed["partial_rotary_factor"] == 0.5
    assert placed["rope_scaling"] == YARN
    plain = current_config({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_scaling"})
    assert plain["rope_theta"] == 1e6 and "rope_scaling" not in plain
    # transformers 5 reads rope_scaling as it reads rope_parameters, the rotated share included.
    nested = {**SHAPE, "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}}
    assert LlamaArgs.from_config(nested).partial_rotary_factor == 0.5
    # A class that declares rope_parameters reads it as it is (Gemma 4).
    assert "rope_theta" not in current_config({"rope_parameters": PER_LAYER}, {"rope_parameters"})
    # Both eras in one file, saying the same: accepted, and placing twice changes nothing.
    both = {"rope_theta": 5e5, "rope_scaling": YARN, "rope_parameters": {**YARN, "rope_theta": 5e5}}
    assert current_config(current_config(both, {"rope_scaling"}), {"rope_scaling"}) == both


def test_per_layer_type_rope_gives_the_global_and_the_local_base():
    args = Gemma3Args.from_config({**SHAPE, "rope_parameters": PER_LAYER, "sliding_window": 8,
                                   "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    assert (args.rope_theta, args.rope_local_base_freq, args.rope_scaling) == (1e6, 1e4, None)
    scaled = {**PER_LAYER, "full_attention": {**YARN, "rope_theta": 1e6}}
    assert Gemma3Args.from_config({**SHAPE, "rope_parameters": scaled}).rope_scaling == YARN


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"rope_scaling": YARN, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": YARN, "rope_parameters": {**YARN, "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {**PER_LAYER, "chunked_attention": {"rope_theta": 1.0}}}, "rope_parameters.chunked_attention"),
        # Llama rotates every layer alike; sliding layers with their own base have no place.
        ({"rope_parameters": PER_LAYER, "sliding_window": 8, "layer_types": ["sliding_attention"] * 4}, "rope_parameters.sliding_attention"),
    ],
)
def test_what_cannot_be_placed_is_refused_naming_the_key(config, key):
    with pytest.raises(ModelLoadError) as caught:
        LlamaArgs.from_config({**SHAPE, **config})
    assert caught.value.key == key


def test_rope_parameters_win_over_a_stale_top_level_base_as_in_transformers(tmp_path):
    """transformers 5 reads ``rope_parameters`` and ignores ``rope_theta`` (or a local base) beside
    it; its own ``save_pretrained`` writes such configs (cohere2_moe)."""
    stale = {"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert LlamaArgs.from_config({**SHAPE, **stale}).rope_theta == 5e5
    local = {"rope_local_base_freq": 3.0, "rope_parameters": PER_LAYER, "sliding_window": 8,
             "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}  # fmt: skip
    assert Gemma3Args.from_config({**SHAPE, **local}).rope_local_base_freq == PER_LAYER["sliding_attention"]["rope_theta"]
    transformers = pytest.importorskip("transformers", reason="the reference reading needs transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **stale}))
    assert transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"] == 5e5


def test_a_per_layer_rope_no_layer_uses_is_no_reason_to_refuse():
    args = LlamaArgs.from_config({**SHAPE, "rope_parameters": PER_LAYER, "layer_types": ["full_attention"] * 4})
    assert args.rope_theta == 1e6


def test_renamed_expert_counts_and_tagged_floats():
    assert Qwen3MoeArgs.from_config({**SHAPE, "num_local_experts": 6}).num_experts == 6
    assert Qwen3MoeArgs.from_config({**SHAPE, "num_experts": 6, "num_local_experts": 6}).num_experts == 6
    with pytest.raises(ModelLoadError) as caught:
        Qwen3MoeArgs.from_config({**SHAPE, "num_experts": 8, "num_local_experts": 6})
    assert caught.value.key == "num_experts"
    LlamaArgs.from_config({**SHAPE, "num_experts": 8, "num_local_experts": 6})  # counts Llama does not read
    decoded = decode_floats({"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "what"}})
    assert decoded["time_step_limit"] == [0.0, math.inf] and decoded["x"] == {"__float__": "what"}


def test_qwen3_moe_without_head_dim_divides_the_hidden_size():
    """transformers 5 writes no head_dim for Qwen3-MoE; its attention uses hidden / heads."""
    assert Qwen3MoeArgs.from_config(SHAPE).dims == 16
    assert Qwen3MoeArgs.from_config({**SHAPE, "head_dim": 128}).dims == 128


@pytest.mark.parametrize(
    ("args_class", "config", "key"),
    [
        (LlamaArgs, {"hidden_act": "gelu"}, "hidden_act"),
        (LlamaArgs, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (LlamaArgs, {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 8}, "layer_types"),
        (LlamaArgs, {"layer_types": ["linear_attention"] + ["full_attention"] * 3}, "layer_types"),
        (LlamaArgs, {"mlp_layer_types": ["dense"] + ["sparse"] * 3}, "mlp_layer_types"),
        (Qwen3MoeArgs, {"mlp_only_layers": [0], "mlp_layer_types": ["sparse"] * 4}, "mlp_layer_types"),
    ],
)
def test_math_the_graph_does_not_compute_is_refused(args_class, config, key):
    with pytest.raises(ModelLoadError) as caught:
        args_class.from_config({**SHAPE, **config})
    assert caught.value.key == key


def test_what_the_graph_computes_anyway_is_accepted():
    LlamaArgs.from_config({**SHAPE, "hidden_act": "silu", "layer_types": ["full_attention"] * 4})
    LlamaArgs.from_config({**SHAPE, "sliding_window": 8, "layer_types": ["sliding_attention"] * 4})
    Qwen3MoeArgs.from_config({**SHAPE, "mlp_only_layers": [0], "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    Gemma3Args.from_config({**SHAPE, "hidden_act": "gelu_pytorch_tanh"})


def test_a_class_that_declares_a_key_reads_it_itself():
    @dataclasses.dataclass
    class Gelu(TransformerArgs):
        hidden_act: str = "silu"

    assert Gelu.from_config({**SHAPE, "hidden_act": "gelu"}).hidden_act == "gelu"


def test_errors_name_where_the_file_holds_a_placed_value():
    assert file_spellings({"rope_parameters": {**YARN, "rope_theta": 1.0}, "num_local_experts": 4}) == {
        "rope_theta": "rope_parameters.rope_theta",
        "partial_rotary_factor": "rope_parameters.partial_rotary_factor",
        "rope_scaling": "rope_parameters",
        "num_experts": "num_local_experts",
        "n_routed_experts": "num_local_experts",
    }
    spelled = file_spellings({"rope_parameters": PER_LAYER, "rope_theta": 1.0})
    assert spelled["rope_scaling"] == "rope_parameters.full_attention" and "rope_theta" not in spelled
    assert spelled["rope_local_base_freq"] == "rope_parameters.sliding_attention.rope_theta"
