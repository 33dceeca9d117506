"""mlxr-kernel-override: an example plugin replacing a built-in kernel backend.

It registers ``rms_norm`` under the built-in backend name ``reference`` with ``override=True``: a
second plugin claiming a taken name must say so, or mlxr refuses it. ``mlxr plugins`` then
reports the override on both sides, and ``kernels: {rms_norm: reference}`` selects this one.
The target is a ``"module:attr"`` string, so MLX is imported only when a model binds its kernels.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterKernel, hookimpl


@hookimpl
def mlxr_register_kernels(register: RegisterKernel) -> None:
    """Replace the built-in ``rms_norm:reference`` with the counting wrapper."""
    register("rms_norm", "reference", "mlxr_kernel_override.kernels:rms_norm_kernel", override=True)
