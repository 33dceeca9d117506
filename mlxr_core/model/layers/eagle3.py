"""An EAGLE-3 draft head (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): a separate small checkpoint
(``architectures: ["LlamaForCausalLMEagle3"]``) that drafts from the target's hidden states.

The target's residual stream entering three of its layers (low, middle, high: ``a_i, b_i, c_i``
at position ``i``; by default layers ``2``, ``n // 2`` and ``n - 3`` of ``n``) is fused, then one
Llama decoder layer whose attention reads ``2 H`` features runs over it with the embedding of the
token that follows, ``t_{i+1}``::

    x   = fc(concat(a_i, b_i, c_i))                                      # [3 H_target] -> [H]
    u   = concat(input_layernorm(embed(t_{i+1})), hidden_norm(x))        # [2 H]
    r   = x                    (hidden_norm(x) with norm_before_residual)
    h   = r + attn(u)          # q, k, v: [2 H] -> heads; o: heads -> [H]; the head's own cache
    g   = h + mlp(post_attention_layernorm(h))
    logits(t_{i+2}) = lm_head(norm(g))                                   # over the draft vocabulary

A draft id ``d`` is target id ``d + d2t[d]``. Chained for a longer draft, the next position
reads ``g`` (the layer's output before ``norm``) in place of ``x``, with the token just drafted
(vLLM's ``llama_eagle3.py`` and its proposer; the EAGLE repository's ``cnets.py``). The embedding
is the checkpoint's ``embed_tokens`` where it ships one, else the target's (unscaled) table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.layers.args import TransformerArgs
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mlp import GatedMLP
from mlxr_core.model.layers.norms import RMSNorm
from mlxr_core.model.layers.rope import args_rotary

#: The ``rope_scaling`` types EAGLE-3's Llama layer is trained with (as Llama's).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass
class Eagle3Args(TransformerArgs):
    """The draft's ``config.json`` (Llama keys, plus EAGLE-3's own)."""

    family = "EAGLE-3"
    computes = {**TransformerArgs.computes, "use_aux_hidden_state": (True,)}

    #: The draft vocabulary (``lm_head``'s rows); ``vocab_size`` is the target's.
    draft_vocab_size: int | None = None
    #: The target's hidden size, where it differs from the draft's (``fc`` reads 3 of them).
    target_hidden_size: int | None = None
    #: The first layer's residual is the normed fused state (else the fused state itself).
    norm_before_residual: bool = False
    #: SpecForge's and the speculators' nesting of the next key and ``use_aux_hidden_state``.
    eagle_config: dict[str, Any] | None = None
    #: The target layers whose inputs are fused (vLLM's indexing: ``i`` is the stream entering
    #: layer ``i``, the output of layer ``i - 1``).
    eagle_aux_hidden_state_layer_ids: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers != 1:
            raise ModelLoadError(
                f"num_hidden_layers = {self.num_hidden_layers}: an EAGLE-3 head here is one layer (midlayer.*)",
                key="num_hidden_layers",
            )
        nested = self.eagle_config or {}
        if nested.get("use_aux_hidden_state", True) is not True:
            raise ModelLoadError("an EAGLE-3 head without the target's auxiliary hidden states is not read",
                                 key="eagle_config.use_aux_hidden_state")  # fmt: skip

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs the head fuses, in the order ``fc`` reads them: the
        config's, else ``(2, n // 2, n - 3)`` (vLLM's and the EAGLE repository's default)."""
        key = "eagle_aux_hidden_state_layer_ids"
        chosen = self.eagle_aux_hidden_state_layer_ids or (self.eagle_config or {}).get(key)
        if chosen is None:
            chosen, key = [2, target_layers // 2, target_layers - 3], "the default layers"
        layers = tuple(sorted({int(index) for index in chosen}))
        if len(layers) != 3 or not all(0 <= index < target_layers for index in layers):
            raise ModelLoadError(
                f"{key} {list(chosen)}: EAGLE-3 fuses three distinct layers of the target's {target_layers} "
                f"(0 .. {target_layers - 1})",
                key="eagle_aux_hidden_state_layer_ids",
            )
        return layers

    @property
    def fused_width(self) -> int:
        """``fc``'s input: three of the target's hidden states."""
        return 3 * (self.target_hidden_size or self.hidden_size)


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: a Llama decoder layer over ``concat(embedding, hidden)``."""

    def __init__(self, args: Eagle3Args, kernels: KernelSet):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(
            2 * H,
            args.num_attention_heads,
            args.kv_heads,
            args.dims,
            kernels=kernels,
            rotary=args_rotary(args, kernels, types=ROPE_TYPES),
            qkv_bias=args.attention_bias,
            out_bias=args.attention_bias,
        )
        self.self_attn.o_proj = nn.Linear(args.num_attention_heads * args.dims, H, bias=args.attention_bias)
        self.mlp = GatedMLP(H, args.intermediate_size, bias=args.mlp_bias)
        self.input_layernorm = RMSNorm(H, eps, kernels)
        self.hidden_norm = RMSNorm(H, eps, kernels)
        self.post_attention_layernorm = RMSNorm(H, eps, kernels)
        self.norm_before_residual = args.norm_before_residual

    def __call__(self, embeddings: mx.array, hidden: mx.array, mask: str | mx.array | None, cache: Any) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        u = mx.concatenate([self.input_layernorm(embeddings), normed], axis=-1)
        h = residual + self.self_attn(u, mask, cache)
        out: mx.array = h + self.mlp(self.post_attention_layernorm(h))
        return out


class Eagle3Head(nn.Module):
    """The draft head: ``fc``, ``midlayer``, ``norm``, ``lm_head`` and, where the checkpoint has
    one, ``embed_tokens``. :attr:`targets` maps draft ids to target ids (``d2t`` applied)."""

    def __init__(self, args: Eagle3Args, kernels: KernelSet, *, own_embedding: bool):
        super().__init__()
        H = args.hidden_size
        self.draft_vocab = args.draft_vocab_size or args.vocab_size
        self.vocab = args.vocab_size
        self.fc = nn.Linear(args.fused_width, H, bias=False)
        self.midlayer = Eagle3Layer(args, kernels)
        self.norm = RMSNorm(H, args.rms_norm_eps, kernels)
        self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        # Not parameters (a leading underscore): the id maps, set by :meth:`map_vocabulary`.
        self._targets = mx.arange(self.draft_vocab, dtype=mx.int32)
        self._columns: mx.array | None = None

    @property
    def targets(self) -> mx.array:
        """Draft id -> target id (``[draft_vocab]``)."""
        return self._targets

    def map_vocabulary(self, d2t: mx.array | None) -> None:
        """Read the checkpoint's ``d2t`` (target id = draft id + ``d2t[draft id]``; None: the
        identity, the draft vocabulary being the target's). Raises ModelLoadError naming ``d2t``
        for offsets that leave the target's vocabulary or send two draft ids to one target id."""
        if d2t is None:
            if self.draft_vocab != self.vocab:
                raise ModelLoadError(f"the draft vocabulary ({self.draft_vocab}) differs from the target's "
                                     f"({self.vocab}) and no d2t maps it", key="d2t")  # fmt: skip
            return
        if d2t.shape != (self.draft_vocab,):
            raise ModelLoadError(f"d2t has shape {tuple(d2t.shape)}, the draft vocabulary {self.draft_vocab}", key="d2t")
        targets = mx.arange(self.draft_vocab, dtype=mx.int64) + d2t.astype(mx.int64)
        ids: list[int] = targets.tolist()  # type: ignore[assignment]
        if min(ids) < 0 or max(ids) >= self.vocab or len(set(ids)) != len(ids):
            raise ModelLoadError(f"d2t sends draft ids outside the target's {self.vocab} ids or two to one", key="d2t")
        self._targets = targets.astype(mx.int32)
        columns = mx.full((self.vocab,), self.draft_vocab, dtype=mx.int32)
        columns[self._targets] = mx.arange(self.draft_vocab, dtype=mx.int32)
        self._columns = columns

    def embed(self, target: nn.Module, tokens: mx.array) -> mx.array:
        """Embeddings of target ids ``tokens``: the head's table, else the target's (unscaled)."""
        table = self.embed_tokens if "embed_tokens" in self else target.model.embed_tokens
        embedded: mx.array = table(tokens)
        return embedded

    def __call__(
        self, embeddings: mx.array, hidden: mx.array, cache: Any, mask: str | mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """``embeddings`` of ``t_{i+1}`` and ``hidden`` (``fc``'s output, or a chained ``g``),
        ``[B, L, H]`` each -> ``(norm(g), g)``: what the LM head reads, and what a chained step reads."""
        if mask is None and hidden.shape[1] > 1:
            mask = "causal"
        g = self.midlayer(embeddings, hidden, mask, cache)
        normed: mx.array = self.norm(g)
        return normed, g

    def widen(self, logits: mx.array) -> mx.array:
        """Draft-vocabulary logits ``[n, draft_vocab]`` as the target's ``[n, vocab]`` (``-inf``
        at target ids no draft id maps to)."""
        if self._columns is None:
            return logits
        padded = mx.concatenate([logits, mx.full((logits.shape[0], 1), -mx.inf, dtype=logits.dtype)], axis=-1)
        return mx.take(padded, self._columns, axis=-1)

    def make_cache(self) -> KVCache:
        return KVCache()
