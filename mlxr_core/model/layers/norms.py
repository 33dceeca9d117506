"""RMS norm through the bound kernels, in the two stored forms of its scale."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.kernels import KernelSet


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)`` through the ``rms_norm`` kernel. ``offset`` is 0 for
    most families (the weight is the scale, initialized to ones) and 1 for Gemma's checkpoints,
    which store ``scale - 1`` (initialized to zeros)."""

    def __init__(self, dims: int, eps: float, kernels: KernelSet, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps = eps
        self.offset = offset
        self._rms_norm = kernels.rms_norm
        self._add_rms_norm = kernels.add_rms_norm

    def scale(self) -> mx.array:
        return self.offset + self.weight if self.offset else self.weight

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self._rms_norm(x, self.scale(), self.eps)
        return out

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """``h = x + residual`` and this norm of ``h`` (the ``add_rms_norm`` kernel)."""
        h, normed = self._add_rms_norm(x, residual, self.scale(), self.eps)
        return h, normed


class LayerNorm(nn.Module):
    """``(x - mean(x)) / std(x) * weight``, no bias (Cohere's norm), with :class:`RMSNorm`'s
    interface (``add_and_norm``) so that blocks and the compiled decode step take either."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, self.weight, None, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """``h = x + residual`` and this norm of ``h``."""
        h = x + residual
        return h, self(h)
