"""Mistral's sliding window, against transformers' ``MistralForCausalLM`` on tiny random weights.

The window (5 positions) is much shorter than the 24-token sequences, so logits that ignored it
would differ by far more than the tolerance. The same weights are checked through a Hugging Face
folder and through a GGUF (llama.cpp's ``llama`` architecture with ``attention.sliding_window``),
one full pass, cached decoding, the engine's batch path and a prefix-cache hit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.cache import BatchKVCache
from mlxr_core.model.loader import build_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture
from mlxr_core.testing.tiny import write_gguf
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
from mlxr_plugins.formats.gguf.quants import permute_rows
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

WINDOW = 5
SHAPE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "sliding_window": WINDOW,
}
ATOL = 1e-4
#: Hugging Face module -> llama.cpp tensor (``convert_hf_to_gguf``'s llama map).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """A saved tiny ``MistralForCausalLM``, its prompts and its eager-attention logits."""
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(**SHAPE, attn_implementation="eager")
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():  # O(1) logits: the default init's 0.02 std gives near-zero ones
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SHAPE["vocab_size"], n).tolist() for n in (24, 17)]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]
        unwindowed = transformers.MistralForCausalLM(
            transformers.MistralConfig(**{**SHAPE, "sliding_window": None})
        )
        unwindowed.load_state_dict(model.state_dict())
        full_attention = unwindowed(torch.tensor([prompts[0]])).logits[0].numpy()
    return {
        "folder": folder,
        "prompts": prompts,
        "logits": logits,
        "full_attention": full_attention,
    }


def write_mistral_gguf(path: Path, folder: Path, quant: str = "f32") -> Path:
    """The folder as llama.cpp's converter writes a Mistral: ``llama`` arch, Q/K rows permuted."""
    weights = SafetensorsFormat().load(folder, dtype="float32").weights
    heads = {"attn_q": SHAPE["num_attention_heads"], "attn_k": SHAPE["num_key_value_heads"]}
    tensors = {}
    for name, array in weights.items():
        data = np.array(array, dtype=np.float32)
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            target = GGUF_NAMES[module]
            if target in heads:
                data = permute_rows(data, heads[target])
            tensors[f"blk.{index}.{target}.{kind}"] = data
        else:
            tensors[TOP_NAMES[name]] = data
    metadata = {
        "block_count": SHAPE["num_hidden_layers"],
        "context_length": SHAPE["max_position_embeddings"],
        "embedding_length": SHAPE["hidden_size"],
        "feed_forward_length": SHAPE["intermediate_size"],
        "attention.head_count": SHAPE["num_attention_heads"],
        "attention.head_count_kv": SHAPE["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": SHAPE["rms_norm_eps"],
        "attention.sliding_window": WINDOW,
        "rope.dimension_count": SHAPE["head_dim"],
        "rope.freq_base": 10000.0,
    }
    return write_gguf(path, "llama", metadata, tensors, quant=quant)  # type: ignore[arg-type]


def build(checkpoint: Any, registries: Any, backend: str = "mlx_fast") -> tuple[Any, Any]:
    config = checkpoint.config
    arch = registries.archs.get(config["model_type"])
    kernels = bind_kernels(
        registries.kernels,
        dtype="float32",
        shapes=arch.kernel_context(config),
        choices=dict.fromkeys(OPS, backend),
    )
    return build_model(checkpoint, arch, kernels, "dequantize", "float32"), arch


def test_the_window_matters_for_these_prompts(reference):
    """Guard against a vacuous comparison: attending to everything gives other logits."""
    difference = np.abs(reference["full_attention"] - reference["logits"][0]).max()
    assert difference > 100 * ATOL


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_folder_logits_match_transformers(reference, registries, backend):
    model, _ = build(SafetensorsFormat().load(reference["folder"]), registries, backend)
    assert model.args.sliding_window == WINDOW
    for ids, expected in zip(reference["prompts"], reference["logits"], strict=True):
        np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), expected, atol=ATOL)


def test_gguf_logits_match_transformers(reference, registries, tmp_path):
    checkpoint = GGUFFormat().load(write_mistral_gguf(tmp_path / "m.gguf", reference["folder"]))
    assert checkpoint.config["model_type"] == "llama"
    assert checkpoint.config["sliding_window"] == WINDOW
    model, _ = build(checkpoint, registries)
    for ids, expected in zip(reference["prompts"], reference["logits"], strict=True):
        np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), expected, atol=ATOL)


def test_cached_decoding_past_the_window_matches_transformers(reference, registries):
    """Prefill 7 tokens, then one at a time: the cache grows far past the window."""
    model, arch = build(SafetensorsFormat().load(reference["folder"]), registries)
    ids, expected = reference["prompts"][0], reference["logits"][0]
    cache = arch.make_cache(model)
    steps = [model(mx.array([ids[:7]]), cache=cache)]
    steps += [model(mx.array([[token]]), cache=cache) for token in ids[7:]]
    assert cache[0].offset == len(ids) > 4 * WINDOW
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)[0]), expected, atol=ATOL)


def test_batched_decode_matches_transformers(reference, registries):
    """Both rows prefilled alone, joined with left padding, decoded together as the engine does."""
    model, arch = build(SafetensorsFormat().load(reference["folder"]), registries)
    prompts, expected = reference["prompts"], reference["logits"]
    prefill = [13, 6]  # then decode the rest of the shorter one's tokens, both rows at once
    rows = []
    for ids, n in zip(prompts, prefill, strict=True):
        cache = arch.make_cache(model)
        model(mx.array([ids[:n]]), cache=cache)
        rows.append([BatchKVCache.from_cache(layer) for layer in cache])
    batch = rows[0]
    for layer, other in zip(batch, rows[1], strict=True):
        layer.extend(other)
    for step in range(len(prompts[1]) - prefill[1]):
        tokens = mx.array([[ids[n + step]] for ids, n in zip(prompts, prefill, strict=True)])
        out = np.array(model(tokens, cache=batch, mask=batch[0].mask())[:, -1])
        for row, n in enumerate(prefill):
            np.testing.assert_allclose(out[row], expected[row][n + step], atol=ATOL)


def test_a_prefix_cache_hit_continues_correctly(reference, registries):
    """A stored 16-token prefix (longer than the window) reused by the same prompt."""
    model, arch = build(SafetensorsFormat().load(reference["folder"]), registries)
    ids, expected = reference["prompts"][0], reference["logits"][0]
    prefix = PrefixCache(max_bytes=1 << 20)
    cache = arch.make_cache(model)
    model(mx.array([ids[:16]]), cache=cache)
    prefix.store(ids[:16], cache)
    reused, caches = prefix.lookup(ids, limit=len(ids) - 1, make_cache=lambda: arch.make_cache(model))
    assert reused == 16 and caches is not None
    rest = np.array(model(mx.array([ids[16:]]), cache=caches)[0])
    np.testing.assert_allclose(rest, expected[16:], atol=ATOL)


def test_mistral_conforms_with_a_window(registries):
    """The shared check, with a window (4) shorter than its sequences."""
    arch = registries.archs.get("mistral")
    config = {**TINY_CONFIG, "model_type": "mistral"}
    assert config["sliding_window"] < 6
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
    check_architecture(arch, config, kernels)


def test_the_window_does_not_cap_the_context(registries):
    arch = registries.archs.get("mistral")
    assert arch.context_length({**SHAPE, "max_position_embeddings": 32768}) == 32768
