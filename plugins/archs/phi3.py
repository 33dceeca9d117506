"""Phi-3 (and Phi-3.5, Phi-4-mini): the Llama graph with fused projections and LongRoPE.

What differs from Llama: queries, keys and values come from one matrix (``qkv_proj``) and the
gate and up projections from another (``gate_up_proj``, gate first), as in the Hugging Face
checkpoints and in llama.cpp's ``attn_qkv`` / ``ffn_up``; the rotary embedding may cover only part
of each head (``partial_rotary_factor``) and may be LongRoPE-scaled (``rope_scaling`` of type
``longrope``, or ``su`` in older configs); a ``sliding_window``, when set, limits every layer.

LongRoPE has two sets of frequency factors: transformers uses the short ones while a sequence is
within ``original_max_position_embeddings`` and switches the whole sequence to the long ones past
it, re-encoding every cached key. A KV cache cannot follow that switch, so this graph uses the short
factors (exactly transformers' behaviour within that length) and reports that length as the
model's context.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.fuse import gate_and_up, swiglu
from mlxr_plugins.archs import llama
from mlxr_plugins.archs.llama import LlamaArchitecture, LlamaArgs, Rotary, base_freqs

#: ``rope_scaling`` types of this graph: plain, linear and LongRoPE (``su`` is its older name).
LONGROPE = ("longrope", "su")
#: Activations of the gated MLP this graph computes (SwiGLU).
ACTIVATIONS = ("silu", "swish")


@dataclasses.dataclass
class Phi3Args(LlamaArgs):
    """Llama's config keys with Phi-3's defaults, plus its LongRoPE and activation keys."""

    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"phi3: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.attention_bias or self.mlp_bias:
            raise ModelLoadError("phi3: biased projections are not supported")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Phi3Args:
        """Build from a checkpoint config; transformers 5 keeps ``partial_rotary_factor`` and
        ``original_max_position_embeddings`` inside the rope parameters."""
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        config = dict(config)
        for key in ("partial_rotary_factor", "original_max_position_embeddings"):
            if key not in config and key in scaling:
                config[key] = scaling[key]
        args = super().from_config(config)
        assert isinstance(args, Phi3Args)
        return args

    @property
    def rope_kind(self) -> str:
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def longrope_original(self) -> int:
        """The pre-training length LongRoPE extends (the context this graph serves with it)."""
        scaling = self.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings")
        return int(original or self.original_max_position_embeddings or self.max_position_embeddings)


class LongRoPE:
    """LongRoPE with its short factors: per-frequency divisors of the periods, and the rotated
    features scaled by the attention factor (transformers scales ``cos`` and ``sin`` by it)."""

    def __init__(self, args: Phi3Args, kernels: KernelSet):
        scaling = args.rope_scaling or {}
        self.rope = kernels.rope
        self.dims = args.rope_dims
        short = scaling.get("short_factor")
        if not isinstance(short, list) or len(short) != self.dims // 2:
            raise ModelLoadError(
                f"phi3: longrope short_factor must list {self.dims // 2} numbers "
                f"(rotary dims / 2), got {short!r:.80}"
            )
        self.freqs = mx.array(short, dtype=mx.float32) * base_freqs(self.dims, args.rope_theta)
        original = args.longrope_original
        factor = scaling.get("factor") or args.max_position_embeddings / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        self.attention_factor = float(attention_factor)

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        rotated = self.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs
        )
        if self.attention_factor == 1.0:
            return rotated
        factor = mx.array(self.attention_factor, dtype=x.dtype)
        if self.dims == x.shape[-1]:
            return rotated * factor
        head, tail = rotated[..., : self.dims], rotated[..., self.dims :]
        return mx.concatenate([head * factor, tail], axis=-1)


def make_rotary(args: Phi3Args, kernels: KernelSet) -> Rotary | LongRoPE:
    """The rotary embedding the config asks for, or a ModelLoadError naming what is unsupported."""
    if args.rope_kind in LONGROPE:
        return LongRoPE(args, kernels)
    if args.rope_kind not in ("default", "linear"):
        raise ModelLoadError(
            f"phi3: rope_scaling type {args.rope_kind!r} is not supported (default, linear, longrope)"
        )
    return Rotary(args, kernels)


class Attention(llama.CachedAttention, nn.Module):
    def __init__(
        self,
        args: Phi3Args,
        kernels: KernelSet,
        rotary: Rotary | LongRoPE,
        window: int | None,
    ):
        super().__init__()
        assert args.head_dim is not None and args.num_key_value_heads is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = D = args.head_dim
        self.scale = D**-0.5
        qkv_dims = (self.n_heads + 2 * self.n_kv_heads) * D
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_dims, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, args.hidden_size, bias=False)
        self.window = window
        self._rotary = rotary
        self._attention = kernels.attention


class MLP(nn.Module):
    """SwiGLU from one fused projection: the first half is the gate, the second the up branch."""

    def __init__(self, args: Phi3Args):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*gate_and_up(self, x)))


class Phi3(llama.Llama):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``: Llama with Phi-3's modules."""

    def __init__(self, args: Phi3Args, kernels: KernelSet):
        # Llama's attention and MLP are replaced below (their lazy weights were never evaluated);
        # its rotary, built on the way, must not see a LongRoPE it does not know.
        super().__init__(dataclasses.replace(args, rope_scaling=None), kernels)
        self.args = args
        rotary = make_rotary(args, kernels)
        window = args.sliding_window or None
        for layer in self.layers:
            layer.self_attn = Attention(args, kernels, rotary, window)  # type: ignore[assignment]
            layer.mlp = MLP(args)  # type: ignore[assignment]


class Phi3Architecture(LlamaArchitecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``phi3``; caches and sanitizing are Llama's."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return Phi3(Phi3Args.from_config(config), kernels)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings``, or with LongRoPE the length its short factors serve."""
        args = Phi3Args.from_config(config)
        if args.rope_kind in LONGROPE:
            return min(args.max_position_embeddings, args.longrope_original)
        return args.max_position_embeddings

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Llama's shapes, from Phi-3's config handling (rotary dims inside the rope parameters)."""
        args = Phi3Args.from_config(config)
        return {
            "head_dim": args.head_dim,
            "n_heads": args.num_attention_heads,
            "n_kv_heads": args.num_key_value_heads,
            "rope_dims": args.rope_dims,
            "rope_traditional": args.rope_traditional,
            "masks": ("causal", "array"),
        }
