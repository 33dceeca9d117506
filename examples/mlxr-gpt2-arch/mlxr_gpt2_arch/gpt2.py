"""GPT-2: learned absolute positions, pre-norm LayerNorms with bias, fused QKV, GELU MLP, tied head.

Weights keep the Hugging Face names (``transformer.h.N.attn.c_attn.weight`` ...). Hugging Face
stores GPT-2's projections as ``Conv1D`` weights, ``[in, out]``; :meth:`GPT2Architecture.sanitize`
transposes them to the ``[out, in]`` of ``nn.Linear``. Attention goes through the bound
:class:`KernelSet`; the norms are ``nn.LayerNorm`` (the ``rms_norm`` kernel does not apply).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.plugin_api import KernelSet, KVCache, ModelLoadError

#: Projections Hugging Face stores as ``Conv1D`` (``[in, out]``).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclasses.dataclass
class GPT2Args:
    """The config keys this graph reads (Hugging Face names); every other key is ignored."""

    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_positions: int = 1024
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPT2Args:
        """Build from a checkpoint config, ignoring keys this graph does not use."""
        fields = {field.name: field for field in dataclasses.fields(cls)}
        known = {key: value for key, value in config.items() if key in fields}
        missing = [
            name
            for name, field in fields.items()
            if field.default is dataclasses.MISSING and name not in known
        ]
        if missing:
            raise ModelLoadError(f"the gpt2 config lacks {', '.join(missing)}")
        args = cls(**known)
        if args.n_embd % args.n_head:
            raise ModelLoadError(f"gpt2: n_embd {args.n_embd} is not a multiple of n_head {args.n_head}")
        return args

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def activation(name: str) -> Any:
    """The MLP activation named by ``activation_function``."""
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.gelu_approx
    if name == "gelu":
        return nn.gelu
    if name == "relu":
        return nn.relu
    raise ModelLoadError(f"gpt2: activation_function {name!r} is not supported (gelu_new, gelu, relu)")


class Attention(nn.Module):
    def __init__(self, args: GPT2Args, kernels: KernelSet):
        super().__init__()
        self.n_heads = args.n_head
        self.scale = args.head_dim**-0.5
        self.c_attn = nn.Linear(args.n_embd, 3 * args.n_embd)
        self.c_proj = nn.Linear(args.n_embd, args.n_embd)
        self._attention = kernels.attention

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = mx.split(self.c_attn(x), 3, axis=-1)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = self._attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.c_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        inner = args.n_inner or 4 * args.n_embd
        self.c_fc = nn.Linear(args.n_embd, inner)
        self.c_proj = nn.Linear(inner, args.n_embd)
        self._act = activation(args.activation_function)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(self._act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, args: GPT2Args, kernels: KernelSet):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.attn = Attention(args, kernels)
        self.ln_2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        h = x + self.attn(self.ln_1(x), mask, cache)
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, args: GPT2Args, kernels: KernelSet):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.n_positions, args.n_embd)
        self.h = [Block(args, kernels) for _ in range(args.n_layer)]
        self.ln_f = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None
    ) -> mx.array:
        L = inputs.shape[1]
        # Positions start where the cache ends; a left-padded batch cache gives one offset per row.
        offset = cache[0].offset if cache is not None else 0
        positions = mx.arange(L)[None] + (offset[:, None] if isinstance(offset, mx.array) else offset)
        h = self.wte(inputs) + self.wpe(positions)
        if mask is None and L > 1:
            mask = "causal"
        layer_caches = cache if cache is not None else [None] * len(self.h)
        for block, layer_cache in zip(self.h, layer_caches, strict=True):
            h = block(h, mask, layer_cache)
        return self.ln_f(h)


class GPT2(nn.Module):
    """The whole model: ``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""

    def __init__(self, args: GPT2Args, kernels: KernelSet):
        super().__init__()
        self.args = args
        self.transformer = GPT2Model(args, kernels)

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, mask: str | mx.array | None = None
    ) -> mx.array:
        # The head is tied to the token embedding (GPT-2 has no separate lm_head).
        return self.transformer.wte.as_linear(self.transformer(inputs, cache, mask))

    @property
    def layers(self) -> list[Block]:
        return self.transformer.h


class GPT2Architecture:
    """The :class:`mlxr_core.model.arch.Architecture` of ``gpt2``."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the graph from a tolerant config dict."""
        return GPT2(GPT2Args.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Add the ``transformer.`` prefix some exports drop, drop the causal-mask buffers and the
        tied ``lm_head``, and transpose ``Conv1D`` weights to ``nn.Linear``'s ``[out, in]``."""
        sanitized = {}
        for name, array in weights.items():
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"
            if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if name.endswith(CONV1D_WEIGHTS):
                array = array.T
            sanitized[name] = array
        return sanitized

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One :class:`KVCache` per layer."""
        return [KVCache() for _ in model.layers]

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """``[B, L, n_embd]`` after the final LayerNorm, before the tied head (for embeddings)."""
        hidden: mx.array = model.transformer(inputs, cache)
        return hidden

    def context_length(self, config: dict[str, Any]) -> int:
        """``n_positions``: the learned position table has no rows beyond it."""
        return GPT2Args.from_config(config).n_positions

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shapes kernels check: multi-head attention without rotary embeddings."""
        args = GPT2Args.from_config(config)
        return {
            "head_dim": args.head_dim,
            "n_heads": args.n_head,
            "n_kv_heads": args.n_head,
            "rope_dims": 0,
            "rope_traditional": False,
            "masks": ("causal", "array"),
        }
