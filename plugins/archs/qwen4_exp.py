"""Qwen4-Exp (Qwen3.8-Flash-Next, ``qwen4_exp``): Qwen3.5-MoE's hybrid under hyper-connections,
with per-layer n-gram embeddings and indexed attention, as transformers 5.25 defines it.

The token mixers and experts are Qwen3.5-MoE's (:mod:`mlxr_plugins.archs.qwen3_next`: Gated
DeltaNet, gated attention with per-head norms scaling by ``1 + weight``, sparse experts with a
gated shared expert in every layer). What differs:

- **Hyper-connections.** The residual is ``hc_count`` streams ``[B, L, hc_count * hidden]``
  (the embedding repeated). Before each mixer and each feed-forward a :class:`GatedResidual`
  norms every stream (:class:`~mlxr_plugins.archs.qwen4_exp_ple.GroupRMSNorm`), mixes them into
  the layer's input by a low-rank sigmoid gate, and after it adds the layer's output to every
  stream, each with its own weight ``2 * sigmoid(block_inject(streams) / hc_count)``. There are
  no other norms: the last mixer (``hyper_connection_mixer``) gives the LM head its input.
- **Per-layer embeddings** on the DeltaNet layers of ``ple_layer_ids``
  (:mod:`mlxr_plugins.archs.qwen4_exp_ple`), added to the streams before the layer's mixer.
- **Indexed attention** (``indexed_attention``, which the released configs call
  ``full_attention``): each query attends over the token blocks an indexer picks
  (:mod:`mlxr_plugins.archs.qwen4_exp_qsa`).

The vision-language checkpoint (``qwen4_exp``) holds the text model under ``text_config`` and
``model.language_model.`` (:mod:`mlxr_plugins.archs.qwen3_5`); its vision tower is not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.model.layers import CausalLM, DecoderModel, args_rotary
from mlxr_core.model.layers.linear_attention import (
    GatedDeltaNet,
    GatedRMSNorm,
    _rms,
)
from mlxr_plugins.archs.qwen2 import ROPE_TYPES
from mlxr_plugins.archs.qwen3_5 import Qwen35Architecture, Qwen35MoeArgs, text_name
from mlxr_plugins.archs.qwen3_moe import qwen_feed_forward
from mlxr_plugins.archs.qwen4_exp_ple import (
    DeltaNetSlots,
    GroupRMSNorm,
    NGramTable,
    PLECache,
    PLELayer,
    derived_constants,
    host_rows,
)
from mlxr_plugins.archs.qwen4_exp_qsa import IndexedAttention, Indexer

INDEXER_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclasses.dataclass
class Qwen4ExpArgs(Qwen35MoeArgs):
    """The keys of ``Qwen4ExpTextConfig`` (its defaults; no ``partial_rotary_factor``: whole heads rotate)."""

    family = "qwen4_exp"
    limits = {
        **Qwen35MoeArgs.limits,
        "hc_count": (2, 64),
        "hc_lowrank": (1, 1 << 16),
        "ple_embed_dim": (1, 1 << 16),
        "ple_conv_kernel_size": (1, 64),
        "ngram_size": (2, 16),
        "heads_per_ngram": (1, 1 << 10),
        "ngram_vocab_size_base": (2, 1 << 40),
        "make_ngram_vocab_size_divisible_by": (1, 1 << 20),
        **dict.fromkeys(INDEXER_KEYS, (1, 1 << 24)),
    }
    partial_rotary_factor: float = 1.0
    num_experts: int = 512
    num_experts_per_tok: int = 10
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] = dataclasses.field(default_factory=list)
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    #: The experts' activation (SwiGLU here), and the DeltaNet output gate's unless ``output_gate_type``.
    hidden_act: str = "silu"
    output_gate_type: str | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # both names are the indexed attention here
            self.layer_types = ["full_attention" if kind == "indexed_attention" else kind for kind in self.layer_types]
        # Every layer is sparse: Qwen4-Exp's config has no dense-layer keys.
        self.decoder_sparse_step, self.mlp_only_layers = 1, []
        super().__post_init__()
        self.ple_layer_ids = sorted(set(self.ple_layer_ids))
        self.ple_embed_dim = self.ple_embed_dim or self.hidden_size
        if self.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"{self.hidden_act!r}: the experts compute silu", key="hidden_act")
        if self.output_gate_type not in (None, "silu", "swish", "sigmoid"):
            raise ModelLoadError(f"{self.output_gate_type!r}: the DeltaNet output gate is silu or sigmoid",
                                 key="output_gate_type")  # fmt: skip
        if not all(self.is_linear(i) for i in range(self.num_hidden_layers)):
            missing = [key for key in INDEXER_KEYS if getattr(self, key) is None]
            if missing:
                raise ModelLoadError("the indexed attention layers need the indexer's keys", key=missing[0])
            if self.indexer_kv_heads != 1:
                raise ModelLoadError(f"{self.indexer_kv_heads}: the indexer has one key head", key="indexer_kv_heads")
            assert self.indexer_budget is not None and self.indexer_compress_ratio is not None
            if self.indexer_budget % self.indexer_compress_ratio:
                raise ModelLoadError("indexer_budget is not a multiple of indexer_compress_ratio", key="indexer_budget")
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if self.ple_embed_dim % heads:
                raise ModelLoadError(f"{self.ple_embed_dim} is not a multiple of the {heads} n-gram heads",
                                     key="ple_embed_dim")  # fmt: skip
            wrong = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers or not self.is_linear(i - 1)]
            if wrong:
                raise ModelLoadError(f"{wrong[0]} is not the one-based index of a linear_attention layer",
                                     key="ple_layer_ids")  # fmt: skip
            if self.eos_id is None:
                raise ModelLoadError("the n-gram embeddings need an end-of-sequence token", key="eos_token_id")

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence token the n-grams stop at (the first, where the config lists several)."""
        eos = self.eos_token_id
        return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def _sigmoid_gated_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    return (_rms(x, weight, eps) * mx.sigmoid(gate.astype(mx.float32))).astype(x.dtype)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """``rms_norm(x) * weight * sigmoid(gate)`` (``output_gate_type: sigmoid``)."""

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return _sigmoid_gated_norm(x, gate, self.weight, self._eps)


class GatedResidual(nn.Module):
    """Hyper-connections around one sublayer: :meth:`__call__` gives the sublayer's input and the
    weight each stream takes its output with (None for the final mixer, ``inject=False``)."""

    def __init__(self, args: Qwen4ExpArgs, inject: bool = True):
        super().__init__()
        H, S = args.hidden_size, args.hc_count
        self.hidden, self.streams = H, S
        self.hc_norm = GroupRMSNorm(S * H, H, args.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(S * H, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, S * H, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(S * H, S, bias=False)

    def __call__(self, streams: mx.array) -> tuple[mx.array, mx.array | None]:
        S, H = self.streams, self.hidden
        normed = self.hc_norm(streams)
        mix = mx.sigmoid(self.input_mix_weight_up(nn.silu(self.input_mix_weight_down(normed) / S)))
        mixed = (mix * normed).reshape(*streams.shape[:-1], S, H).mean(axis=-2)
        if "block_inject_weight" not in self:
            return mixed, None
        return mixed, 2 * mx.sigmoid(self.block_inject_weight(normed) / S)

    def add(self, streams: mx.array, out: mx.array, inject: mx.array) -> mx.array:
        """``out`` ``[B, L, H]`` added to every stream with its weight ``inject`` ``[B, L, S]``."""
        added = out[..., None, :] * inject[..., :, None]
        result: mx.array = streams + added.reshape(streams.shape)
        return result


class Qwen4ExpBlock(nn.Module):
    """One decoder layer over the streams: per-layer embeddings (where configured), then the
    mixer (``linear_attn`` or ``self_attn``) and the experts (``mlp``), each between its gated
    residuals."""

    def __init__(self, args: Qwen4ExpArgs, layer: int, kernels: KernelSet, rotary: Any):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.linear = args.is_linear(layer)
        if self.linear:
            mixer = GatedDeltaNet(
                H, key_heads=args.linear_num_key_heads, value_heads=args.linear_num_value_heads,
                key_dim=args.linear_key_head_dim, value_dim=args.linear_value_head_dim,
                conv_kernel=args.linear_conv_kernel_dim, eps=eps, kernels=kernels, fused=False,
            )  # fmt: skip
            if args.output_gate_type == "sigmoid":
                mixer.norm = SigmoidGatedRMSNorm(args.linear_value_head_dim, eps)
            self.linear_attn = mixer
        else:
            assert args.indexer_n_heads is not None and args.indexer_head_dim is not None
            assert args.indexer_budget is not None and args.indexer_compress_ratio is not None
            indexer = Indexer(H, args.indexer_n_heads, args.indexer_head_dim, eps, args.indexer_budget,
                              args.indexer_compress_ratio)  # fmt: skip
            self.self_attn = IndexedAttention(
                H, args.num_attention_heads, args.kv_heads, args.dims, kernels=kernels, rotary=rotary,
                qkv_bias=args.attention_bias, out_bias=args.attention_bias, head_norm_eps=eps, norm_offset=1.0,
                indexer=indexer,
            )  # fmt: skip
        self.mlp = qwen_feed_forward(args, layer, kernels, args.shared_expert_intermediate_size)
        if layer + 1 in args.ple_layer_ids:
            self.ple = PLELayer(args, args.ple_layer_ids.index(layer + 1))
        self.attn_hyper_connection = GatedResidual(args)
        self.mlp_hyper_connection = GatedResidual(args)

    def make_cache(self) -> Any:
        if not self.linear:
            return self.self_attn.make_cache()
        delta: RecurrentCache = self.linear_attn.make_cache()
        if "ple" not in self:
            return delta
        ple: PLELayer = self.ple
        channels = ple.streams * ple.hidden
        shapes = (delta.conv, delta.recurrent, (ple.conv_length, channels), (ple.context,))
        return PLECache(shapes, delta.reserve_bytes(0, 4) + ple.conv_length * channels * 4 + ple.context * 4)

    def __call__(self, streams: mx.array, tokens: mx.array, mask: Any, cache: Any) -> mx.array:
        if "ple" in self:
            streams = streams + self.ple(streams, tokens, cache)
        x, inject = self.attn_hyper_connection(streams)
        if self.linear:
            slots: Any = DeltaNetSlots(cache) if cache is not None and "ple" in self else cache
            mixed = self.linear_attn(x, mask, slots)
        else:
            mixed = self.self_attn(x, mask, cache)
        assert inject is not None
        streams = self.attn_hyper_connection.add(streams, mixed, inject)
        x, inject = self.mlp_hyper_connection(streams)
        assert inject is not None
        return self.mlp_hyper_connection.add(streams, self.mlp(x), inject)


class Qwen4ExpModel(DecoderModel):
    """``embed_tokens``, ``layers`` and ``hyper_connection_mixer`` (Hugging Face's ``model.*``):
    ``[B, L]`` ids -> the mixed streams ``[B, L, hidden]`` the LM head reads."""

    def __init__(self, args: Qwen4ExpArgs, kernels: KernelSet):
        nn.Module.__init__(self)
        rotary = args_rotary(args, kernels, types=ROPE_TYPES)
        self.streams, self.embed_scale = args.hc_count, None
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Qwen4ExpBlock(args, i, kernels, rotary) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = GatedResidual(args, inject=False)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        if embeddings is not None or positions is not None:
            raise ValueError("qwen4_exp's text model runs from token ids (its n-grams read them)")
        streams = mx.tile(self.embed(inputs), (1, 1, self.streams))
        if mask is None and inputs.shape[1] > 1:
            mask = "causal"
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers), strict=True):
            streams = layer(streams, inputs, mask, layer_cache)
        return self.hyper_connection_mixer(streams)[0]


def build_qwen4_exp(args: Qwen4ExpArgs, kernels: KernelSet) -> CausalLM:
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``."""
    return CausalLM(Qwen4ExpModel(args, kernels), tied=args.tie_word_embeddings)


#: The n-gram hashing's constants a checkpoint stores per PLE layer; each must equal what the
#: config derives.
DERIVED = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class Qwen4ExpArchitecture(Qwen35Architecture):
    """The :class:`mlxr_core.model.arch.Architecture` of ``qwen4_exp`` (and ``qwen4_exp_text``)."""

    args_class: ClassVar[type[Any]] = Qwen4ExpArgs

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the text model from a tolerant config dict."""
        return build_qwen4_exp(self.args(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Qwen3.5's (language model under ``model.``, experts stacked, conv weights in MLX's
        layout), with the hashing constants the checkpoint stores per PLE layer checked against
        the config's and dropped. (The n-gram tables never come here: see :meth:`attach_tables`.)"""
        args: Qwen4ExpArgs = self.args(config)
        expected = derived_constants(args)
        rest: dict[str, mx.array] = {}
        for name, array in weights.items():
            if name.rpartition(".")[2] not in DERIVED:
                rest[name] = array
                continue
            stem = text_name(name).rpartition(".ple.")[0]
            if np.array(array).astype(np.int64).tolist() != expected.get(stem, {}).get(name.rpartition(".")[2]):
                raise ModelLoadError("the stored n-gram hashing constants are not those the config derives "
                                     "(seed, ngram_vocab_size_base, ngram_size, heads_per_ngram)", tensor=name)  # fmt: skip
        return super().sanitize(rest, config)

    def stored_table(self, config: dict[str, Any], name: str) -> bool:
        """The n-gram tables' tensors (``ngram_embedding.shard_<i>.weight``, or one ``weight``)."""
        return ".ple.ple_embedding.ngram_embedding." in name

    def attach_tables(self, model: nn.Module, config: dict[str, Any], parts: dict[str, Any], dtype: mx.Dtype) -> None:
        """Each PLE layer's table from its shards, in order: memory-mapped where the format left
        them in their files, else the arrays it read (then resident, still outside the weights)."""
        shards: dict[str, dict[int, Any]] = {}
        for name, part in parts.items():
            stem, _, tail = text_name(name).partition(".ple.ple_embedding.ngram_embedding.")
            shards.setdefault(stem, {})[int(tail.split(".")[0].removeprefix("shard_")) if tail.startswith("shard_") else 0] = (name, part)
        for index, layer in enumerate(model.layers):
            if "ple" not in layer:
                continue
            embedding = layer.ple.ple_embedding
            found = shards.pop(f"model.layers.{index}", None)
            if not found:
                raise ModelLoadError("the checkpoint has no n-gram table for this PLE layer",
                                     tensor=f"model.layers.{index}.ple.ple_embedding.ngram_embedding.weight")  # fmt: skip
            table = NGramTable([host_rows(*found[i]) for i in sorted(found)], dtype)
            if table.shape != embedding.table_shape:
                raise ModelLoadError(f"the n-gram table is {table.shape}; the config makes it {embedding.table_shape}",
                                     tensor=found[min(found)][0])  # fmt: skip
            embedding.table = table
        if shards:
            raise ModelLoadError("an n-gram table for a layer that has no per-layer embedding",
                                 tensor=next(iter(next(iter(shards.values())).values()))[0])  # fmt: skip

    def make_cache(self, model: nn.Module) -> list[Any]:
        """Keys and values per attention layer, a recurrent state per DeltaNet layer (with the
        n-gram context and convolution inputs where it has per-layer embeddings)."""
        return [layer.make_cache() for layer in model.layers]
