"""Gemma 3 (text): interleaved sliding-window and global attention, QK norm, GeGLU, four norms per
block, embeddings scaled by ``sqrt(hidden_size)``, per-layer RoPE bases, tied embeddings.

Weights use the Hugging Face names (``model.layers.N.pre_feedforward_layernorm.weight`` ...). RMS
norms hold ``w`` and scale by ``1 + w``, as in Hugging Face checkpoints; the GGUF format plugin
subtracts the 1 that llama.cpp's converter adds, so one graph serves both. Sliding-window layers
use ordinary caches and a window mask (see :mod:`mlxr_core.model.masks` for why).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.fuse import fuse_into, gate_and_up
from mlxr_plugins.archs.llama import (
    AttentionBlock,
    CausalLM,
    HeadNormedAttention,
    LlamaArgs,
    Rotary,
    final_hidden_states,
)

#: Hugging Face's default ``sliding_window_pattern``: every 6th layer attends globally.
GLOBAL_EVERY = 6


@dataclasses.dataclass
class Gemma3Args(LlamaArgs):
    """Gemma 3's config keys (Hugging Face names), defaulted as in ``Gemma3TextConfig``."""

    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    max_position_embeddings: int = 131_072
    sliding_window: int | None = 4096
    sliding_window_pattern: int = GLOBAL_EVERY
    #: Per layer ``"sliding_attention"`` or ``"full_attention"``; overrides the pattern when set.
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_logit_softcapping:
            # The attention kernels compute softmax(q k^T) with no cap; Gemma 2 used one, Gemma 3 does not.
            raise ModelLoadError("attn_logit_softcapping is not supported by the gemma3 graph")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise ModelLoadError(f"hidden_activation {self.hidden_activation!r} is not GeGLU")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Gemma3Args:
        """Build from a ``gemma3_text`` config, or a multimodal ``gemma3`` one's ``text_config``."""
        text = {**config, **config.get("text_config", {})}
        # transformers 5: {"full_attention": {rope_theta, scaling...}, "sliding_attention": {...}}.
        rope = text.get("rope_parameters")
        if isinstance(rope, dict) and "full_attention" in rope:
            full = dict(rope["full_attention"])
            text.setdefault("rope_theta", full.pop("rope_theta", cls.rope_theta))
            if full.get("rope_type", "default") != "default":
                text.setdefault("rope_scaling", full)
            local = rope.get("sliding_attention", {})
            text.setdefault(
                "rope_local_base_freq", local.get("rope_theta", cls.rope_local_base_freq)
            )
        args = super().from_config(text)
        assert isinstance(args, Gemma3Args)
        return args

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window (else over everything)."""
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return (layer + 1) % self.sliding_window_pattern != 0


class RMSNorm(nn.Module):
    """RMS norm scaling by ``1 + weight`` (Gemma's stored form)."""

    def __init__(self, dims: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self._rms_norm = kernels.rms_norm
        self._add_rms_norm = kernels.add_rms_norm

    def __call__(self, x: mx.array) -> mx.array:
        return self._rms_norm(x, 1.0 + self.weight, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """``h = x + residual`` and this norm of ``h`` (the ``add_rms_norm`` kernel)."""
        h, normed = self._add_rms_norm(x, residual, 1.0 + self.weight, self.eps)
        return h, normed


class Attention(HeadNormedAttention, nn.Module):
    def __init__(self, args: Gemma3Args, kernels: KernelSet, rotary: Rotary, window: int | None):
        super().__init__()
        assert args.head_dim is not None and args.num_key_value_heads is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        D, bias = args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(D, args.rms_norm_eps, kernels)
        self.window = window
        self._rotary = rotary
        self._attention = kernels.attention


class MLP(nn.Module):
    """GeGLU with the tanh approximation of GELU (``gelu_pytorch_tanh``)."""

    def __init__(self, args: Gemma3Args):
        super().__init__()
        hidden, inner = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = gate_and_up(self, x)
        return self.down_proj(nn.gelu_approx(gate) * up)

    def fuse_projections(self) -> bool:
        """Replace ``gate_proj`` and ``up_proj`` by one ``gate_up_proj``."""
        return fuse_into(self, "gate_up_proj", ("gate_proj", "up_proj"))


class TransformerBlock(AttentionBlock, nn.Module):
    """Pre- and post-norms around both attention and feed-forward (the post-norm before the residual)."""

    def __init__(self, args: Gemma3Args, kernels: KernelSet, rotary: Rotary, window: int | None):
        super().__init__()
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, kernels, rotary, window)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(dims, eps, kernels)
        self.post_attention_layernorm = RMSNorm(dims, eps, kernels)
        self.pre_feedforward_layernorm = RMSNorm(dims, eps, kernels)
        self.post_feedforward_layernorm = RMSNorm(dims, eps, kernels)

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """The block's output as ``(residual, delta)``, their sum unformed (see
        :meth:`AttentionBlock.add_attention_inputs`)."""
        attended = self.post_attention_layernorm(self.self_attn.output(out))
        h, normed = self.pre_feedforward_layernorm.add_and_norm(x, attended)
        delta: mx.array = self.post_feedforward_layernorm(self.mlp(normed))
        return h, delta


class Gemma3Model(nn.Module):
    def __init__(self, args: Gemma3Args, kernels: KernelSet):
        super().__init__()
        # Global layers: rope_theta and any rope_scaling; sliding ones: the local base, unscaled.
        global_rotary = Rotary(args, kernels)
        local_rotary = Rotary(
            dataclasses.replace(args, rope_theta=args.rope_local_base_freq, rope_scaling=None),
            kernels,
        )
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = []
        for index in range(args.num_hidden_layers):
            sliding = args.is_sliding(index) and args.sliding_window is not None
            rotary = local_rotary if sliding else global_rotary
            window = args.sliding_window if sliding else None
            self.layers.append(TransformerBlock(args, kernels, rotary, window))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.embed_scale = math.sqrt(args.hidden_size)

    def embed(self, inputs: mx.array) -> mx.array:
        """``[B, L]`` token ids -> ``[B, L, hidden]``, scaled by ``sqrt(hidden_size)``."""
        h = self.embed_tokens(inputs)
        return h * mx.array(self.embed_scale, dtype=h.dtype)

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None
    ) -> mx.array:
        h = self.embed(inputs)
        if mask is None and h.shape[1] > 1:
            mask = "causal"
        layer_caches = cache if cache is not None else [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
            h = layer(h, mask, layer_cache)
        return self.norm(h)


class Gemma3(CausalLM, nn.Module):
    """The whole model: ``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: Gemma3Args, kernels: KernelSet):
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args, kernels)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def lm_logits(self, h: mx.array) -> mx.array:
        """Logits from final (normed) hidden states, soft-capped when the config says so."""
        logits = super().lm_logits(h)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits


#: Gemma's turn format, as in the instruction-tuned checkpoints' ``tokenizer_config.json`` (text
#: parts only): a system message is prefixed to the first user turn, ``assistant`` is ``model``,
#: every turn ends with ``<end_of_turn>`` (a control token, so it ends generation).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

#: Prefixes of the multimodal ``gemma3`` checkpoints' language model -> the text model's names
#: (transformers < 4.52 and >= 4.52 layouts).
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
#: The image tower and projector of multimodal checkpoints: this graph is text-only.
VISION_PARTS = ("vision_tower", "multi_modal_projector")


class Gemma3Architecture:
    """The :class:`mlxr_core.model.arch.Architecture` of ``gemma3_text`` and (text only) ``gemma3``."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Gemma3(Gemma3Args.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Text-model names for multimodal checkpoints; drop the vision tower, rotary tables and,
        with tied embeddings, a redundant ``lm_head``."""
        tied = Gemma3Args.from_config(config).tie_word_embeddings
        out = {}
        for name, array in weights.items():
            if any(part in name for part in VISION_PARTS) or "rotary_emb.inv_freq" in name:
                continue
            for prefix, replacement in MULTIMODAL_PREFIXES.items():
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if tied and name.startswith("lm_head."):
                continue
            out[name] = array
        return out

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One full :class:`KVCache` per layer; window layers mask, they do not evict."""
        return [KVCache() for _ in model.layers]

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """``[B, L, hidden_size]`` after the final norm, before the LM head and soft-capping."""
        return final_hidden_states(model, inputs, cache)

    def default_chat_template(self, config: dict[str, Any]) -> str | None:
        """Gemma's turn format, for checkpoints without a template (the 270M GGUF's base model)."""
        return CHAT_TEMPLATE

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``: the global layers see all of it, the window layers mask."""
        return Gemma3Args.from_config(config).max_position_embeddings

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes kernels check: head dim, head counts, rotary dims and the mask kinds used."""
        args = Gemma3Args.from_config(config)
        return {
            "head_dim": args.head_dim,
            "n_heads": args.num_attention_heads,
            "n_kv_heads": args.num_key_value_heads,
            "rope_dims": args.rope_dims,
            "rope_traditional": args.rope_traditional,
            "masks": ("causal", "array"),
        }
