"""Built-in kernel backends: a pure-``mx`` reference for every op, ``mx.fast`` ones, and fused
``cuda`` / ``metal`` ones for the ops where a hand-written kernel pays.

Importing this module is cheap (no MLX): backends are registered as ``"module:attr"`` strings and
imported when a model binds its kernels (or ``mlxr kernels`` asks them whether they can run).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.plugin_api import hookimpl

if TYPE_CHECKING:
    from mlxr_core.plugin_api import KernelContext, RegisterKernel

#: Kernels are needed to run any model; ``--disable kernels`` would leave nothing to bind.
MLXR_ESSENTIAL = True

#: backend -> (module, priority, ops it implements; ``None``: every op in ``OPS``). ``auto`` takes
#: the highest priority that supports the context. ``cuda`` sits above ``mlx_fast``: its op fuses
#: only decode under an array mask, which MLX's CUDA backend has no fused kernel for, and hands
#: the rest to mx.fast (see its module). The fused ``metal`` kernels sit below ``mlx_fast``,
#: opt-in (``kernels: {attention: metal}``): unmeasured.
#: ``cpu_native`` (packed quantized matmul, and a decode step's norms, RoPE, attention and gated
#: MLP activation, in C++, compiled on first use, CPU only) sits above ``cpu_blas`` and
#: ``mlx_fast``, which is where ``auto`` goes when it cannot be built. ``cpu_int8`` (its packed
#: matmul with the input rounded to int8, llama.cpp's arithmetic) sits above ``cpu_native``: where
#: the CPU has AVX-512 VNNI it is the default (1.16-1.21x decode, 2.4-4.7x prompts with AMX on
#: Gemma 3 against the float path; greedy answers checked against llama.cpp's), elsewhere its
#: ``supports()`` says why and ``auto`` takes ``cpu_native``. ``kernels: {quantized_matmul:
#: cpu_native}`` keeps float inputs.
#: ``cpu_blas`` (quantized matmul and decode RoPE on MLX's CPU backend only) and ``cuda_norm``
#: (residual add + RMS norm as one kernel, CUDA only) sit above ``mlx_fast``; ``cuda_dense`` (quantized matmul for several rows as dequantize + dense matmul, on
#: MLX's CUDA backend only) below it, opt-in; ``cuda_qmm`` (4-bit packed matmul for a few rows with
#: a split reduction, CUDA only; it hands wide layers and one-row calls to mx) above it: see their
#: modules. ``cuda_qmv`` (``cuda_qmm`` plus a 4- and 8-bit kernel for one row, batch-1 decode) sits
#: between ``mlx_fast`` and ``cuda_qmm``, opt-in (``kernels: {quantized_matmul: cuda_qmv}``) until
#: its parity and timings on a GPU are in; ``metal_qmv``, its one-row kernel's Metal twin, is
#: untested (no Apple GPU here), so opt-in too. ``cuda_moe`` (a mixture of experts' router in one kernel, CUDA only) sits above
#: ``mlx_fast``, and so does ``cuda_delta`` (the gated delta rule's whole recurrence in one kernel,
#: CUDA only). ``metal``'s gated delta kernel is untested (no Apple GPU here), so opt-in too.
BACKENDS: dict[str, tuple[str, int, tuple[str, ...] | None]] = {
    "cpu_native": (
        "mlxr_plugins.kernels.cpu_native",
        25,
        ("quantized_matmul", "gather_matmul", "attention", "rms_norm", "add_rms_norm", "rope",
         "gated_activation"),
    ),
    "cpu_int8": ("mlxr_plugins.kernels.cpu_int8", 30, ("quantized_matmul", "gather_matmul")),
    "cpu_blas": ("mlxr_plugins.kernels.cpu_blas", 20, ("quantized_matmul", "rope")),
    "cuda": ("mlxr_plugins.kernels.cuda", 15, ("attention",)),
    "cuda_dense": ("mlxr_plugins.kernels.cuda_dense", 5, ("quantized_matmul",)),
    "cuda_moe": ("mlxr_plugins.kernels.cuda_moe", 15, ("route",)),
    "cuda_delta": ("mlxr_plugins.kernels.cuda_delta", 15, ("gated_delta",)),
    "cuda_qmm": ("mlxr_plugins.kernels.cuda_qmm", 15, ("quantized_matmul",)),
    "cuda_qmv": ("mlxr_plugins.kernels.cuda_qmv", 12, ("quantized_matmul",)),
    "cuda_norm": ("mlxr_plugins.kernels.cuda_norm", 20, ("add_rms_norm",)),
    "metal": ("mlxr_plugins.kernels.metal", 5, ("attention", "rms_norm", "gated_delta")),
    "metal_qmv": ("mlxr_plugins.kernels.metal_qmv", 5, ("quantized_matmul",)),
    "mlx_fast": ("mlxr_plugins.kernels.mlx_fast", 10, None),
    "reference": ("mlxr_plugins.kernels.reference", 0, None),
}


def _no_reasons(ctx: KernelContext) -> list[str]:
    return []


@attrs.frozen
class KernelImpl:
    """A kernel backend made of a function and a support check (see ``mlxr_core.kernels``)."""

    op: Callable[..., Any]
    check: Callable[[KernelContext], list[str]] = _no_reasons
    #: One line for ``mlxr kernels``: what is fused, what is delegated.
    summary: str = ""
    #: A ``quantized_matmul`` at least as fast on packed weights as on dense ones on a CPU
    #: (``quantization: auto`` then keeps them packed; see ``mlxr_core.kernels.KernelBackend``).
    keeps_packed: bool = False
    #: dtype -> (atol, rtol) for :func:`mlxr_core.testing.kernel_check.check_kernel_parity`, where
    #: the backend's arithmetic differs from the reference by design (``cpu_int8`` rounds its
    #: inputs to int8) and says by how much; None: the op's own tolerances.
    parity_tolerance: dict[str, tuple[float, float]] | None = None
    #: The quantization modes a packed-weight op multiplies (None: every mode MLX has), checked
    #: against the context's ``quant_mode`` (see :meth:`mlxr_core.kernels.KernelSet.packing_reasons`).
    modes: tuple[str, ...] | None = None

    def supports(self, ctx: KernelContext) -> list[str]:
        """Reasons this backend cannot run in ``ctx``; empty when it can."""
        reasons = self.check(ctx)
        mode = ctx.shapes.get("quant_mode")
        if self.modes is not None and mode is not None and mode not in self.modes:
            reasons = [*reasons, f"no kernel for {mode} packing (runs {', '.join(self.modes)})"]
        return reasons


#: Activation dtypes the hand-written kernels are built for.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: What each device backend needs, as its "cannot run here" reason starts.
NEEDS = {
    "cuda": "needs MLX's CUDA backend on an NVIDIA GPU",
    "metal": "needs Apple Silicon Metal",
}


def device_reasons(ctx: KernelContext, platform_name: str) -> list[str]:
    """Why a backend written for ``platform_name`` ("cuda" or "metal") cannot run in ``ctx``:
    another platform (naming this machine), or an activation dtype it has no kernel for."""

    reasons = []
    if ctx.platform != platform_name:
        reasons.append(
            f"{NEEDS[platform_name]} (this machine: {platform.system()} {platform.machine()}, "
            f"MLX {ctx.device} device, {ctx.platform} platform)"
        )
    if ctx.dtype not in FLOAT_DTYPES:
        reasons.append(f"activation dtype {ctx.dtype} is not one of {', '.join(FLOAT_DTYPES)}")
    return reasons


@hookimpl
def mlxr_register_kernels(register: RegisterKernel) -> None:
    """Register every backend of :data:`BACKENDS` for the ops it implements."""
    from mlxr_core.kernels import OPS

    for backend, (module, priority, ops) in BACKENDS.items():
        for op in ops or OPS:
            register(op, backend, f"{module}:{op}_kernel", priority=priority)
