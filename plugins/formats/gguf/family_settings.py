"""What each llama.cpp architecture's GGUF says in its own way, read into Hugging Face config
keys and weights: a function per family, each a column of a row of the table in
:mod:`~mlxr_plugins.formats.gguf.arch_settings`.

A settings function takes the config read so far (the keys every family shares), the file's
tensors by name and ``get`` (a metadata key under ``{arch}.``, or its default) and returns the
keys it adds or replaces; a weights function fixes, in place, what llama.cpp's converter did to
the family's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.args import TransformerArgs, check_value
from mlxr_plugins.formats.gguf.reader import ReadTensors

#: The config read so far; the file's tensors by name; ``get(key, default=None)``: the value of
#: metadata key ``{arch}.{key}``.
Config = dict[str, Any]
Tensors = dict[str, Any]
Getter = Callable[..., Any]


def gemma3_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """What a Gemma 3 GGUF does not carry and depends on its size, as llama.cpp hard-codes it
    (``llama-model.cpp``): queries scaled by ``head_dim ** -0.5`` (all sizes but 27B, whose
    ``query_pre_attn_scalar`` is ``hidden / heads``), no logit soft-capping."""
    head_dim = config.get("head_dim", 256)
    scalar = head_dim
    if config.get("num_hidden_layers") == 62 and config.get("hidden_size") == 5376:  # 27B
        scalar = config["hidden_size"] // (config.get("num_attention_heads") or 1)
    return {
        "query_pre_attn_scalar": scalar,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


#: Gemma 4's config keys -> the ``gemma4.*`` metadata key each comes from (overriding
#: :data:`~mlxr_plugins.formats.gguf.arch_settings.METADATA_KEYS` where llama.cpp stores them differently: ``key_length`` is the global
#: layers' head size, ``key_length_swa`` the sliding ones').
GEMMA4_KEYS = {
    "head_dim": "attention.key_length_swa",
    "global_head_dim": "attention.key_length",
    "num_global_key_value_heads": "attention.head_count_kv",
    "num_kv_shared_layers": "attention.shared_kv_layers",
    "hidden_size_per_layer_input": "embedding_length_per_layer_input",
    "layer_types": "attention.sliding_window_pattern",
    "final_logit_softcapping": "final_logit_softcapping",
    "use_double_wide_mlp": "feed_forward_length",
    "top_k_experts": "expert_used_count",
}
#: A ``rope_freqs`` factor at least this large stops its pair rotating (llama.cpp writes 1e30).
UNROTATED = 1e20


def gemma4_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """Gemma 4's config in ``Gemma4TextConfig``'s hub form, from what ``convert_hf_to_gguf`` writes:
    the layer kinds as a per-layer bool array (true: sliding), both head sizes, key/value heads
    and MLP widths that may be per-layer arrays (global layers' heads, double-wide MLPs on the
    shared layers), the shared layers and per-layer input width, both rope bases, and the global
    layers' ``proportional`` RoPE as ``rope_freqs``: 1.0 for each rotated pair, 1e30 for the rest."""
    limits = TransformerArgs.limits
    layers = config.get("num_hidden_layers") or 0

    def read(name: str, hint: Any, limit: Any = None, default: Any = None) -> Any:
        value = get(name)
        return default if value is None else check_value(f"gemma4.{name}", value, hint, limit)

    def refuse(detail: str, name: str) -> ModelLoadError:
        return ModelLoadError(detail, key=f"gemma4.{name}")

    settings: dict[str, Any] = {}
    pattern = read("attention.sliding_window_pattern", list[bool])
    if pattern is not None:
        if len(pattern) != layers:
            raise refuse(f"{len(pattern)} layer kinds for {layers} layers", "attention.sliding_window_pattern")
        settings["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        sliding = pattern
    else:  # Hugging Face's default: every sixth layer global, and the last
        sliding = [bool((i + 1) % 6) and i < layers - 1 for i in range(layers)]
    shared = read("attention.shared_kv_layers", int, (0, layers), 0)
    settings["num_kv_shared_layers"] = shared
    first_shared = layers - shared

    global_dim = config.get("head_dim")  # attention.key_length
    settings["global_head_dim"] = global_dim
    head_dim = read("attention.key_length_swa", int, limits["head_dim"], global_dim)
    settings["head_dim"] = head_dim

    heads = config.get("num_attention_heads")
    kv = get("attention.head_count_kv")
    if isinstance(kv, list):
        kv = read("attention.head_count_kv", list[int], limits["num_key_value_heads"])
        local = {n for n, s in zip(kv, sliding, strict=False) if s}
        full = {n for n, s in zip(kv, sliding, strict=False) if not s}
        if len(kv) != layers or len(local) > 1 or len(full) > 1:
            raise refuse(
                f"{kv}: expected {layers} key/value head counts, one for the sliding layers and "
                "one for the global ones",
                "attention.head_count_kv",
            )
        for count in kv:
            if heads and heads % count:
                raise refuse(
                    f"{count} key/value heads do not divide the {heads} attention heads",
                    "attention.head_count_kv",
                )
        settings["num_key_value_heads"] = min(local) if local else min(full)
        if full:
            settings["num_global_key_value_heads"] = min(full)

    widths = get("feed_forward_length")
    if isinstance(widths, list):
        widths = read("feed_forward_length", list[int], limits["intermediate_size"])
        width = widths[0] if widths else 0
        doubled = [width if i < first_shared else 2 * width for i in range(layers)]
        if widths not in (doubled, [width] * layers):
            raise refuse(
                f"{widths}: expected {layers} MLP widths, {width} before the shared layers and "
                f"{width} or {2 * width} from layer {first_shared}",
                "feed_forward_length",
            )
        settings["intermediate_size"] = width
        settings["use_double_wide_mlp"] = widths == doubled and shared > 0

    table = tensors.get("per_layer_token_embd.weight")
    inferred = int(table.shape[0]) // layers if table is not None and layers else 0
    settings["hidden_size_per_layer_input"] = read(
        "embedding_length_per_layer_input", int, (0, 1 << 14), inferred
    )
    if table is not None:
        settings["vocab_size_per_layer_input"] = int(table.shape[-1])  # ggml: [L * P, vocab]
    settings["final_logit_softcapping"] = read(
        "final_logit_softcapping", float, limits["final_logit_softcapping"]
    )

    swa_dims = read("rope.dimension_count_swa", int, (0, 1 << 14))
    if swa_dims is not None and head_dim and swa_dims != head_dim:
        raise refuse(
            f"{swa_dims} rotary dimensions on sliding layers of head size {head_dim}: partial "
            "RoPE on sliding layers is not supported by the gemma4 graph",
            "rope.dimension_count_swa",
        )
    factor = 1.0
    factors = tensors.get("rope_freqs.weight")
    if factors is not None and global_dim:
        stored = np.asarray(factors.data, dtype=np.float32).reshape(-1)
        rotated = int((stored == 1.0).sum())
        if (
            stored.size != global_dim // 2
            or not (stored[:rotated] == 1.0).all()
            or not (stored[rotated:] >= UNROTATED).all()
        ):
            raise ModelLoadError(
                f"expected {global_dim // 2} factors (the global head size's pairs): 1.0 for each "
                "rotated pair, then 1e30 for each unrotated one",
                tensor="rope_freqs.weight",
            )
        factor = 2 * rotated / global_dim
    elif global_dim:
        dims = read("rope.dimension_count", int, (0, 1 << 14), global_dim)
        factor = dims / global_dim
    theta = limits["rope_theta"]
    settings["rope_parameters"] = {
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": read("rope.freq_base_swa", float, theta, 10_000.0),
        },
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": factor,
            "rope_theta": read("rope.freq_base", float, theta, 1_000_000.0),
        },
    }

    # Keys as values: a global layer with its own keys but no value projection.
    settings["attention_k_eq_v"] = any(
        f"blk.{i}.attn_k.weight" in tensors and f"blk.{i}.attn_v.weight" not in tensors
        for i in range(min(first_shared, len(sliding)))
        if not sliding[i]
    )
    experts = get("expert_count")
    if experts:
        settings.update(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"),
        )
    return settings


def gemma4_weights(read: ReadTensors, config: Config) -> None:
    """Split, in place, each ``experts.gate_up_proj`` (``ffn_gate_up_exps``: ``[E, 2I, H]``, gate
    rows first) into the stacked gate and up projections, packed or not, and the tables keyed by
    module name that follow them (quantization, suggested quantization, source types)."""
    weights = read.weights
    modules: tuple[dict[str, Any], ...] = (read.quantization, read.suggested, read.source_types)
    for module in [n.removesuffix(".weight") for n in weights if n.endswith(".experts.gate_up_proj.weight")]:
        stem = module.removesuffix("gate_up_proj")
        for part in ("weight", "scales", "biases"):
            array = weights.pop(f"{module}.{part}", None)
            if array is None:
                continue
            if array.ndim != 3 or array.shape[1] % 2:
                raise ModelLoadError(
                    f"shape {list(array.shape)}: expected [experts, 2 * width, ...]",
                    tensor=f"blk.{module.split('.')[2]}.ffn_gate_up_exps.weight",
                )
            gate, up = mx.split(array, 2, axis=1)
            weights[f"{stem}gate_proj.{part}"], weights[f"{stem}up_proj.{part}"] = gate, up
        for table in modules:
            if module in table:
                table[f"{stem}gate_proj"] = table[f"{stem}up_proj"] = table.pop(module)


def phi3_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """Phi-3's LongRoPE, stored by ``convert_hf_to_gguf`` as the ``rope_factors_long`` and
    ``rope_factors_short`` tensors, ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor``, back in the Hugging Face ``rope_scaling`` form."""
    settings: dict[str, Any] = {}
    original = get("rope.scaling.original_context_length")
    if original:
        settings["original_max_position_embeddings"] = original
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in np.asarray(long.data, dtype=np.float32)],
            "short_factor": [float(f) for f in np.asarray(short.data, dtype=np.float32)],
            "original_max_position_embeddings": original or config["max_position_embeddings"],
        }
        attn_factor = get("rope.scaling.attn_factor")
        if attn_factor:
            scaling["attention_factor"] = attn_factor
        settings["rope_scaling"] = scaling
    return settings


def qwen2moe_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """Qwen2-MoE's attention bias, which its Hugging Face config names ``qkv_bias``."""
    return {"qkv_bias": "blk.0.attn_q.bias" in tensors}


def gpt_oss_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """gpt-oss's keys (served as ``gpt_oss``): the experts, and YaRN as Hugging Face
    computes it for these checkpoints (``truncate: false``; llama.cpp always truncates the
    correction range). The sliding layers are the even ones, as Hugging Face's default and
    llama.cpp's hard-coded pattern agree."""
    settings: dict[str, Any] = {
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
    }
    width = get("expert_feed_forward_length")
    if width:
        settings["intermediate_size"] = width
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn":
        settings["rope_scaling"] = {
            **scaling,
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        }
    return settings


def hybrid_settings(
    config: Config, tensors: Tensors, get: Getter, *, tiled_values: bool, dense: bool
) -> dict[str, Any]:
    """The Qwen hybrids' keys from llama.cpp's ``ssm.*`` metadata (``state_size`` is a key head's
    size, ``group_count`` the key heads, ``time_step_rank`` the value heads, ``inner_size`` all
    value heads' width), the layer pattern, and the file's layout of DeltaNet's projections:
    Qwen3-Next's split like Qwen3.5's (``linear_attn_layout``), and with ``tiled_values``
    (Qwen3.5) the value heads in llama.cpp's tiled order when key heads are fewer
    (``linear_value_order``); a ``dense`` one has no experts. Multi-token prediction blocks
    (``nextn_predict_layers``) are not part of the decoder."""
    value_heads = get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    key_heads = get("ssm.group_count")
    settings: dict[str, Any] = {
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads if inner and value_heads else None,
        "full_attention_interval": get("full_attention_interval"),
        "linear_attn_layout": "split",
        "norm_topk_prob": True,
    }
    if tiled_values and key_heads and value_heads and key_heads != value_heads:
        settings["linear_value_order"] = "tiled"
    extra = get("nextn_predict_layers") or 0
    if isinstance(extra, int) and 0 < extra < (config.get("num_hidden_layers") or 0):
        settings["num_hidden_layers"] = config["num_hidden_layers"] - extra
    if dense:
        settings["num_experts"] = 0
    return settings


def hybrid_weights(read: ReadTensors, config: Config) -> None:
    """Undo, in place, what llama.cpp's converter did to the hybrids' DeltaNet tensors: ``ssm_a``
    holds ``-exp(A_log)``, the conv weight lost its middle axis, and Qwen3-Next's b and a
    projections are one matrix whose rows run ``[b (r rows), a (r rows)]`` per key head (split
    here, packed or not, with the packing)."""
    weights, quantization = read.weights, read.quantization
    for name in [n for n in weights if n.endswith("linear_attn.A_log")]:
        weights[name] = mx.log(-weights[name].astype(mx.float32))
    for name in [n for n in weights if n.endswith("linear_attn.conv1d.weight")]:
        if weights[name].ndim == 2:
            weights[name] = weights[name][:, None, :]  # [C, K] -> Hugging Face's [C, 1, K]
    for name in [n for n in weights if n.endswith("linear_attn.dt_bias.bias")]:
        weights[name.removesuffix(".bias")] = weights.pop(name)
    key_heads = int(config.get("linear_num_key_heads") or 1)
    r = int(config.get("linear_num_value_heads") or key_heads) // key_heads
    for module in [n.removesuffix(".weight") for n in weights if n.endswith("linear_attn.in_proj_ba.weight")]:
        stem = module.removesuffix("in_proj_ba")
        for part in ("weight", "scales", "biases"):
            array = weights.pop(f"{module}.{part}", None)
            if array is None:
                continue
            grouped = array.reshape(key_heads, 2 * r, *array.shape[1:])
            weights[f"{stem}in_proj_b.{part}"] = grouped[:, :r].reshape(key_heads * r, *array.shape[1:])
            weights[f"{stem}in_proj_a.{part}"] = grouped[:, r:].reshape(key_heads * r, *array.shape[1:])
        spec = quantization.pop(module, None)
        if spec is not None:
            quantization[f"{stem}in_proj_b"] = quantization[f"{stem}in_proj_a"] = spec


def qwen2vl_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """llama.cpp's ``qwen2vl``, the language model of Qwen2-VL and Qwen2.5-VL alike (the same
    graph; their projectors differ): Qwen2 with M-RoPE over ``rope.dimension_sections`` (served as
    ``qwen2_5_vl``)."""
    return {"rope_scaling": mrope_scaling(get, "qwen2vl")}


def mrope_scaling(get: Getter, arch: str) -> dict[str, Any]:
    """M-RoPE's (time, height, width) sections from ``rope.dimension_sections`` (llama.cpp pads
    them to four), as transformers' ``rope_scaling``."""
    sections = get("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) < 3 or not all(type(s) is int and s >= 0 for s in sections):
        raise ModelLoadError(f"{sections!r}: expected the M-RoPE sections (time, height, width, ...)",
                             key=f"{arch}.rope.dimension_sections")
    return {"type": "mrope", "mrope_section": sections[:3]}


def qwen3vl_settings(config: Config, tensors: Tensors, get: Getter) -> dict[str, Any]:
    """llama.cpp's ``qwen3vl``: Qwen3 with interleaved M-RoPE over ``rope.dimension_sections``
    (served as ``qwen3_vl``, always interleaved). ``n_deepstack_layers``, where the file has it, is
    kept to check the mmproj's DeepStack layers against."""
    settings: dict[str, Any] = {"rope_scaling": mrope_scaling(get, "qwen3vl")}
    deepstack = get("n_deepstack_layers")
    if deepstack is not None:
        if type(deepstack) is not int or deepstack < 0:
            raise ModelLoadError(f"{deepstack!r}: expected a count of layers", key="qwen3vl.n_deepstack_layers")
        settings["num_deepstack_layers"] = deepstack
    return settings
