"""Packed-weight quantized matmul for MLX's CPU backend, in C++ (:mod:`mlxr_plugins.kernels.native`).

Decode on a CPU is bound by the bytes of weight read per token. MLX's CPU ``quantized_matmul`` is
a plain loop, so ``cpu_blas`` dequantizes to float32 and streams 8x the bytes through BLAS. This
backend reads MLX's affine packing where it lies (2/3/4/5/6/8 bits, groups of 32/64/128, the
``transpose=True`` layout of linear layers), SIMD over the group (AVX-512, AVX2 or NEON, else plain
C++: ``native/qmm_kernels.h``, each layer checked alone by ``native_kernels_check.cpp``, arm64's
under qemu), threads over output rows, and runs inside MLX's graph as a custom primitive: the same arrays in and out as
``mx.quantized_matmul``. With it, ``quantization: auto`` keeps a model's weights packed on the CPU
(:mod:`mlxr_core.model.quantize`).

The extension is compiled on first use; where it cannot be (no compiler, no headers, not Linux),
``supports()`` says why and ``auto`` takes ``cpu_blas``. Calls it does not cover (other modes,
``transpose=False``, no biases) go to ``cpu_blas``'s path. The mixture-of-experts form
(``gather_matmul``) is the same kernel run once per row on the row's expert, read in place in the
stack; dense experts and the other cases go to ``mlx_fast``'s ``mx.gather_qmm`` / ``mx.gather_mm``.

The rest of a decode step's ops are C++ primitives too (``ops.cpp``): RMS norm (alone and after a
residual add), RoPE and attention over the cache, in float32. MLX's CPU backend runs their
``mx.fast`` forms as composed fallbacks (~5, ~20 and ~13 primitives), and in a one-token step of a
small model those cost about as much as the weights' reads. One primitive each: SmolLM2-135M's decode
step on a 2-core x86-64 from 30-34 ms to 23-25 ms (compiled or eager, load under 1). Attention at one
query over 160 cached positions (9/3 heads, D=64) takes 41 us against the fallback's 130 us, and
stays ahead up to prompts (128 queries over 128 keys: 3.5 vs 5.8 ms; 512 over 512: 42 vs 75 ms).
Other dtypes, attention sinks and shapes they do not take go to ``mlx_fast`` (RoPE to ``cpu_blas``).
The attention kernel also writes a step's keys and values into a layer cache's buffers in the same
primitive (:meth:`Attention.into_cache`, which :class:`mlxr_core.model.cache.KVCache` and the
batch cache call through ``write_and_attend``): two slice updates and two slices fewer per layer
and token (SmolLM2's decode step: 594 primitives to 474), the buffers donated as a slice update's
are.

So is the MLP's gated activation, ``silu(gate) * up`` or ``gelu_tanh(gate) * up``, where MLX's
cost is its scalar exp (24-37 ns an element: ~40% of a 128-token prompt of SmolLM2 or Gemma 3
270M): a SIMD exp within a few float32 ulp, the halves of a fused ``gate_up_proj`` read where they
lie, float32, float16 or bfloat16. 128 rows of 1536 take 0.1 ms against MLX's 6.5 ms.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_core.kernels import KernelContext
from mlxr_plugins.kernels import FLOAT_DTYPES, KernelImpl, cpu_blas, mlx_fast, native

#: Activation dtypes of the C++ gated activation (the other ops take float32 only).
NATIVE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
#: Widths and group sizes the C++ kernel reads (every affine format MLX makes).
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    int8: bool = False,
) -> mx.array:
    """``mx.quantized_matmul`` for MLX's affine packing with ``transpose``, in C++; anything
    else through ``cpu_blas``. ``int8``: see :mod:`mlxr_plugins.kernels.cpu_int8`."""
    module, _ = native.load()
    if (
        module is None
        or mode != "affine"
        or biases is None
        or not transpose
        or bits not in BITS
        or group_size not in GROUP_SIZES
    ):
        return cpu_blas.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
        )
    out: mx.array = module.quantized_matmul(x, w, scales, biases, group_size, bits, int8)
    return out


def _support(ctx: KernelContext) -> list[str]:
    reasons = []
    if ctx.device != "cpu":
        reasons.append(f"for MLX's CPU backend (this context: {ctx.device} device)")
    if ctx.dtype not in FLOAT_DTYPES:
        reasons.append(f"activation dtype {ctx.dtype} is not one of {', '.join(FLOAT_DTYPES)}")
    if not reasons:  # build only where it would run
        _, why = native.load()
        if why:
            reasons.append(f"the native extension is unavailable: {why}")
    return reasons


def gather_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    *,
    indices: mx.array,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
    sorted_indices: bool = False,
    int8: bool = False,
) -> mx.array:
    """``mx.gather_qmm(x, w, ..., rhs_indices=indices)`` for MLX's affine packing with
    ``transpose``, in C++ (each row's expert read in place); anything else through ``mlx_fast``.
    ``int8``: see :mod:`mlxr_plugins.kernels.cpu_int8`."""
    module, _ = native.load()
    if (
        module is None
        or scales is None
        or biases is None
        or mode != "affine"
        or not transpose
        or bits not in BITS
        or group_size not in GROUP_SIZES
    ):
        return mlx_fast.gather_matmul(
            x, w, scales, biases, indices=indices, transpose=transpose, group_size=group_size,
            bits=bits, mode=mode, sorted_indices=sorted_indices,
        )
    batch = mx.broadcast_shapes(x.shape[:-2], indices.shape)
    x = mx.broadcast_to(x, (*batch, *x.shape[-2:]))
    indices = mx.broadcast_to(indices, batch).astype(mx.uint32)
    out: mx.array = module.gather_matmul(x, w, scales, biases, indices, group_size, bits, int8)
    return out


#: Read by :func:`mlxr_core.kernels.bind_kernels`: this backend multiplies packed weights at least
#: as fast as dense ones, so ``quantization: auto`` keeps them packed on the CPU.
quantized_matmul_kernel = KernelImpl(
    quantized_matmul,
    _support,
    summary=(
        "packed affine weights read in place (C++ custom primitive, SIMD, threads over output "
        "rows); other modes via cpu_blas"
    ),
    keeps_packed=True,
)
gather_matmul_kernel = KernelImpl(
    gather_matmul,
    _support,
    summary="packed experts read in place, one row at a time on its expert (C++); dense via mlx_fast",
)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` as one primitive for float32; other dtypes through ``mx.fast``."""
    module, _ = native.load()
    if module is None or x.dtype != mx.float32 or weight.dtype != mx.float32 or weight.shape != x.shape[-1:]:
        return mx.fast.rms_norm(x, weight, eps)
    out: mx.array = module.rms_norm(x, weight, eps)
    return out


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """``h = x + residual`` and its RMS norm as one primitive for float32; else ``mlx_fast``'s."""
    module, _ = native.load()
    if (
        module is None
        or not x.dtype == residual.dtype == weight.dtype == mx.float32
        or residual.shape != x.shape
        or weight.shape != x.shape[-1:]
    ):
        return mlx_fast.add_rms_norm(x, residual, weight, eps)
    h, normed = module.add_rms_norm(x, residual, weight, eps)
    return h, normed


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool = False,
    base: float | None = None,
    scale: float = 1.0,
    offset: int | mx.array = 0,
    freqs: mx.array | None = None,
) -> mx.array:
    """``mx.fast.rope`` of ``[B, N, T, D]`` float32 as one primitive; anything else through
    ``cpu_blas``."""
    module, _ = native.load()
    if (
        module is None
        or x.ndim != 4
        or x.dtype != mx.float32
        or (freqs is None and base is None)
        or (freqs is not None and freqs.dtype != mx.float32)
        or (isinstance(offset, mx.array) and offset.size not in (1, x.shape[0]))
    ):
        return cpu_blas.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    elif offset.dtype != mx.int32:
        offset = offset.astype(mx.int32)
    out: mx.array = module.rope(
        x, dims, traditional, 0.0 if base is None else base, scale, offset.reshape(-1), freqs
    )
    return out


def _native_attention_takes(q: mx.array, k: mx.array, v: mx.array, mask: str | mx.array | None) -> bool:
    """Whether the C++ attention takes these operands (float32, a bool/float32 mask or causal)."""
    array_mask = isinstance(mask, mx.array)
    return (
        q.dtype == k.dtype == v.dtype == mx.float32
        and not (array_mask and (mask.dtype not in (mx.bool_, mx.float32) or mask.ndim > 4))  # type: ignore[union-attr]
        and (mask is None or array_mask or mask == "causal")
    )


class Attention:
    """``mx.fast.scaled_dot_product_attention`` (bottom-right causal mask) as one primitive for
    float32 without sinks; anything else through ``mlx_fast``. :meth:`into_cache` also writes a
    decode step's keys and values into a cache's buffers, in the same primitive."""

    def __call__(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        *,
        scale: float,
        mask: str | mx.array | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        module, _ = native.load()
        if module is None or sinks is not None or not _native_attention_takes(q, k, v, mask):
            return mlx_fast.attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
        out: mx.array = module.attention(q, k, v, scale, mask == "causal", mask if isinstance(mask, mx.array) else None)
        return out

    def into_cache(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        k_cache: mx.array,
        v_cache: mx.array,
        start: int,
        *,
        scale: float,
        mask: str | mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array] | None:
        """``k``, ``v`` (``[B, Hkv, L, D]``) written into the buffers ``k_cache``, ``v_cache``
        (``[B, Hkv, C, D]``) at ``start``, and attention of ``q`` over their first ``start + L``
        positions, as one primitive: ``(out, k_cache, v_cache)``, the buffers updated in place
        where the cache holds them alone (see :meth:`mlxr_core.model.cache.KVCache.write_and_attend`).
        None where the operands are not the C++ attention's (the caller then writes and attends
        apart)."""
        module, _ = native.load()
        if (
            module is None
            or not _native_attention_takes(q, k, v, mask)
            or not k_cache.dtype == v_cache.dtype == mx.float32
        ):
            return None
        array_mask = mask if isinstance(mask, mx.array) else None
        out, keys, values = module.attention_into_cache(q, k, v, k_cache, v_cache, start, scale, mask == "causal", array_mask)
        return out, keys, values


#: The C++ attention (a callable object: :meth:`Attention.into_cache` rides along with the kernel).
attention = Attention()


def gated_activation(gate: mx.array, up: mx.array, *, activation: str) -> mx.array:
    """``act(gate) * up`` (``silu`` or ``gelu_tanh``) as one primitive, SIMD exp, gate and up
    read through their strides (the halves of a fused ``gate_up_proj``: no copy); else
    ``mlx_fast``'s."""
    module, _ = native.load()
    if module is None or gate.dtype != up.dtype or gate.dtype not in NATIVE_DTYPES or gate.shape != up.shape:
        return mlx_fast.gated_activation(gate, up, activation=activation)
    out: mx.array = module.gated_activation(gate, up, activation)
    return out


def _attention_support(ctx: KernelContext) -> list[str]:
    return _support(ctx) + mlx_fast.attention_kernel.supports(ctx)


rms_norm_kernel = KernelImpl(rms_norm, _support, summary="float32 RMS norm as one primitive (C++); else mx.fast")
add_rms_norm_kernel = KernelImpl(
    add_rms_norm, _support, summary="float32 residual add + RMS norm as one primitive (C++); else mlx_fast"
)
rope_kernel = KernelImpl(rope, _support, summary="float32 RoPE as one primitive (C++); else cpu_blas")
gated_activation_kernel = KernelImpl(
    gated_activation,
    _support,
    summary="silu(gate) * up or gelu_tanh(gate) * up as one primitive (C++, SIMD exp, strided halves in place)",
)
attention_kernel = KernelImpl(
    attention,
    _attention_support,
    summary="float32 attention without sinks as one primitive (C++, GQA, causal or array mask); else mx.fast",
)
