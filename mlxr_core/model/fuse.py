"""Joining linear layers that read the same input into one matmul, after the weights are loaded.

A decode step's cost beyond reading the weights is per op: every matmul is a dispatch on the CPU
and a kernel launch on a GPU. The query, key and value projections of an attention layer read the
same normed input, as do the gate and up projections of a gated MLP: one matmul over the
concatenated weights gives the same outputs, side by side, for one dispatch instead of three or
two. Dense layers join when their biases agree (all or none); packed layers when they share a
packing (bits, group size, mode), since affine packing is per output row and so concatenates.

Modules of a built model offer a ``fuse_projections()`` method (see :mod:`mlxr_core.model.arch`);
the loader calls every one through :func:`fuse_model` for served models
(``models[].fuse_projections``), never for ``mlxr convert``, which writes the checkpoint's own
layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def concat_linears(layers: Sequence[nn.Module]) -> nn.Module | None:
    """One layer whose output is ``layers``' outputs concatenated on the last axis, or None when
    they cannot be joined (different kinds, packings or bias presence)."""
    first = layers[0]
    kind = type(first)
    if any(type(layer) is not kind for layer in layers):
        return None
    has_bias = ["bias" in layer for layer in layers]
    if any(has != has_bias[0] for has in has_bias):
        return None
    fused: nn.Module
    if kind is nn.Linear:
        fused = nn.Linear(1, 1, bias=has_bias[0])
        fused.weight = mx.concatenate([layer.weight for layer in layers])
    elif isinstance(first, nn.QuantizedLinear):
        packing = {(layer.bits, layer.group_size, layer.mode) for layer in layers}  # type: ignore[attr-defined]
        if len(packing) != 1 or any(layer.get("biases") is None for layer in layers) != (
            first.get("biases") is None
        ):
            return None
        # A placeholder whose parameters are replaced below; 128 inputs quantize in every mode
        # (nvfp4's 16 alone do not).
        fused = nn.QuantizedLinear(
            max(first.group_size, 128), 1, bias=has_bias[0], group_size=first.group_size, bits=first.bits,
            mode=first.mode,
        )
        object.__setattr__(fused, "__class__", kind)  # a routing subclass, see route_quantized_linears
        for name, value in vars(first).items():
            # Plain attributes: the packing, the frozen names, the kernel a routing subclass calls.
            object.__setattr__(fused, name, value)
        fused.weight = mx.concatenate([layer.weight for layer in layers])
        fused.scales = mx.concatenate([layer.scales for layer in layers])
        if first.get("biases") is not None:
            fused.biases = mx.concatenate([layer.biases for layer in layers])
    else:
        return None
    if has_bias[0]:
        fused.bias = mx.concatenate([layer.bias for layer in layers])
    mx.eval(fused.parameters())
    return fused


def fuse_into(module: Any, name: str, parts: Sequence[str]) -> bool:
    """Replace ``module``'s layers ``parts`` by one layer ``name`` computing their outputs
    concatenated in that order; False (and nothing changed) when they cannot be joined or some
    part is missing (already fused, or built fused)."""
    if not all(isinstance(module.get(part), nn.Module) for part in parts):
        return False
    fused = concat_linears([module[part] for part in parts])
    if fused is None:
        return False
    for part in parts:
        delattr(module, part)
    setattr(module, name, fused)
    return True


def fuse_model(model: nn.Module) -> int:
    """Call ``fuse_projections()`` on every submodule that offers it; how many fused."""
    fusers = [module for _, module in model.named_modules() if callable(getattr(module, "fuse_projections", None))]
    return sum(bool(module.fuse_projections()) for module in fusers)


def gate_and_up(mlp: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    """A gated MLP's two branches, from ``gate_up_proj`` once fused, else from its two layers."""
    if "gate_up_proj" in mlp:
        gate, up = mx.split(mlp.gate_up_proj(x), 2, axis=-1)
        return gate, up
    return mlp.gate_proj(x), mlp.up_proj(x)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one fused elementwise kernel."""
    return nn.silu(gate) * up
