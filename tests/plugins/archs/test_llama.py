"""The llama graph on tiny random models: kernels, caches, config handling, rope scaling."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers import args_rotary, base_freqs
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.archs.llama import ROPE_TYPES, LlamaArchitecture, LlamaArgs

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
PROMPT = [3, 17, 42, 5, 99, 120, 7, 8, 250, 11, 12]


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llama")
    return {q: write_tiny_llama_gguf(root / f"{q}.gguf", quant=q) for q in ("f32", "q4_0", "q8_0")}


def load(path, registries, backend="auto", dtype="float32", quantization="keep"):
    kernels = {} if backend == "auto" else dict.fromkeys(OPS, backend)
    config = ModelConfig(path=str(path), dtype=dtype, kernels=kernels, quantization=quantization,
                         fuse_projections=False)  # the checkpoint's layers, to inspect
    return load_model(config, registries)


def kernels_for(registries, backend):
    shapes = LlamaArchitecture().kernel_context(CONFIG)
    return bind_kernels(
        registries.kernels, dtype="float32", shapes=shapes, choices=dict.fromkeys(OPS, backend)
    )


@pytest.mark.parametrize("quant", ["f32", "q4_0"])
def test_kernel_backends_give_the_same_logits(tiny_paths, registries, quant):
    ids = mx.array([PROMPT])
    fast = load(tiny_paths[quant], registries, "mlx_fast")
    ref = load(tiny_paths[quant], registries, "reference")
    assert dict(ref.kernels.chosen) == dict.fromkeys(OPS, "reference")
    np.testing.assert_allclose(np.array(fast.model(ids)), np.array(ref.model(ids)), atol=1e-4)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_cached_chunks_match_one_full_pass(tiny_paths, registries, backend):
    loaded = load(tiny_paths["q8_0"], registries, backend)
    ids = mx.array([list(range(3, 270))])  # crosses the cache's 256-position step
    full = loaded.model(ids)
    cache = loaded.make_cache()
    assert len(cache) == 2 and all(isinstance(c, KVCache) for c in cache)
    pieces, start = [], 0
    for size in (100, 1, 155, 1, 10):
        pieces.append(loaded.model(ids[:, start : start + size], cache=cache))
        start += size
    assert cache[0].offset == ids.shape[1]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(full), atol=2e-4)


def test_quantized_files_become_quantized_modules(tiny_paths, registries):
    dense = load(tiny_paths["q4_0"], registries, quantization="dequantize").model
    assert not isinstance(dense.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    ids = mx.array([[3, 4, 5, 6]])
    model = load(tiny_paths["q4_0"], registries).model
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # Dequantizing is exact in float32: the same logits either way.
    np.testing.assert_allclose(np.array(dense(ids)), np.array(model(ids)), atol=1e-5)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    assert not isinstance(
        load(tiny_paths["f32"], registries).model.model.layers[0].mlp.up_proj, nn.QuantizedLinear
    )


def test_tiny_model_matches_llama_cpp(tiny_paths, registries):
    """An independent implementation on the same float32 file: checks the graph, the Q/K row
    un-permutation and the rotary layout at once (tokens from llama.cpp's own tokenizer)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        str(tiny_paths["f32"]), logits_all=True, n_ctx=64, n_threads=2, verbose=False
    )
    ids = llm.tokenize(
        b"<|im_start|>user\nthe weather in the west<|im_end|>\n", add_bos=False, special=True
    )
    llm.eval(ids)
    expected = np.array(llm.scores[: len(ids)])
    ours = np.array(load(tiny_paths["f32"], registries).model(mx.array([ids]))[0])
    np.testing.assert_allclose(ours, expected, atol=1e-2)


def test_config_is_tolerant_but_needs_the_shapes(registries):
    model = LlamaArchitecture().build(
        {**CONFIG, "unknown_key": 1, "torch_dtype": "bfloat16"},
        kernels_for(registries, "reference"),
    )
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)  # 2 kv heads x 16
    with pytest.raises(ModelLoadError, match="hidden_size"):
        LlamaArgs.from_config({k: v for k, v in CONFIG.items() if k != "hidden_size"})


def test_head_dim_bias_and_tied_embeddings_shape_the_parameters(registries):
    config = {
        **CONFIG,
        "head_dim": 32,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    }
    model = LlamaArchitecture().build(config, kernels_for(registries, "reference"))
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (128, 64) and attention.o_proj.weight.shape == (64, 128)
    assert "bias" in attention.q_proj and "bias" in model.model.layers[0].mlp.up_proj
    assert "lm_head" not in model
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 100)
    np.testing.assert_allclose(  # tied: logits are the embedding rows dotted with the final hidden state
        np.array(out),
        np.array(model.model(mx.array([[1, 2, 3]])) @ model.model.embed_tokens.weight.T),
        atol=1e-5,
    )


def test_sanitize_drops_rotary_tables_and_a_tied_head():
    weights = {
        "model.norm.weight": mx.ones(4),
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones(2),
        "lm_head.weight": mx.ones((2, 2)),
    }
    arch = LlamaArchitecture()
    assert set(arch.sanitize(weights, {**CONFIG, "tie_word_embeddings": True})) == {
        "model.norm.weight"
    }
    assert set(arch.sanitize(weights, CONFIG)) == {"model.norm.weight", "lm_head.weight"}


def llama_cpp_rope_factors(dims, base, factor, low, high, original):
    """llama.cpp's converter: per-frequency divisors written as ``rope_freqs.weight``."""
    factors = []
    for i in range(0, dims, 2):
        wavelength = 2 * math.pi * base ** (i / dims)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_llama3_rope_scaling_matches_the_stored_gguf_factors(registries):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    kernels = kernels_for(registries, "reference")
    config = {**CONFIG, "head_dim": 64, "rope_theta": 500000.0}
    from_hf = args_rotary(LlamaArgs.from_config({**config, "rope_scaling": scaling}), kernels, types=ROPE_TYPES)
    factors = llama_cpp_rope_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    from_gguf = args_rotary(LlamaArgs.from_config({**config, "rope_freq_factors": factors}), kernels, types=ROPE_TYPES)
    assert from_hf.base is None and from_hf.freqs is not None and from_gguf.freqs is not None
    np.testing.assert_allclose(np.array(from_hf.freqs), np.array(from_gguf.freqs), rtol=1e-5)
    plain = np.array(base_freqs(64, 500000.0))
    assert np.array(from_hf.freqs)[0] == pytest.approx(plain[0])  # short wavelengths kept
    assert np.array(from_hf.freqs)[-1] == pytest.approx(8.0 * plain[-1])  # long ones stretched


def test_linear_and_unknown_rope_scaling(registries):
    kernels = kernels_for(registries, "reference")
    linear = args_rotary(LlamaArgs.from_config({**CONFIG, "rope_scaling": {"type": "linear", "factor": 4.0}}), kernels, types=ROPE_TYPES)
    assert linear.scale == 0.25 and linear.freqs is None
    with pytest.raises(ModelLoadError, match="yarn"):
        args_rotary(LlamaArgs.from_config({**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), kernels, types=ROPE_TYPES)


def test_context_length_and_kernel_context():
    arch = LlamaArchitecture()
    assert arch.context_length({**CONFIG, "max_position_embeddings": 8192}) == 8192
    # A sliding window masks older positions (see test_mistral.py); it does not cap the context.
    assert (
        arch.context_length({**CONFIG, "max_position_embeddings": 32768, "sliding_window": 4096})
        == 32768
    )
    ctx = arch.kernel_context({**CONFIG, "partial_rotary_factor": 0.5})
    assert (
        ctx["head_dim"] == 16
        and ctx["n_heads"] == 4
        and ctx["n_kv_heads"] == 2
        and ctx["rope_dims"] == 8
    )


def test_mistral_uses_the_llama_graph(registries):
    assert registries.archs.get("mistral") is not None
    assert type(registries.archs.get("mistral")) is LlamaArchitecture
