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

:func:`plan_shards` says all of this once, as a :class:`~mlxr_core.model.checkpoint.Shard` per
parameter, and everything else follows the plan: :func:`shard_model` cuts a module's layers to
their shares (before its weights are loaded, or after), a format that reads shares
(:class:`~mlxr_core.model.checkpoint.ReadsShards`: GGUF, safetensors) takes only this rank's
bytes of each split tensor from the file, and :func:`shard_weights` cuts in memory what a format
had to read whole. Replicated tensors are read whole on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import Shard
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mlp import GatedMLP

log = logging.getLogger(__name__)

KEY = "distributed.tensor_parallel"


def plan_shards(model: nn.Module, size: int, rank: int, *, name: str) -> dict[str, Shard]:
    """Parameter name (``model.layers.0.self_attn.q_proj.weight``) -> rank ``rank``'s share of
    it, for every parameter the split cuts: each split linear layer's ``weight``, ``bias`` and a
    packing's ``scales`` and ``biases`` (whether or not ``model`` is quantized yet), and attention
    sinks. ``model`` is only read; its parameters need not be loaded.

    :raises ModelLoadError: naming the model and ``distributed.tensor_parallel`` when a head
        count, an MLP width or a packing does not divide evenly, or the model has no attention
        layer mlxr can split (an architecture fallback's, or one of its own kind).
    """
    modules = model.named_modules()
    attentions = [(path, module) for path, module in modules if isinstance(module, Attention)]
    mlps = [(path, module) for path, module in modules if isinstance(module, GatedMLP)]
    if not attentions:
        raise _refuse(name, "it has no attention layers of mlxr's own (an architecture fallback's "
                      "layers cannot be split); serve it in one process")  # fmt: skip
    others = sorted({type(a).__name__ for _, a in attentions if type(a) is not Attention})
    if others:
        raise _refuse(name, f"its attention ({', '.join(others)}) computes more than mlxr's Attention "
                      "and cannot be split by heads")  # fmt: skip
    plan: dict[str, Shard] = {}
    for path, attention in attentions:
        heads, kv_heads, D = attention.n_heads, attention.n_kv_heads, attention.head_dim
        if heads % size or kv_heads % size:
            raise _refuse(name, f"its {heads} query heads and {kv_heads} key/value heads do not divide "
                          f"evenly across {size} ranks")  # fmt: skip
        if "qkv_proj" in attention:
            plan |= _rows(attention.qkv_proj, f"{path}.qkv_proj", [heads * D, kv_heads * D, kv_heads * D], size, rank, name)
        else:
            for projection, rows in (("q_proj", heads * D), ("k_proj", kv_heads * D), ("v_proj", kv_heads * D)):
                plan |= _rows(attention[projection], f"{path}.{projection}", [rows], size, rank, name)
        plan |= _columns(attention.o_proj, f"{path}.o_proj", size, rank, name)
        if "sinks" in attention:
            plan[f"{path}.sinks"] = Shard(0, size, rank, (heads,))
    for path, mlp in mlps:
        if "gate_up_proj" in mlp:
            width = _out_dims(mlp.gate_up_proj) // 2
            plan |= _rows(mlp.gate_up_proj, f"{path}.gate_up_proj", [width, width], size, rank, name)
        else:
            width = _out_dims(mlp.gate_proj)
            plan |= _rows(mlp.gate_proj, f"{path}.gate_proj", [width], size, rank, name)
            plan |= _rows(mlp.up_proj, f"{path}.up_proj", [width], size, rank, name)
        plan |= _columns(mlp.down_proj, f"{path}.down_proj", size, rank, name)
    return plan


def shard_model(model: nn.Module, group: Any, *, name: str) -> dict[str, Shard]:
    """Split ``model``'s attention layers and gated MLPs across ``group`` (an
    ``mx.distributed.Group``) in place, by :func:`plan_shards`; returns the plan. ``model`` may
    hold its weights (each rank keeps copies of its shares, so the whole tensors are freed once
    they are evaluated) or not yet: then its parameters take their shares' shapes, unevaluated,
    ready for :func:`shard_weights`'s.

    :raises ModelLoadError: as :func:`plan_shards`.
    """
    size, rank = group.size(), group.rank()
    plan = plan_shards(model, size, rank, name=name)
    modules = dict(model.named_modules())
    for key, shard in plan.items():
        path, _, part = key.rpartition(".")
        module = modules[path]
        if part in module:
            module[part] = take(module[part], shard)
    attentions = [module for module in modules.values() if isinstance(module, Attention)]
    mlps = [module for module in modules.values() if isinstance(module, GatedMLP)]
    for attention in attentions:
        attention.n_heads, attention.n_kv_heads = attention.n_heads // size, attention.n_kv_heads // size
        attention.tensor_group = group
    for mlp in mlps:
        mlp.tensor_group = group
    log.info("%s: rank %d of %d holds 1/%d of %d attention layers and %d MLPs", name, rank, size, size,
             len(attentions), len(mlps))  # fmt: skip
    return plan


def shard_weights(weights: dict[str, mx.array], plan: Mapping[str, Shard], model: nn.Module) -> dict[str, mx.array]:
    """``weights`` for ``model`` once :func:`shard_model` has cut its layers: each tensor of
    ``plan`` a format read whole is cut to its share here (the others came as their shares)."""
    shapes = {key: array.shape for key, array in tree_flatten(model.parameters())}  # type: ignore[misc,union-attr,str-unpack]
    weights = dict(weights)
    whole = 0
    for key, shard in plan.items():
        array = weights.get(key)
        if array is None:
            continue
        if array.ndim <= shard.axis or array.shape != shapes.get(key):
            weights[key] = take(array, shard)
            whole += array.ndim > shard.axis
    if whole:
        log.debug("%d split tensors were read whole and cut in memory", whole)
    return weights


def take(array: mx.array, shard: Shard) -> mx.array:
    """``array``'s share, copied. A row-parallel layer's bias (no input axis) stays whole on rank 0
    and is zero on the others, so the all-reduce adds it once."""
    if array.ndim <= shard.axis:
        return array if shard.rank == 0 else mx.zeros_like(array)
    pieces = []
    for start, stop in shard.ranges(array.shape[shard.axis]):
        index = [slice(None)] * array.ndim
        index[shard.axis] = slice(start, stop)
        pieces.append(array[tuple(index)])
    return mx.contiguous(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=shard.axis))


def _out_dims(layer: nn.Module) -> int:
    return int(layer.weight.shape[0])


#: A linear layer's parameters: dense or packed weight, a packing's scales and biases, its bias.
PARTS = ("weight", "scales", "biases", "bias")


def _rows(layer: nn.Module, path: str, segments: Sequence[int], size: int, rank: int, name: str) -> dict[str, Shard]:
    """Column-parallel: this rank's share of each output segment (query / key / value heads,
    gate / up columns) of ``layer``, at ``path``."""
    _check_kind(layer, name)
    if any(length % size for length in segments):
        raise _refuse(name, f"a layer's outputs {list(segments)} do not divide across {size} ranks")
    shard = Shard(0, size, rank, tuple(segments))
    return {f"{path}.{part}": shard for part in PARTS}


def _columns(layer: nn.Module, path: str, size: int, rank: int, name: str) -> dict[str, Shard]:
    """Row-parallel: this rank's share of the input columns of ``layer``, at ``path``."""
    _check_kind(layer, name)
    if isinstance(layer, nn.QuantizedLinear):
        columns = layer.weight.shape[1] * 32 // layer.bits
        if columns % (size * layer.group_size):
            raise _refuse(name, f"a packed layer's {columns} input columns do not split across {size} "
                          f"ranks in whole groups of {layer.group_size}")  # fmt: skip
    elif layer.weight.shape[1] % size:
        raise _refuse(name, f"a layer's {layer.weight.shape[1]} input columns do not divide across {size} ranks")
    shard = Shard(1, size, rank)
    return {f"{path}.{part}": shard for part in PARTS}


def _check_kind(layer: nn.Module, name: str) -> None:
    if not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
        raise _refuse(name, f"it holds a {type(layer).__name__} where a linear layer was expected")


def _refuse(name: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"model {name} cannot be split across ranks: {why}", key=KEY)
