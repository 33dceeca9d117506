"""Gemma 4 (text) from llama.cpp's GGUF files: the tiny transformers models of ``test_gemma4.py``
(``dense``: per-layer inputs, keys and values shared across layers, double-wide MLPs there;
``moe``: keys as values on the global layer with its own key/value head count, experts beside
the MLP) written as ``convert_hf_to_gguf`` writes Gemma 4, then loaded through mlxr's GGUF
format and loader and compared with transformers' logits (the tolerance of ``test_gemma4.py``).

What the writer does, as the converter's ``Gemma4Model`` (over ``Gemma3Model``) does it: norms
stored as they are (no ``+ 1``), tensor names from gguf's own map for the ``gemma4`` arch
(``layer_scalar`` and the experts' tensors with ``.weight`` appended, the router's ``scale`` as
``ffn_gate_inp.scale``, ``per_expert_scale`` as ``ffn_down_exps.scale``), the layer kinds as a
per-layer bool array, ``key_length`` the global head size and ``key_length_swa`` the sliding
one, per-layer arrays for the MLP widths (double-wide) and key/value heads (global ones), and a
``rope_freqs`` tensor encoding the global layers' ``proportional`` RoPE (1.0 for each rotated
pair, 1e30 for the rest). Q8_0 files keep the router and rows whose width is not a multiple of
32 out of the blocks (F32 and F16), as the converter does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_gemma4 import BASE, SHAPES, init

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import Reference, tiny_reference
from mlxr_core.testing.tiny import Quant
from mlxr_plugins.archs.gemma4_args import Gemma4Args
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

ATOL = 1e-4


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory) -> tuple[str, Reference]:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp(f"gemma4_gguf_{request.param}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = tiny_reference("Gemma4ForCausalLM", "Gemma4TextConfig", {**BASE, **SHAPES[request.param]}, folder, init=init)
    finally:
        torch.set_num_threads(threads)
    return request.param, built


def hub_config(shape: str, reference: Reference) -> dict[str, Any]:
    """The config the converter reads: the hub form (``global_head_dim``,
    ``num_global_key_value_heads``), over transformers' defaults."""
    return {**reference.config, **BASE, **SHAPES[shape]}


def gguf_name(name: str, names: Any) -> str:
    """``name`` as the converter's ``filter_tensors`` and ``modify_tensors`` leave it, then
    mapped by gguf's table."""
    if name.endswith("router.scale"):
        return f"blk.{name.split('.')[2]}.ffn_gate_inp.scale"
    if name.endswith("router.per_expert_scale"):
        return f"blk.{name.split('.')[2]}.ffn_down_exps.scale"
    if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
        name += ".weight"
    target = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert target is not None, name
    return str(target)


def write_gemma4_gguf(
    path: Path, shape: str, reference: Reference, quant: Quant = "f32", rope_freqs: Any = None, **overrides: Any
) -> Path:
    """The folder as ``convert_hf_to_gguf`` writes Gemma 4; ``overrides`` replace metadata,
    ``rope_freqs`` the converter's factors."""
    import gguf
    from safetensors.numpy import load_file

    from mlxr_core.testing.tiny import write_gguf

    config = hub_config(shape, reference)
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    tensors = {
        gguf_name(name, names): array
        for name, array in load_file(str(reference.folder / "model.safetensors")).items()
        if name != "lm_head.weight"  # tied
    }
    full, local = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    global_dim, head_dim = config["global_head_dim"], config["head_dim"]
    rotated = int(global_dim * full["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (global_dim // 2 - rotated)
    tensors["rope_freqs.weight"] = np.array(factors if rope_freqs is None else rope_freqs, dtype=np.float32)
    swa = [kind == "sliding_attention" for kind in config["layer_types"]]
    first_shared = layers - config["num_kv_shared_layers"]
    width = config["intermediate_size"]
    metadata: dict[str, Any] = {
        "block_count": layers,
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": [width if i < first_shared else 2 * width for i in range(layers)]
        if config.get("use_double_wide_mlp") else width,
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": [config["num_key_value_heads"] if s else config["num_global_key_value_heads"] for s in swa]
        if config.get("num_global_key_value_heads") is not None else config["num_key_value_heads"],
        "rope.freq_base": float(full["rope_theta"]),
        "rope.freq_base_swa": float(local["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.key_length": global_dim,
        "attention.value_length": global_dim,
        "attention.key_length_swa": head_dim,
        "attention.value_length_swa": head_dim,
        "final_logit_softcapping": float(config["final_logit_softcapping"]),
        "attention.sliding_window": config["sliding_window"],
        "attention.shared_kv_layers": config["num_kv_shared_layers"],
        "embedding_length_per_layer_input": config.get("hidden_size_per_layer_input") or 0,
        "attention.sliding_window_pattern": swa,
        "rope.dimension_count": global_dim,
        "rope.dimension_count_swa": int(head_dim * config.get("partial_rotary_factor", 1.0)),
    }
    if config.get("num_experts"):
        metadata.update({"expert_count": config["num_experts"], "expert_used_count": config["top_k_experts"],
                         "expert_feed_forward_length": config["moe_intermediate_size"]})
    metadata.update(overrides)
    # The converter keeps the router in F32 and falls back to F16 for rows that are no whole blocks.
    kept = {name: "f32" for name in tensors if ".ffn_gate_inp." in name}
    kept.update({name: "f16" for name, array in tensors.items() if quant != "f32" and array.shape[-1] % 32})
    return write_gguf(path, "gemma4", metadata, tensors, quant=quant, quants=kept)


def gguf_model(path: Path, registries: Any, policy: str) -> Any:
    from mlxr_core.kernels import OPS, bind_kernels
    from mlxr_core.model.loader import build_model

    checkpoint = GGUFFormat().load(path)
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config),
                           choices=dict.fromkeys(OPS, "mlx_fast"))
    return build_model(checkpoint, arch, kernels, policy, "float32")


def test_the_config_reads_back_as_transformers_has_it(reference, tmp_path):
    """Layer kinds, both head shapes, key/value sharing, per-layer inputs, double-wide MLPs, keys
    as values, experts and both RoPEs: the same per-layer facts as the folder's config."""
    shape, ref = reference
    checkpoint = GGUFFormat().load(write_gemma4_gguf(tmp_path / "g.gguf", shape, ref))
    config = checkpoint.config
    assert config["model_type"] == "gemma4" and "rope_freq_factors" not in config
    got, want = Gemma4Args.from_config(config), Gemma4Args.from_config(hub_config(shape, ref))
    layers = range(want.num_hidden_layers)
    assert [got.layer_shape(i) for i in layers] == [want.layer_shape(i) for i in layers]
    assert [got.kv_source(i) for i in layers] == [want.kv_source(i) for i in layers]
    for key in ("layer_types", "rope_parameters", "hidden_size_per_layer_input", "use_double_wide_mlp",
                "attention_k_eq_v", "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size",
                "final_logit_softcapping", "sliding_window", "intermediate_size", "tie_word_embeddings"):
        assert getattr(got, key) == getattr(want, key), key
    if want.hidden_size_per_layer_input:
        assert got.vocab_size_per_layer_input == want.vocab_size_per_layer_input


def test_gguf_matches_transformers(reference, registries, tmp_path):
    """The F32 file: one-pass logits of both prompts, and prefill of half a prompt then one token
    at a time (the shared layers reading their producers' cache), within the folder's tolerance
    of transformers."""
    shape, ref = reference
    model = gguf_model(write_gemma4_gguf(tmp_path / "g.gguf", shape, ref), registries, "keep")
    for ids, want in zip(ref.prompts, ref.logits, strict=True):
        got = np.array(model(mx.array([ids]))[0])
        np.testing.assert_allclose(got, want, atol=ATOL)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    ids, want = ref.prompts[0], ref.logits[0]
    half = len(ids) // 2
    cache = registries.archs.get("gemma4").make_cache(model)
    steps = [model(mx.array([ids[:half]]), cache=cache)]
    steps += [model(mx.array([[token]]), cache=cache) for token in ids[half:]]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)[0]), want, atol=ATOL)


def test_gguf_blocks_kept_packed_equal_them_dequantized(reference, registries, tmp_path):
    """Q8_0 blocks kept packed (the experts' gate|up tensor split with its scales) give the
    logits of the same blocks dequantized, and stay near transformers' float logits."""
    shape, ref = reference
    path = write_gemma4_gguf(tmp_path / "q.gguf", shape, ref, "q8_0")
    packed = gguf_model(path, registries, "keep")
    dense = gguf_model(path, registries, "dequantize")
    parameters = dict(tree_flatten(packed.parameters()))
    assert any(name.endswith("scales") for name in parameters)
    if shape == "moe":
        assert "model.layers.0.experts.gate_proj.scales" in parameters
    for ids, want in zip(ref.prompts, ref.logits, strict=True):
        got = np.array(packed(mx.array([ids]))[0])
        np.testing.assert_allclose(got, np.array(dense(mx.array([ids]))[0]), atol=ATOL)
        assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention.sliding_window_pattern": [True, False]}, "gemma4.attention.sliding_window_pattern"),
        ({"feed_forward_length": [48, 96, 48, 96, 48]}, "gemma4.feed_forward_length"),
        ({"attention.head_count_kv": [2, 1, 3, 2, 1]}, "gemma4.attention.head_count_kv"),
        ({"attention.key_length_swa": 0}, "gemma4.attention.key_length_swa"),
        ({"rope.dimension_count_swa": 8}, "gemma4.rope.dimension_count_swa"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("reference", ["dense"], indirect=True)
def test_bad_metadata_is_refused_naming_the_key(reference, tmp_path, overrides, message):
    shape, ref = reference
    path = write_gemma4_gguf(tmp_path / "bad.gguf", shape, ref, **overrides)
    with pytest.raises(ModelLoadError, match=message.replace(".", r"\.")):
        GGUFFormat().load(path)


@pytest.mark.parametrize("factors", [[1.0, 1e30, 1.0, 1e30] * 4, [1.0] * 4 + [1e30] * 4])
@pytest.mark.parametrize("reference", ["moe"], indirect=True)
def test_bad_rope_freqs_are_refused_naming_the_tensor(reference, tmp_path, factors):
    """Rotated pairs not first, or not one factor per pair of the global head size."""
    shape, ref = reference
    path = write_gemma4_gguf(tmp_path / "bad.gguf", shape, ref, rope_freqs=factors)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        GGUFFormat().load(path)


@pytest.mark.parametrize("reference", ["moe"], indirect=True)
def test_llama_cpp_reads_the_gguf_as_transformers_computes_it(reference, tmp_path):
    """The F32 file through llama.cpp (llama-cpp-python, CPU, keys and values cached in F32):
    transformers' logits, so the layout mlxr's reader undoes is the one llama.cpp reads. (The
    dense model, with per-layer inputs and shared keys and values, ends llama-cpp-python 0.3.36's
    process without a message when loaded: not compared.)"""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not a test dependency")
    from test_hybrid_reference import with_spm_vocab

    shape, ref = reference
    path = with_spm_vocab(write_gemma4_gguf(tmp_path / "g.gguf", shape, ref), hub_config(shape, ref)["vocab_size"])
    ids = ref.prompts[1]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    np.testing.assert_allclose(np.array(llm.scores[: len(ids)]), ref.logits[1], atol=5e-3)
