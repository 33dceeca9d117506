"""A DFlash block drafter (z-lab, 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036): a separate small checkpoint (``architectures:
["DFlashDraftModel"]``, Qwen3 decoder layers) that drafts a whole block of tokens in one
forward pass from the target's hidden states.

The target's outputs of layers ``l_1 .. l_m`` (``dflash_config.target_layer_ids``; Hugging Face's
``hidden_states[l + 1]``, here the residual stream entering layer ``l + 1``) at each position
``i`` the target has verified are fused into a context state::

    c_i = hidden_norm(fc(concat(h^{l_1}_i, ..., h^{l_m}_i)))                  # [m H_target] -> [H]

Every draft layer keeps the context's keys and values (``k_norm(k_proj(c_i))`` rotated at ``i``,
``v_proj(c_i)``; no input norm) in its own cache. A block of ``k`` draft tokens after the
row's next input ``t`` (at position ``p``) is one pass over ``x = embed([t, MASK x k])`` at
positions ``p .. p + k`` (the target's unscaled embedding table, ``MASK`` =
``dflash_config.mask_token_id``), each layer a Qwen3 layer whose attention is **not causal**: each
block position attends to every context position and every block position::

    h   = x + o_proj(attn(q = q_norm(q_proj(n)), k/v = [context; k_norm(k_proj(n)) / v_proj(n)]))
    x'  = h + mlp(post_attention_layernorm(h))            with n = input_layernorm(x)
    logits(t_{p+j}) = target.lm_head(norm(x_j)),   j = 1 .. k

The block's keys and values are dropped after the pass; the verified positions' states come
back as context. Read from z-lab's ``dflash/model.py`` and vLLM's ``qwen3_dflash.py`` (its
``precompute_and_store_context_kv``).
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

#: The ``rope_scaling`` types of the Qwen3 layers DFlash drafters are built from.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: ``dflash_config`` keys (vLLM's) that ask for other attention than the full non-causal one
#: computed here, with the value that means this graph.
UNREAD_SWITCHES = {"causal": False, "use_swa": False, "attention_sink_bias": False}


def default_target_layers(target_layers: int, draft_layers: int) -> list[int]:
    """z-lab's ``build_target_layer_ids``: the middle layer for a one-layer drafter, else
    ``draft_layers`` layers spread evenly from 1 to ``target_layers - 3``."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]


@dataclasses.dataclass
class DFlashArgs(TransformerArgs):
    """The drafter's ``config.json`` (Qwen3 keys, plus DFlash's own)."""

    family = "DFlash"

    #: Qwen3's default (vLLM's too, for a DFlash config that leaves it out).
    rope_theta: float = 1_000_000.0

    #: The block the drafter was trained on (the anchor token and ``block_size - 1`` masks).
    block_size: int = 16
    #: The target's layer count, for the default target layers.
    num_target_layers: int | None = None
    #: The target's hidden size, where it differs from the draft's.
    target_hidden_size: int | None = None
    #: ``target_layer_ids``, ``mask_token_id`` and vLLM's attention switches.
    dflash_config: dict[str, Any] | None = None
    #: Where a checkpoint keeps the mask id at the top level.
    mask_token_id: int | None = None
    draft_vocab_size: int | None = None
    is_neox_style: bool = True
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        nested = self.dflash_config or {}
        for key, means_this in UNREAD_SWITCHES.items():
            if key in nested and bool(nested[key]) != means_this:
                raise ModelLoadError(f"{key} = {nested[key]!r}: only full, non-causal block attention is computed",
                                     key=f"dflash_config.{key}")  # fmt: skip
        if any(kind != "full_attention" for kind in self.layer_types or []):
            raise ModelLoadError(f"{self.layer_types}: sliding-window draft layers are not computed", key="layer_types")
        if not self.is_neox_style:
            raise ModelLoadError("interleaved RoPE is not computed for a DFlash drafter", key="is_neox_style")
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise ModelLoadError(f"draft_vocab_size {self.draft_vocab_size}: a pruned draft vocabulary is not read",
                                 key="draft_vocab_size")  # fmt: skip
        if self.block_size < 2:
            raise ModelLoadError(f"block_size {self.block_size}: a block drafts block_size - 1 tokens", key="block_size")

    @property
    def mask_token(self) -> int:
        """The id the block's positions after the anchor are filled with."""
        token = (self.dflash_config or {}).get("mask_token_id", self.mask_token_id)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 or token >= self.vocab_size:
            raise ModelLoadError(f"mask_token_id {token!r} is no id of the {self.vocab_size}",
                                 key="dflash_config.mask_token_id")  # fmt: skip
        return token

    def target_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs ``fc`` reads, in its order: the config's
        ``target_layer_ids``, else z-lab's default. Each must have a layer after it (its output
        is that layer's input)."""
        chosen = (self.dflash_config or {}).get("target_layer_ids")
        if chosen is None:
            chosen = default_target_layers(self.num_target_layers or target_layers, self.num_hidden_layers)
        if not isinstance(chosen, list) or not chosen or not all(
            isinstance(index, int) and 0 <= index < target_layers - 1 for index in chosen
        ):
            raise ModelLoadError(f"target_layer_ids {chosen!r}: layers 0 .. {target_layers - 2} of the target's "
                                 f"{target_layers}", key="dflash_config.target_layer_ids")  # fmt: skip
        return tuple(chosen)


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose queries (the block) attend to the context and the whole block."""

    def __init__(self, args: DFlashArgs, kernels: KernelSet):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(
            H,
            args.num_attention_heads,
            args.kv_heads,
            args.dims,
            kernels=kernels,
            rotary=args_rotary(args, kernels, types=ROPE_TYPES),
            qkv_bias=args.attention_bias,
            out_bias=args.attention_bias,
            head_norm_eps=eps,
        )
        self.mlp = GatedMLP(H, args.intermediate_size, bias=args.mlp_bias)
        self.input_layernorm = RMSNorm(H, eps, kernels)
        self.post_attention_layernorm = RMSNorm(H, eps, kernels)

    def write_context(self, context: mx.array, cache: KVCache) -> None:
        """The context states' keys and values (``[B, L, H]``, rotated from ``cache.offset``) into ``cache``."""
        attn = self.self_attn
        B, L, _ = context.shape
        keys = attn.k_norm(attn.k_proj(context).reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = attn.v_proj(context).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        cache.update_and_fetch(attn._rotary(keys, cache.offset), values)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        """The block ``[B, k + 1, H]`` at the positions after the cache's, attending without a mask
        (its own keys and values stay in ``cache``: the caller trims them)."""
        h = x + self.self_attn(self.input_layernorm(x), None, cache)
        out: mx.array = h + self.mlp(self.post_attention_layernorm(h))
        return out


class DFlashHead(nn.Module):
    """The drafter: ``fc``, ``hidden_norm``, ``layers``, ``norm`` (the target's embedding and LM head)."""

    def __init__(self, args: DFlashArgs, kernels: KernelSet, fused_width: int):
        super().__init__()
        H = args.hidden_size
        self.fc = nn.Linear(fused_width, H, bias=False)
        self.hidden_norm = RMSNorm(H, args.rms_norm_eps, kernels)
        self.layers = [DFlashLayer(args, kernels) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(H, args.rms_norm_eps, kernels)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def write_context(self, hidden: mx.array, caches: list[KVCache]) -> None:
        """The target's fused layer states ``[B, L, m H_target]`` as context in every layer's cache."""
        context = self.hidden_norm(self.fc(hidden))
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.write_context(context, cache)

    def block(self, embeddings: mx.array, caches: list[KVCache]) -> mx.array:
        """One pass over a block's embeddings ``[B, k + 1, H]`` after the context: ``norm`` of
        the last layer's output, what the target's LM head reads (the block's keys and values
        are then dropped from ``caches``)."""
        x = embeddings
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache)
        for cache in caches:
            cache.trim(embeddings.shape[1])
        normed: mx.array = self.norm(x)
        return normed
