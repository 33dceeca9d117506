"""The deepseek_v3 graph against transformers' ``DeepseekV3ForCausalLM`` on tiny random weights.

Two configs: one as DeepSeek-V3 is built (a query bottleneck, interleaved RoPE stretched by YaRN
with ``mscale_all_dim`` apart from ``mscale``, 8 experts in 4 groups of which 2 are chosen from,
a correction bias that moves the choice, the first layer dense, v_head_dim apart from
qk_nope_head_dim) and one without the options (``q_proj``, plain RoPE in halves, one group, no
renormalization, every layer sparse). Each folder is written by transformers and compared on
logits (prompts long enough for the expanded form, decode steps in the absorbed one), cached
decoding, a left-padded batch, prompts prefilled together and a prefix-cache hit; then greedy
tokens through the engine, the latent cache's size, the released checkpoints' config and
weights, and FP8 block-scaled weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ConfigError, ModelLoadError
from mlxr_core.model.cache import position_bytes
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import (
    Reference,
    check_reference,
    engine_greedy,
    load_reference_model,
    o1_init,
    tiny_reference,
    transformers_greedy,
)
from mlxr_plugins.archs.deepseek_v3 import DeepseekV3Architecture, DeepseekV3Args

BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    # transformers defaults it to 128 whatever the heads, which its eager attention cannot take.
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "rope_parameters": YARN},
    ),
    "plain": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
         "norm_topk_prob": False, "routed_scaling_factor": 1.5, "rope_interleave": False},
    ),
}
#: DeepSeek-V3's attention shapes (128 heads, the latent of 512, rotary key of 64, per head 128 + 128).
V3_ATTENTION = {"num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128, "v_head_dim": 128}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def init(model: Any, torch: Any) -> None:
    """O(1) weights, and correction biases as large as the router's scores spread, so that they
    move the choice (transformers initializes them to zero, a buffer :func:`o1_init` skips)."""
    o1_init(model, torch)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory) -> Reference:
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    model_class, config_class, extra = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"deepseek_v3_{request.param}")
    return tiny_reference(model_class, config_class, {**BASE, **extra}, folder, init=init)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    """Logits, cached decoding, a left-padded batch, prompts prefilled together, a prefix hit."""
    assert np.abs(reference.logits[0]).max() > 1.0  # not a comparison of near-zero numbers
    check_reference(reference, registries, backend=backend)


@pytest.mark.slow
def test_the_engine_serves_transformers_greedy_tokens(reference):
    """Four concurrent greedy streams of 12 tokens through the engine (continuous batching, the
    compiled decode step, prompts prefilled in chunks of 24: expanded, then absorbed; a one-token
    prompt; a prompt extending a cached one) give transformers' tokens for each prompt."""
    prompts = [reference.prompts[0], reference.prompts[1], [7], [*reference.prompts[0][:30], 5, 9]]
    want = transformers_greedy("DeepseekV3ForCausalLM", reference.folder, prompts, 12)
    assert engine_greedy(reference.folder, prompts, 12) == want


def test_the_cache_holds_the_latent_at_least_8x_smaller_than_expanded_heads():
    """DeepSeek-V3's attention shapes: each layer's cache declares kv_lora_rank + qk_rope_head_dim
    numbers a position (576), against a key of 192 and a value of 128 for each of 128 heads
    (40,960) were the heads expanded: 71x smaller. The model is built lazily (no weight is
    evaluated)."""
    from mlxr_core.kernels import bind_kernels

    arch = DeepseekV3Architecture()
    config = {**BASE, **V3_ATTENTION, "hidden_size": 256, "num_hidden_layers": 2, "q_lora_rank": None,
              "first_k_dense_replace": 2, "n_group": 1, "topk_group": 1}
    kernels = bind_kernels(load_plugins().registries.kernels, dtype="bfloat16", shapes=arch.kernel_context(config))
    caches = arch.make_cache(arch.build(config, kernels))
    assert [cache.width for cache in caches] == [512 + 64, 512 + 64]
    latent = position_bytes(caches, heads=1, head_dim=1, itemsize=2)  # the widths, not these heads
    expanded = 2 * 128 * ((128 + 64) + 128) * 2  # two layers' keys and values, bfloat16
    assert latent == 2 * 576 * 2
    assert expanded / latent >= 8


def test_the_kv_budget_and_info_count_the_latent(reference, registries):
    """The engine's bytes per token and ``mlxr info``'s: 3 layers x (16 + 8) float32 numbers."""
    from mlxr_core.cli.info import describe_model
    from mlxr_core.engine.batch import kv_bytes_per_token

    per_token = 3 * (16 + 8) * 4
    assert kv_bytes_per_token(load_reference_model(reference, registries)) == per_token
    facts = describe_model(str(reference.folder), dtype="float32")
    assert facts["architecture"] == "deepseek_v3"
    assert facts["kv_bytes_per_token"] == facts["kv_bytes_per_token_full_precision"] == per_token
    assert facts["kv_bytes_at_context"] == per_token * facts["context_length"]


def test_quantized_keys_and_values_are_refused(reference, registries):
    from mlxr_core.config.schema import KVCacheConfig

    config = ModelConfig(path=str(reference.folder), dtype="float32", kv_cache=KVCacheConfig(bits=8))
    with pytest.raises(ConfigError, match=r"kv_cache cannot apply: .*reads its cache itself"):
        load_model(config, registries)


def test_packed_weights_stay_close(reference, registries):
    """``quantization: q8``: every linear layer packed (the router and the per-head latent
    projections stay float): near the float32 reference, most greedy choices kept. The rounding
    flips a near tie of the biased, group-limited choice at a few positions, which then move by
    O(1) (here 2% of the largest logit on average and 85% of the argmax kept; q4 gives 10% and
    50%, a layout error more)."""
    loaded = load_model(ModelConfig(path=str(reference.folder), dtype="float32", quantization="q8"), registries)
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        got = np.array(loaded.model(mx.array([ids]))[0])
        assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("scoring_func", "softmax", "scoring_func 'softmax' is not supported"),
        ("topk_method", "greedy", "topk_method 'greedy' is not supported"),
        ("moe_layer_freq", 2, "moe_layer_freq 2 is not supported"),
        ("n_group", 3, "n_group = 3 does not divide n_routed_experts = 8"),
        ("topk_group", 1, "num_experts_per_tok = 3 experts cannot be chosen"),
        ("kv_lora_rank", 0, "kv_lora_rank"),
    ],
)
def test_configs_it_does_not_compute_are_refused(key, value, message):
    config = {**BASE, **FAMILIES["v3"][2], "num_experts_per_tok": 3, key: value}
    with pytest.raises(ModelLoadError, match=message) as raised:
        DeepseekV3Args.from_config(config)
    assert raised.value.key == key


def released_layout(reference: Reference, folder: Path) -> None:
    """``reference``'s folder as DeepSeek ships V3: ``rope_theta`` and ``rope_scaling`` (YaRN as
    ``type``) at the top, no ``head_dim``, ``num_key_value_heads`` 128, the router keys spelled
    out, and a multi-token-prediction layer stored after the last one."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(reference.folder, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("head_dim")
    config.update(
        rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
        num_key_value_heads=128, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
        num_nextn_predict_layers=1,
    )
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    hidden = config["hidden_size"]
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    tensors["model.layers.3.enorm.weight"] = np.ones(hidden, np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_the_released_layout_matches_transformers(reference, registries, tmp_path):
    if reference.config["rope_parameters"]["rope_type"] != "yarn":
        pytest.skip("the released config is the YaRN one")
    released_layout(reference, tmp_path / "released")
    check_reference(Reference(tmp_path / "released", reference.prompts, reference.logits, reference.config), registries)


def fp8_blocks(weight: Any, rows: int, columns: int) -> tuple[Any, Any]:
    """``weight`` as float8 e4m3 in blocks of ``rows`` x ``columns`` (each block's largest value at
    448, e4m3's largest) and the float32 ``weight_scale_inv`` per block (torch tensors)."""
    import torch

    R, C = weight.shape
    grid = (-(-R // rows), -(-C // columns))
    padded = torch.zeros(grid[0] * rows, grid[1] * columns)
    padded[:R, :C] = weight
    blocks = padded.reshape(grid[0], rows, grid[1], columns)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.reshape(padded.shape)[:R, :C].contiguous(), scale


def test_fp8_block_scaled_weights_are_dequantized(reference, registries, tmp_path):
    """DeepSeek's FP8 folder (every projection but the router as float8 e4m3 with a float32 scale
    per 16 x 32 block, partial blocks at the edges): transformers' logits on the weights it
    holds, dequantized; the scales' field and a float8 weight without scales are named."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if reference.config["rope_parameters"]["rope_type"] != "yarn":
        pytest.skip("one FP8 folder is enough")
    folder, dense = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(reference.folder, folder)
    shutil.copytree(reference.folder, dense)
    tensors = load_file(folder / "model.safetensors")
    dequantized = dict(tensors)
    for name in [n for n in tensors if n.endswith("proj.weight") and tensors[n].ndim == 2]:
        quantized, scale = fp8_blocks(tensors[name], 16, 32)
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantized, scale
        per_element = scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
        dequantized[name] = quantized.float() * per_element[: quantized.shape[0], : quantized.shape[1]]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 32]}
    (folder / "config.json").write_text(json.dumps(config))

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(dense, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].numpy() for ids in reference.prompts]
    assert np.abs(logits[0] - reference.logits[0]).max() > 1e-3  # the rounding shows
    check_reference(Reference(folder, reference.prompts, logits, config), registries)

    config["quantization_config"]["weight_block_size"] = [16]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        load_model(ModelConfig(path=str(folder), dtype="float32"), registries)
