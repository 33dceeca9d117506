"""The gemma3 graph on the tiny transformers checkpoint (``tests/fixtures/tiny_hf/gemma3``) written
as a GGUF the way llama.cpp's converter writes one, and its window masks.

The graph itself is checked against transformers in ``test_hf_reference.py``; here the same weights
go through the GGUF format (llama.cpp names, norms stored as ``1 + w``, metadata), and the result
must match transformers' logits just as well.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.kernels import bind_kernels
from mlxr_core.model.cache import BatchKVCache, KVCache
from mlxr_core.model.masks import window_mask
from mlxr_core.plugins import load_plugins
from mlxr_plugins.archs.gemma3 import Gemma3Architecture, Gemma3Args
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

FOLDER = Path(__file__).parents[2] / "fixtures" / "tiny_hf" / "gemma3"
REFERENCE = json.loads((FOLDER.parent / "reference.json").read_text(encoding="utf-8"))["gemma3"]
ATOL = 1e-4

#: Hugging Face module -> llama.cpp tensor, as ``convert_hf_to_gguf`` maps Gemma 3.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_CONFIG = json.loads((FOLDER / "config.json").read_text())
#: Settings of the tiny config that a Gemma 3 GGUF cannot carry (llama.cpp hard-codes them).
NOT_IN_GGUF = {
    "layer_types": HF_CONFIG["layer_types"],
    "query_pre_attn_scalar": HF_CONFIG["query_pre_attn_scalar"],
    "rope_local_base_freq": HF_CONFIG["rope_parameters"]["sliding_attention"]["rope_theta"],
    "final_logit_softcapping": HF_CONFIG["final_logit_softcapping"],
}


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{index}.{GGUF_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }[name]


def write_gguf(path: Path, quant: gguf.GGMLQuantizationType) -> Path:
    """The tiny folder as llama.cpp's converter would write it: norms + 1, matrices in ``quant``."""
    config = HF_CONFIG
    hf = SafetensorsFormat().load(FOLDER, dtype="float32")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    for name, array in hf.weights.items():
        data = np.array(array, dtype=np.float32)
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name(name), data + 1)
        elif quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), data)
        else:
            packed = gguf.quants.quantize(data, quant)
            writer.add_tensor(gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def build(config: dict[str, Any], weights: dict[str, mx.array], registries: Any) -> Any:
    arch = Gemma3Architecture()
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
    model = arch.build(config, kernels)
    model.load_weights(list(arch.sanitize(weights, config).items()), strict=True)
    return model


def test_gguf_round_trip_matches_transformers(tmp_path, registries):
    checkpoint = GGUFFormat().load(write_gguf(tmp_path / "g.gguf", gguf.GGMLQuantizationType.F32))
    config = checkpoint.config
    assert config["model_type"] == "gemma3" and config["sliding_window"] == 8
    assert config["query_pre_attn_scalar"] == 16 and config["rope_local_base_freq"] == 1e4
    model = build(
        {**config, **NOT_IN_GGUF}, checkpoint.weights, registries
    )
    for name, ids in REFERENCE["prompts"].items():
        logits = np.array(model(mx.array([ids]))[0])
        expected = REFERENCE["logits"][name]
        for position, row in expected["rows"].items():
            np.testing.assert_allclose(logits[int(position)], row, atol=ATOL)


def test_gguf_norms_come_back_in_the_hugging_face_form(tmp_path):
    """``(w + 1) - 1``: exact in float32 (the converter's rounding of ``w + 1`` is all that is lost),
    and done before a cast to bfloat16, which would otherwise lose most of ``w``."""
    hf = SafetensorsFormat().load(FOLDER, dtype="float32")
    path = write_gguf(tmp_path / "g.gguf", gguf.GGMLQuantizationType.F32)
    for dtype in ("float32", "bfloat16"):
        weights = GGUFFormat().load(path, dtype=dtype).weights
        for name in (n for n in hf.weights if n.endswith("norm.weight")):
            stored = np.array(hf.weights[name]) + np.float32(1)
            expected = mx.array(stored - np.float32(1)).astype(getattr(mx, dtype))
            assert mx.array_equal(weights[name], expected), name


def test_quantized_gguf_keeps_the_function(tmp_path, registries):
    """Q8_0 matrices (exactly repacked) stay within a quantization error of the float logits."""
    checkpoint = GGUFFormat().load(write_gguf(tmp_path / "q.gguf", gguf.GGMLQuantizationType.Q8_0))
    assert checkpoint.quantization  # packed, exactly
    config = {**checkpoint.config, **NOT_IN_GGUF}
    from mlxr_core.model.loader import dequantize_weights

    model = build(
        config,
        dequantize_weights(checkpoint.weights, checkpoint.quantization, mx.float32),
        registries,
    )
    ids = REFERENCE["prompts"]["plain"]
    logits = np.array(model(mx.array([ids]))[0, -1])
    expected = np.array(REFERENCE["logits"]["plain"]["rows"][str(len(ids) - 1)])
    assert int(logits.argmax()) == int(expected.argmax())
    # Logits span about +-20 here; 8-bit weights move them by a few tenths at most.
    assert np.abs(logits - expected).max() < 0.02 * np.abs(expected).max()


def test_config_defaults_and_layer_kinds():
    args = Gemma3Args.from_config(
        {
            "hidden_size": 8,
            "num_hidden_layers": 12,
            "intermediate_size": 16,
            "num_attention_heads": 2,
            "vocab_size": 10,
        }
    )
    assert [i for i in range(12) if not args.is_sliding(i)] == [5, 11]
    nested = Gemma3Args.from_config(
        {"model_type": "gemma3", "text_config": {**args.__dict__, "sliding_window": 64}}
    )
    assert nested.sliding_window == 64


def test_multimodal_names_become_text_model_names():
    arch = Gemma3Architecture()
    config = {"text_config": {"hidden_size": 8, "num_hidden_layers": 1, "intermediate_size": 16,
                              "num_attention_heads": 2, "vocab_size": 10}}  # fmt: skip
    weights = {
        "language_model.model.norm.weight": mx.zeros(1),
        "model.language_model.layers.0.mlp.up_proj.weight": mx.zeros(1),
        "vision_tower.encoder.weight": mx.zeros(1),
        "multi_modal_projector.weight": mx.zeros(1),
        "language_model.lm_head.weight": mx.zeros(1),
    }
    assert set(arch.sanitize(weights, config)) == {
        "model.norm.weight",
        "model.layers.0.mlp.up_proj.weight",
    }


class TestWindowMask:
    def test_within_the_window_the_mask_is_unchanged(self):
        assert window_mask("causal", 4, 8, 8) == "causal"
        assert window_mask(None, 1, 3, 8) is None

    def test_hides_keys_older_than_the_window(self):
        visible = np.array(window_mask("causal", 3, 6, 2))  # queries at 3, 4, 5
        assert visible.tolist() == [
            [False, False, True, True, False, False],
            [False, False, False, True, True, False],
            [False, False, False, False, True, True],
        ]

    def test_combines_with_a_batch_padding_mask(self):
        padding = mx.array([[True] * 6, [False, False, True, True, True, True]])[:, None, None, :]
        mask = np.array(window_mask(padding, 1, 6, 3))
        assert mask.shape == (2, 1, 1, 6)
        assert mask[0, 0, 0].tolist() == [False, False, False, True, True, True]
        assert mask[1, 0, 0].tolist() == [False, False, False, True, True, True]
        short = np.array(window_mask(padding, 1, 6, 5))
        assert short[1, 0, 0].tolist() == [False, False, True, True, True, True]

    def test_additive_masks_get_minus_infinity(self):
        additive = mx.zeros((1, 1, 1, 4))
        out = np.array(window_mask(additive, 1, 4, 2))
        assert out[0, 0, 0].tolist() == [-math.inf, -math.inf, 0.0, 0.0]


def test_batched_decode_past_the_window_matches_single_runs(registries):
    """Two rows of different lengths, both past the 8-position window, through BatchKVCache."""
    checkpoint = SafetensorsFormat().load(FOLDER, dtype="float32")
    model = build(checkpoint.config, checkpoint.weights, registries)
    arch = Gemma3Architecture()
    prompts = [REFERENCE["prompts"]["plain"][:20], REFERENCE["prompts"]["chat"][:13]]
    singles, caches = [], []
    for ids in prompts:
        cache = arch.make_cache(model)
        model(mx.array([ids[:-1]]), cache=cache)
        caches.append(cache)
        singles.append(np.array(model(mx.array([ids]))[0, -1]))
    batch = [BatchKVCache.from_cache(c) for c in caches[0]]
    for layer, other in zip(batch, caches[1], strict=True):
        layer.extend(BatchKVCache.from_cache(other))
    tokens = mx.array([[prompts[0][-1]], [prompts[1][-1]]])
    logits = np.array(model(tokens, cache=batch, mask=batch[0].mask())[:, -1])
    np.testing.assert_allclose(logits, np.stack(singles), atol=ATOL)
    assert isinstance(caches[0][0], KVCache)
