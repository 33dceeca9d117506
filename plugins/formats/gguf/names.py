"""llama.cpp's tensor names -> Hugging Face's, as tables: the names every architecture shares,
and per architecture (llama.cpp's ``general.architecture``) the names it spells otherwise.

A new family whose tensors llama.cpp names as another's adds nothing here; one with tensors of its
own adds a row to :data:`ARCH_BLOCK_NAMES` (and where needed :data:`ARCH_PARAMETER_NAMES`,
:data:`ARCH_TOP_NAMES`).
"""

from __future__ import annotations

#: llama.cpp block tensor names -> Hugging Face module names under ``model.layers.N``.
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Mixtures of experts: the router, the experts stacked ``[experts, out, in]``, a shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
#: Mixtral files older than llama.cpp's stacked experts hold one tensor per expert
#: (``blk.N.ffn_gate.E.weight``); the architecture stacks them.
PER_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: The Qwen hybrids (Gated DeltaNet and gated attention): ``attn_qkv``/``attn_gate`` are DeltaNet's
#: q|k|v and z projections, ``ssm_*`` the rest of it; ``ssm_ba`` is Qwen3-Next's b|a projection
#: (grouped by key head, split by :func:`~mlxr_plugins.formats.gguf.family_settings.hybrid_weights`),
#: ``ssm_beta``/``ssm_alpha`` Qwen3.5's.
HYBRID_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
#: Per-architecture overrides of :data:`BLOCK_NAMES`, a row per llama.cpp architecture.
ARCH_BLOCK_NAMES = {
    # Gemma's blocks have four norms: llama.cpp's ``ffn_norm`` is the norm before the
    # feed-forward, ``post_*`` the ones after each sub-layer.
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    # Gemma 4: Gemma 3's four norms, the experts' own norms, the per-layer input's gate,
    # projection and norm, the router (its ``.scale`` and the down experts' ``.scale`` are the
    # router's scales: :data:`ARCH_PARAMETER_NAMES`), and the experts with gate and up in one tensor.
    "gemma4": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "ffn_gate_inp": "router.proj",
        "ffn_gate_up_exps": "experts.gate_up_proj",
        "ffn_gate_exps": "experts.gate_proj",
        "ffn_up_exps": "experts.up_proj",
        "ffn_down_exps": "experts.down_proj",
    },
    # Phi-3 keeps Hugging Face's fused projections: q, k, v in one matrix, gate and up in ``ffn_up``.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: the norm before the experts, the attention sinks (``.weight`` appended; the
    # architecture drops it), and newer files' gate and up experts in one tensor.
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",
    },
    "qwen3next": HYBRID_BLOCK_NAMES,
    "qwen35": HYBRID_BLOCK_NAMES,
    "qwen35moe": HYBRID_BLOCK_NAMES,
}
#: Per-architecture block tensors (``blk.N.<name>``) that are a module's parameter other than
#: ``weight`` in Hugging Face naming: llama.cpp appended ``.weight`` or renamed the parameter.
ARCH_PARAMETER_NAMES = {
    "gemma4": {
        "layer_output_scale.weight": "layer_scalar",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
    },
}
#: Per-architecture top-level tensors beside :data:`TOP_NAMES` (Gemma 4's per-layer inputs).
ARCH_TOP_NAMES = {
    "gemma4": {
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm",
    },
}

#: Tensors that are not module weights: llama3 and LongRoPE factors go to the config, the rest is
#: derived.
NOT_WEIGHTS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
    "attn_rot_embd",
)


def hf_name(name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name to its Hugging Face name; unknown names pass through."""
    if name.startswith("blk.") and name.count(".") == 2:  # a parameter without a suffix (ssm_a)
        _, index, rest = name.split(".")
        mapped = ARCH_BLOCK_NAMES.get(arch, {}).get(rest)
        return f"model.layers.{index}.{mapped}" if mapped else name
    module, _, kind = name.rpartition(".")
    if module.startswith("blk."):
        _, index, rest = module.split(".", 2)
        parameter = ARCH_PARAMETER_NAMES.get(arch, {}).get(f"{rest}.{kind}")
        if parameter:
            return f"model.layers.{index}.{parameter}"
        base, _, expert = rest.partition(".")
        if expert.isdigit() and base in PER_EXPERT_NAMES:
            return f"model.layers.{index}.mlp.experts.{expert}.{PER_EXPERT_NAMES[base]}.{kind}"
        mapped = ARCH_BLOCK_NAMES.get(arch, {}).get(rest) or BLOCK_NAMES.get(rest)
        return f"model.layers.{index}.{mapped}.{kind}" if mapped else name
    mapped = TOP_NAMES.get(module) or ARCH_TOP_NAMES.get(arch, {}).get(module)
    return f"{mapped}.{kind}" if mapped else name
