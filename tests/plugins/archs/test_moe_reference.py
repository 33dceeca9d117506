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
from mlxr_core.testing.hf_reference import check_reference, family_reference, tiny_reference

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
        {"num_experts": 6, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
         "norm_topk_prob": False},
    ),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 6, "sliding_window": 12}),
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(request.param))


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


#: Hugging Face module -> llama.cpp tensor, as ``convert_hf_to_gguf`` names the MoE families.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
#: Per-expert projection (either family's name) -> llama.cpp's stacked tensor.
EXPERT_GGUF = {"gate_proj": "ffn_gate", "w1": "ffn_gate", "up_proj": "ffn_up", "w3": "ffn_up",
               "down_proj": "ffn_down", "w2": "ffn_down"}
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def write_moe_gguf(path, reference, *, stacked: bool = True, quant: str = "f32"):
    """The folder as llama.cpp's converter writes it: experts stacked (``ffn_gate_exps``) or, as
    older Mixtral files do, one tensor per expert (``ffn_gate.E``); a Mixtral as ``llama`` with its
    Q/K rows permuted for ggml's rotary layout."""
    from mlxr_core.testing.tiny import _permute_for_ggml, write_gguf
    from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

    config = reference.config
    arch = GGUF_ARCH[config["model_type"]]
    weights = SafetensorsFormat().load(reference.folder, dtype="float32").weights
    tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, array in weights.items():
        data = np.array(array, dtype=np.float32)
        if not name.startswith("model.layers."):
            tensors[TOP_NAMES[name]] = data
            continue
        _, _, index, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:
            expert, projection = module.split(".experts.")[1].split(".")
            experts.setdefault((index, EXPERT_GGUF[projection]), {})[int(expert)] = data
            continue
        target = GGUF_NAMES[module]
        if arch == "llama" and target in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if target == "attn_q" else config["num_key_value_heads"]
            data = _permute_for_ggml(data, heads)
        if target == "ffn_gate_inp_shexp":
            data = data[0]  # llama.cpp stores the shared expert's gate as a vector
        tensors[f"blk.{index}.{target}.{kind}"] = data
    for (index, target), rows in experts.items():
        if stacked:
            tensors[f"blk.{index}.{target}_exps.weight"] = np.stack([rows[e] for e in sorted(rows)])
        else:
            for e, data in rows.items():
                tensors[f"blk.{index}.{target}.{e}.weight"] = data
    metadata = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "rope.freq_base": float(config.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        "expert_count": config.get("num_experts") or config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
    }
    if config.get("head_dim"):
        metadata["attention.key_length"] = metadata["attention.value_length"] = config["head_dim"]
    if config.get("moe_intermediate_size"):
        metadata["expert_feed_forward_length"] = config["moe_intermediate_size"]
    if config.get("shared_expert_intermediate_size"):
        metadata["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    if config.get("sliding_window"):
        metadata["attention.sliding_window"] = config["sliding_window"]
    return write_gguf(path, arch, metadata, tensors, quant=quant)


@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_gguf_matches_transformers(reference, registries, tmp_path, layout):
    """llama.cpp's layout of the same weights (F32): the reference's logits to float rounding."""
    from mlxr_core.kernels import OPS
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

    if layout == "per-expert" and reference.config["model_type"] != "mixtral":
        pytest.skip("only Mixtral files were written with one tensor per expert")
    path = write_moe_gguf(tmp_path / "moe.gguf", reference, stacked=layout == "stacked")
    checkpoint = GGUFFormat().load(path)
    assert checkpoint.config["model_type"] == reference.config["model_type"]
    arch = registries.archs.get(checkpoint.config["model_type"])
    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.loader import build_model

    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config),
                           choices=dict.fromkeys(OPS, "mlx_fast"))
    model = build_model(checkpoint, arch, kernels, "dequantize", "float32")
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        got = np.array(model(mx.array([ids]))[0])
        assert np.abs(got - want).max() < 1e-4


def test_q8_0_gguf_experts_load_packed(reference, registries, tmp_path):
    """Q8_0 expert stacks repacked exactly into MLX 8-bit and kept packed (``quantization: keep``)."""
    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.loader import build_model
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

    checkpoint = GGUFFormat().load(write_moe_gguf(tmp_path / "moe-q8.gguf", reference, quant="q8_0"))
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config))
    model = build_model(checkpoint, arch, kernels, "keep", "float32")
    packed = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert packed and all(m.bits == 8 for m in packed)
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        got = np.array(model(mx.array([ids]))[0])
        assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()  # as with q8 above


def test_the_engine_serves_a_mixture_of_experts_batched_as_solo(reference, tmp_path):
    """Four concurrent greedy streams (continuous batching, the compiled decode step, a shared
    prefix from the prefix cache, chunked prefill) give each stream its solo tokens."""
    from mlxr_core.config.schema import Config, EngineConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], [*shared, 9, 8], reference.prompts[1], [7, 3]]

    def run(**engine):
        model = ModelConfig(path=str(reference.folder), name="moe", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            handles = [eng.submit(GenerationRequest(model="moe", prompt_ids=p, params=params)) for p in prompts]
            outputs = []
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs, bool(eng.model("moe").compiled_decode)
        finally:
            eng.stop()

    solo, _ = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    batched, compiled = run(max_batch_size=4, prefill_chunk=16)
    assert compiled
    assert [len(out) for out in solo] == [8] * 4
    assert batched == solo


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_reads_the_gguf_as_transformers_computes_it(family, tmp_path):
    """The stacked F32 file through llama.cpp (llama-cpp-python, CPU, keys and values cached in
    F32): transformers' logits, so the layout mlxr's reader undoes is the one llama.cpp reads.
    llama.cpp's graphs have no dense Qwen3-MoE layer and no Mixtral window, as the released
    models have none: the reference here is built without them."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not a test dependency")
    from test_hybrid_reference import with_spm_vocab

    model_class, config_class, extra = FAMILIES[family]
    shape = {**BASE, **{k: v for k, v in extra.items() if k not in ("mlp_only_layers", "sliding_window")}}
    reference = tiny_reference(model_class, config_class, shape, tmp_path / "hf")

    path = with_spm_vocab(write_moe_gguf(tmp_path / "moe.gguf", reference), reference.config["vocab_size"])
    ids = reference.prompts[1]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    np.testing.assert_allclose(np.array(llm.scores[: len(ids)]), reference.logits[1], atol=5e-3)
