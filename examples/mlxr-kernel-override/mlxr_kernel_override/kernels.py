"""A counting ``rms_norm``: the built-in reference kernel, plus a call counter.

A real override would put a faster or differently-rounded kernel here; it keeps the signature of
``mlxr_core.kernels`` (``rms_norm(x, weight, eps)``) and should pass ``check_kernel_parity``
against the reference.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_plugins.kernels import KernelImpl
from mlxr_plugins.kernels.reference import rms_norm as reference_rms_norm

#: How many times the kernel has been called in this process (graph construction, not evaluation).
calls = 0


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Count the call, then delegate to the built-in reference ``rms_norm``."""
    global calls
    calls += 1
    return reference_rms_norm(x, weight, eps)


rms_norm_kernel = KernelImpl(rms_norm, summary="the reference rms_norm, counting its calls (example override)")
