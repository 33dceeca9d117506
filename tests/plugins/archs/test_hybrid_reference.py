"""The hybrid linear-attention families against transformers on tiny random weights: Qwen3-Next
(fused DeltaNet projections, sparse experts with a gated shared expert, one dense layer),
Qwen3.5 (separate projections, dense MLPs) and Qwen3.5-MoE (every layer sparse).

Each folder is written by transformers, loaded through mlxr's safetensors format and loader, and
compared on logits, cached decoding over more steps than the convolution's window, a left-padded
batch of rows of different lengths and a prefix-cache hit
(:func:`mlxr_core.testing.hf_reference.check_reference`), on the ``reference`` kernels and the fast
ones. Then what is particular to recurrent state: the prefix cache reuses only a whole stored
prefix and counts the partial match it passed over; the drafting decoders refuse the model; the
engine serves concurrent streams as solo. And the layouts users have: the released checkpoints'
(Qwen3.5's ``text_config``, ``model.language_model.*``, fused experts), mlx-lm's converted
folders (norms stored as ``1 + weight``) and llama.cpp's GGUF files (as its converter writes them:
``ssm_*`` tensors, Qwen3.5's value heads tiled, F32 and Q8_0 kept packed).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.errors import ConfigError
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.testing.hf_reference import (
    check_reference,
    family_reference,
    load_reference_model,
    tiny_reference,
)

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}
MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
#: transformers' own two forms of the recurrence (one pass: chunked; token by token: the loop)
#: differ by up to 1.3e-4 on these weights (float32, logits of magnitude ~4), in spikes at a few
#: positions rather than growing along the sequence: the tolerance is several times that, and
#: every check also asks for transformers' argmax.
ATOL = 1e-3
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {**MOE, "mlp_only_layers": [2]}),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", MOE),
}


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)


def test_the_prefix_cache_reuses_only_a_whole_recurrent_prefix(reference, registries):
    """A stored 24-token prefix serves a prompt that extends it; a prompt that shares only its
    first 20 tokens cannot resume the state taken at 24: a miss, counted as a partial match."""
    loaded = load_reference_model(reference, registries)
    model, ids = loaded.model, reference.prompts[0]
    cache = loaded.make_cache()
    assert any(isinstance(layer, RecurrentCache) for layer in cache)
    model(mx.array([ids[:24]]), cache=cache)
    prefix = PrefixCache(max_bytes=1 << 24)
    prefix.store(ids[:24], cache)

    reused, caches = prefix.lookup(ids, limit=len(ids) - 1, make_cache=loaded.make_cache)
    assert reused == 24 and caches is not None
    np.testing.assert_allclose(
        np.array(model(mx.array([ids[24:]]), cache=caches)[0]), reference.logits[0][24:], atol=ATOL
    )

    diverging = ids[:20] + [(token + 1) % 97 for token in ids[20:]]
    reused, caches = prefix.lookup(diverging, limit=len(diverging) - 1, make_cache=loaded.make_cache)
    assert (reused, caches) == (0, None)
    assert prefix.stats.partial_unusable == 1 and prefix.stats.hits == 1


def test_drafting_decoders_refuse_recurrent_state(reference, registries):
    from mlxr_plugins.decoders.drafting import check_trimmable

    loaded = load_reference_model(reference, registries)
    with pytest.raises(ConfigError, match="RecurrentCache"):
        check_trimmable(loaded.make_cache(), "prompt_lookup", "hybrid")


def test_the_engine_serves_it_batched_as_solo(reference):
    """Four concurrent greedy streams (continuous batching with recurrent rows joining and
    leaving, chunked prefill, a one-token prompt, a prompt extending a cached one) give each
    stream its solo tokens; the extension is served from the prefix cache."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], reference.prompts[1], [7], [*shared, 5, 9, 8]]

    def run(**engine: Any) -> tuple[list[list[int]], Any]:
        model = ModelConfig(path=str(reference.folder), name="hybrid", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            outputs = []
            handles = [eng.submit(GenerationRequest(model="hybrid", prompt_ids=p, params=params)) for p in prompts[:3]]
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            events = list(eng.submit(GenerationRequest(model="hybrid", prompt_ids=prompts[3], params=params)))
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs, eng.stats().get("prefix_cache", {}).get("hybrid")
        finally:
            eng.stop()

    solo, _ = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    batched, stats = run(max_batch_size=4, prefill_chunk=16)
    assert [len(out) for out in solo] == [8] * 4
    assert batched == solo
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= 24


def released_layout(reference: Any, folder: Any) -> None:
    """Rewrite ``reference``'s folder into ``folder`` as the released checkpoints and mlx-lm
    0.32 read them: rope keys at the top, the layer pattern as ``full_attention_interval``; for
    Qwen3.5 the text model nested in the vision-language layout, its experts fused
    (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((reference.folder / "config.json").read_text())
    rope = config["rope_parameters"]
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], full_attention_interval=2)
    weights = load_file(str(reference.folder / "model.safetensors"))
    family = config["model_type"].removesuffix("_text")
    if family != "qwen3_next":
        config = {"model_type": family, "text_config": config, "tie_word_embeddings": False}
        fused: dict[str, np.ndarray] = {}
        for name, array in weights.items():
            if ".experts." not in name:
                fused["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = array
        for layer in range(BASE["num_hidden_layers"]) if family == "qwen3_5_moe" else ():
            stem = f"model.layers.{layer}.mlp.experts"
            experts = range(MOE["num_experts"])
            gate_up = [np.concatenate([weights[f"{stem}.{e}.gate_proj.weight"], weights[f"{stem}.{e}.up_proj.weight"]]) for e in experts]
            fused[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(gate_up)
            fused[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = np.stack([weights[f"{stem}.{e}.down_proj.weight"] for e in experts])
        weights = fused
    folder.mkdir(exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((reference.folder / name).read_bytes())


def test_released_and_mlx_lm_folders_load(reference, registries, tmp_path):
    """The released layout loads as it is; mlx-lm loads it too, and the folder mlx-lm then writes
    (conv weights moved, norms holding ``1 + weight``, experts stacked) loads in mlxr: both
    within tolerance of transformers."""
    released = tmp_path / "released"
    released_layout(reference, released)
    rows = [(released, None)]
    if importlib.util.find_spec("mlx_lm") is not None:
        from mlx_lm.utils import load_model, save_config, save_model

        model, config = load_model(released)
        converted = tmp_path / "mlx-lm"
        converted.mkdir()
        save_model(converted, model)
        save_config(config, converted / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (converted / name).write_bytes((released / name).read_bytes())
        rows.append((converted, np.array(model(mx.array([reference.prompts[1]]))[0])))
    for folder, peer in rows:
        moved = type(reference)(folder, reference.prompts, reference.logits, {})
        got = np.array(load_reference_model(moved, registries).model(mx.array([reference.prompts[1]]))[0])
        np.testing.assert_allclose(got, reference.logits[1], atol=ATOL, err_msg=str(folder))
        if peer is not None:  # mlx-lm's own graph on the same folder agrees with transformers too
            np.testing.assert_allclose(peer, reference.logits[1], atol=ATOL)


GGUF_ARCH = {"qwen3_next": "QWEN3NEXT", "qwen3_5_text": "QWEN35", "qwen3_5_moe_text": "QWEN35MOE"}


def tiled(array: np.ndarray, axis: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """Value heads moved from Hugging Face's grouped order to llama.cpp's tiled one along
    ``axis`` (its converter's reordering for Qwen3.5 when key heads are fewer)."""
    shape = list(array.shape)
    split = [*shape[:axis], key_heads, per_key, size, *shape[axis + 1:]]
    return np.swapaxes(array.reshape(split), axis, axis + 1).reshape(shape)


def write_hybrid_gguf(path: Any, reference: Any, quant: str = "f32") -> Any:
    """The folder as llama.cpp's converter writes it (its tensor names from gguf's own map):
    ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, conv weights squeezed, norms but
    DeltaNet's stored as ``1 + w``, Qwen3-Next's q|k|v|z projection split into ``attn_qkv`` and
    ``attn_gate``, Qwen3.5's value heads tiled, experts stacked, the shared expert's gate a vector."""
    import gguf

    from mlxr_core.testing.tiny import write_gguf

    config = reference.config
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[config["model_type"]])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    from safetensors.numpy import load_file

    weights = load_file(str(reference.folder / "model.safetensors"))
    Hk, Hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    Dk, Dv, r = config["linear_key_head_dim"], config["linear_value_head_dim"], Hv // Hk
    reorder = config["model_type"] != "qwen3_next" and Hk != Hv
    tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, data in weights.items():
        if ".experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, projection, _ = rest.split(".")
            experts.setdefault((int(layer.split(".")[2]), projection), {})[int(expert)] = data
            continue
        if reorder and ".linear_attn." in name:
            if "in_proj_qkv" in name:
                data = np.concatenate([data[: 2 * Hk * Dk], tiled(data[2 * Hk * Dk:], 0, Hk, r, Dv)])
            elif "in_proj_z" in name or "out_proj" in name:
                data = tiled(data, 1 if "out_proj" in name else 0, Hk, r, Dv)
            elif "in_proj_b" in name or "in_proj_a" in name or "A_log" in name or "dt_bias" in name:
                data = tiled(data, 0, Hk, r, 1)
            elif "conv1d" in name:
                data = np.concatenate([data[: 2 * Hk * Dk], tiled(data[2 * Hk * Dk:], 0, Hk, r, Dv)])
        if name.endswith("A_log"):
            data = -np.exp(data)
        if name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        if "conv1d" in name:
            data = data.reshape(data.shape[0], data.shape[-1])
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            data = data + 1.0
        if name.endswith("shared_expert_gate.weight"):
            data = data[0]
        if "in_proj_qkvz" in name:  # [q, k, v, z] per key head -> q|k|v of all heads, and z
            grouped = data.reshape(Hk, 2 * Dk + 2 * r * Dv, -1)
            q, k, v, z = np.split(grouped, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=1)
            flat = [part.reshape(-1, data.shape[1]) for part in (q, k, v, z)]
            layer = int(name.split(".")[2])
            tensors[names.get_name(f"model.layers.{layer}.linear_attn.in_proj_qkv") + ".weight"] = np.concatenate(flat[:3])
            tensors[names.get_name(f"model.layers.{layer}.linear_attn.in_proj_z") + ".weight"] = flat[3]
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None and ".mlp." in name:  # Qwen3-Next's dense layer of this test: llama.cpp's names
            layer, projection = name.split(".")[2], name.split(".")[4]
            target = f"blk.{layer}.ffn_{projection.removesuffix('_proj')}.weight"
        assert target is not None, name
        tensors[target] = data
    for (layer, projection), rows in experts.items():
        tensors[f"blk.{layer}.ffn_{projection.removesuffix('_proj')}_exps.weight"] = np.stack([rows[e] for e in sorted(rows)])
    head_dim = config["head_dim"]
    metadata: dict[str, Any] = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config.get("intermediate_size") or 1,
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "rope.freq_base": float(config["rope_parameters"]["rope_theta"]),
        "rope.dimension_count": int(head_dim * config["rope_parameters"]["partial_rotary_factor"]),
        "ssm.conv_kernel": config["linear_conv_kernel_dim"],
        "ssm.state_size": Dk,
        "ssm.group_count": Hk,
        "ssm.time_step_rank": Hv,
        "ssm.inner_size": Dv * Hv,
        "full_attention_interval": 2,
    }
    if config["model_type"] != "qwen3_next":
        # M-RoPE's sections over the rotated pairs, interleaved t, h, w (Qwen3.5's [11, 11, 10] for
        # 32 pairs): text has one position on all three, so only covering every pair matters.
        pairs = metadata["rope.dimension_count"] // 2
        metadata["rope.dimension_sections"] = [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0]
    if config.get("num_experts"):
        metadata.update({"expert_count": config["num_experts"], "expert_used_count": config["num_experts_per_tok"],
                         "expert_feed_forward_length": config["moe_intermediate_size"],
                         "expert_shared_feed_forward_length": config["shared_expert_intermediate_size"]})
    small = {name: "f32" for name, array in tensors.items() if array.shape[-1] % 32}  # conv weights: F32, as llama.cpp keeps them
    return write_gguf(path, gguf.MODEL_ARCH_NAMES[arch], metadata, tensors, quant=quant, quants=small)


def gguf_model(path: Any, registries: Any, policy: str) -> Any:
    from mlxr_core.kernels import OPS, bind_kernels
    from mlxr_core.model.loader import build_model
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

    checkpoint = GGUFFormat().load(path)
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config),
                           choices=dict.fromkeys(OPS, "mlx_fast"))
    return checkpoint.config, build_model(checkpoint, arch, kernels, policy, "float32")


def test_gguf_matches_transformers(reference, registries, tmp_path):
    """llama.cpp's layout of the same weights (F32): transformers' logits within the tolerance."""
    config, model = gguf_model(write_hybrid_gguf(tmp_path / "hybrid.gguf", reference), registries, "keep")
    assert config["model_type"] == reference.config["model_type"].removesuffix("_text")
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), want, atol=ATOL)


def test_gguf_blocks_kept_packed_equal_them_dequantized(reference, registries, tmp_path):
    """Q8_0 blocks kept packed (Qwen3-Next's b|a matrix split with its scales) give the logits of
    the same blocks dequantized. (Against transformers 8-bit weights are far off on these O(1)
    random weights: mlxr's own q8 of the folder moves Qwen3-Next's logits by up to 5.8.)"""
    path = write_hybrid_gguf(tmp_path / "hybrid.gguf", reference, "q8_0")
    _, packed = gguf_model(path, registries, "keep")
    _, dense = gguf_model(path, registries, "dequantize")
    assert any(name.endswith("scales") for name, _ in tree_flatten(packed.parameters()))
    for ids in reference.prompts:
        np.testing.assert_allclose(np.array(packed(mx.array([ids]))[0]), np.array(dense(mx.array([ids]))[0]), atol=ATOL)


def with_spm_vocab(path: Any, vocab_size: int) -> Any:
    """``path`` with a SentencePiece vocabulary of ``vocab_size`` tokens (``<unk>``, ``<s>``,
    ``</s>``, then ``t3`` ...), the least llama.cpp needs to load a model."""
    from mlxr_core.testing.loader_fuzz import rewrite_gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, vocab_size))]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * vocab_size,
        "tokenizer.ggml.token_type": [2, 3, 3, *([1] * (vocab_size - 3))],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return rewrite_gguf(path, path.with_name(path.stem + "-vocab.gguf"), metadata)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_reads_the_gguf_as_transformers_computes_it(family, tmp_path):
    """The file through llama.cpp (llama-cpp-python, CPU) gives transformers' logits, so the
    layout the reader undoes is the one llama.cpp reads. llama.cpp's graphs take value heads as
    wide as key heads and every Qwen3-Next layer sparse, as the released models have them: the
    reference here is built so."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not a test dependency")
    model_class, config_class, extra = FAMILIES[family]
    shape = {**BASE, **extra, "linear_value_head_dim": BASE["linear_key_head_dim"], "mlp_only_layers": []}
    reference = tiny_reference(model_class, config_class, shape, tmp_path / "hf")
    path = with_spm_vocab(write_hybrid_gguf(tmp_path / "hybrid.gguf", reference), reference.config["vocab_size"])
    ids = reference.prompts[1]
    # Keys and values in F32 (llama.cpp caches them in F16 by default).
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])
    np.testing.assert_allclose(got, reference.logits[1], atol=ATOL * 5)
