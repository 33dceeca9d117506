"""Tensor parallelism: each rank keeps its share of every attention layer's heads and every gated
MLP's columns, and one all-reduce per attention and per MLP joins the shares.

Megatron's split, on the building blocks of :mod:`mlxr_core.model.layers`: the query, key and
value projections keep the rows of this rank's heads and the gate and up projections the rows of
its columns (column-parallel: no communication), so attention and the activation run on local
heads and columns; the output and down projections keep the matching input columns (row-parallel)
and their partial outputs are summed across ranks by :attr:`Attention.tensor_group` /
:attr:`GatedMLP.tensor_group` (``mx.distributed.all_sum``). Everything else (embeddings, norms, the
LM head, routers and experts of a mixture, recurrent mixers) is replicated: every rank computes it
on the same inputs, so every rank holds the same hidden state after each block.

Packed (quantized) layers split the same way: rows of an affine packing are independent, and a
split of the input columns at a multiple of the group size keeps whole groups. A layer's bias is
split with its rows; a row-parallel layer's bias is kept by rank 0 alone, so the sum adds it once.
Each rank keeps only copies of its slices, so the full tensors are freed once loading ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mlp import GatedMLP

log = logging.getLogger(__name__)

KEY = "distributed.tensor_parallel"


def shard_model(model: nn.Module, group: Any, *, name: str) -> int:
    """Split ``model``'s attention layers and gated MLPs across ``group`` (an
    ``mx.distributed.Group``) in place; returns the number of layers split.

    :raises ModelLoadError: naming the model and ``distributed.tensor_parallel`` when a head
        count, an MLP width or a packing does not divide evenly, or the model has no attention
        layer mlxr can split (an architecture fallback's, or one of its own kind).
    """
    size, rank = group.size(), group.rank()
    modules = [module for _, module in model.named_modules()]
    attentions = [module for module in modules if isinstance(module, Attention)]
    mlps = [module for module in modules if isinstance(module, GatedMLP)]
    if not attentions:
        raise _refuse(name, "it has no attention layers of mlxr's own (an architecture fallback's "
                      "layers cannot be split); serve it in one process")  # fmt: skip
    others = sorted({type(a).__name__ for a in attentions if type(a) is not Attention})
    if others:
        raise _refuse(name, f"its attention ({', '.join(others)}) computes more than mlxr's Attention "
                      "and cannot be split by heads")  # fmt: skip
    for attention in attentions:
        _shard_attention(attention, size, rank, name)
        attention.tensor_group = group
    for mlp in mlps:
        _shard_mlp(mlp, size, rank, name)
        mlp.tensor_group = group
    mx.eval(model.parameters())
    log.info("%s: rank %d of %d holds 1/%d of %d attention layers and %d MLPs", name, rank, size, size,
             len(attentions), len(mlps))  # fmt: skip
    return len(attentions) + len(mlps)


def _shard_attention(attention: Attention, size: int, rank: int, name: str) -> None:
    heads, kv_heads, D = attention.n_heads, attention.n_kv_heads, attention.head_dim
    if heads % size or kv_heads % size:
        raise _refuse(name, f"its {heads} query heads and {kv_heads} key/value heads do not divide "
                      f"evenly across {size} ranks")  # fmt: skip
    if "qkv_proj" in attention:
        _split_rows(attention.qkv_proj, [heads * D, kv_heads * D, kv_heads * D], size, rank, name)
    else:
        _split_rows(attention.q_proj, [heads * D], size, rank, name)
        _split_rows(attention.k_proj, [kv_heads * D], size, rank, name)
        _split_rows(attention.v_proj, [kv_heads * D], size, rank, name)
    _split_columns(attention.o_proj, size, rank, name)
    if "sinks" in attention:
        attention.sinks = _slice(attention.sinks, 0, heads, size, rank)
    attention.n_heads, attention.n_kv_heads = heads // size, kv_heads // size


def _shard_mlp(mlp: GatedMLP, size: int, rank: int, name: str) -> None:
    if "gate_up_proj" in mlp:
        width = _out_dims(mlp.gate_up_proj) // 2
        _split_rows(mlp.gate_up_proj, [width, width], size, rank, name)
    else:
        width = _out_dims(mlp.gate_proj)
        _split_rows(mlp.gate_proj, [width], size, rank, name)
        _split_rows(mlp.up_proj, [width], size, rank, name)
    _split_columns(mlp.down_proj, size, rank, name)


def _out_dims(layer: nn.Module) -> int:
    return int(layer.weight.shape[0])


def _slice(array: mx.array, axis: int, length: int, size: int, rank: int) -> mx.array:
    """This rank's ``1/size`` of ``array``'s first ``length`` entries along ``axis``, copied."""
    step = length // size
    index = [slice(None)] * array.ndim
    index[axis] = slice(rank * step, (rank + 1) * step)
    return mx.contiguous(array[tuple(index)])


def _split_rows(layer: nn.Module, segments: Sequence[int], size: int, rank: int, name: str) -> None:
    """Column-parallel: keep this rank's share of each output segment (query / key / value heads,
    gate / up columns), for ``weight``, a packing's ``scales`` and ``biases``, and ``bias``."""
    _check_kind(layer, name)
    if any(length % size for length in segments):
        raise _refuse(name, f"a layer's outputs {list(segments)} do not divide across {size} ranks")
    for part in ("weight", "scales", "biases", "bias"):
        array = layer.get(part)
        if array is None:
            continue
        starts = [sum(segments[:i]) for i in range(len(segments))]
        pieces = [_slice(array[start : start + length], 0, length, size, rank) for start, length in zip(starts, segments, strict=True)]
        layer[part] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


def _split_columns(layer: nn.Module, size: int, rank: int, name: str) -> None:
    """Row-parallel: keep this rank's share of the input columns; the bias on rank 0 only."""
    _check_kind(layer, name)
    if isinstance(layer, nn.QuantizedLinear):
        columns = layer.weight.shape[1] * 32 // layer.bits
        if columns % (size * layer.group_size):
            raise _refuse(name, f"a packed layer's {columns} input columns do not split across {size} "
                          f"ranks in whole groups of {layer.group_size}")  # fmt: skip
        layer.weight = _slice(layer.weight, 1, layer.weight.shape[1], size, rank)
        layer.scales = _slice(layer.scales, 1, layer.scales.shape[1], size, rank)
        biases = layer.get("biases")
        if biases is not None:
            layer.biases = _slice(biases, 1, biases.shape[1], size, rank)
    else:
        columns = layer.weight.shape[1]
        if columns % size:
            raise _refuse(name, f"a layer's {columns} input columns do not divide across {size} ranks")
        layer.weight = _slice(layer.weight, 1, columns, size, rank)
    if "bias" in layer and rank != 0:
        layer.bias = mx.zeros_like(layer.bias)


def _check_kind(layer: nn.Module, name: str) -> None:
    if not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
        raise _refuse(name, f"it holds a {type(layer).__name__} where a linear layer was expected")


def _refuse(name: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"model {name} cannot be split across ranks: {why}", key=KEY)
