"""The parity check of a kernel backend against the pure-MLX reference (see :func:`check_kernel_parity`).

The reference is :mod:`mlxr_plugins.kernels.reference` itself, not whatever is registered as
``reference``, so a plugin overriding the reference backend is held to the original.
Tolerances (``|backend - reference| <= atol + rtol * |reference|`` on ~N(0, 1) inputs) are about
two roundings in the output dtype, as in mlxr's own parity tests; a backend whose arithmetic
differs by design declares its own (``parity_tolerance``: ``cpu_int8`` rounds its inputs to int8).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxr_core.registry import Registry

DTYPES = ("float32", "float16", "bfloat16")
#: The ops :func:`check_kernel_parity` has cases for.
PARITY_OPS = (
    "attention", "rms_norm", "add_rms_norm", "rope", "gated_activation", "quantized_matmul",
    "gather_matmul", "route", "gated_delta", "kimi_delta", "ssd",
)
#: dtype -> (atol, rtol) per op.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    "attention": {"float32": (1e-5, 1e-5), "float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-6)},
    "rms_norm": {"float32": (5e-6, 1e-5), "float16": (2.0**-10, 2.0**-9), "bfloat16": (2.0**-7, 2.0**-6)},
    "add_rms_norm": {"float32": (5e-6, 1e-5), "float16": (2.0**-10, 2.0**-9), "bfloat16": (2.0**-7, 2.0**-6)},
    "rope": {"float32": (2e-5, 1e-5), "float16": (2.0**-8, 2.0**-9), "bfloat16": (2.0**-5, 2.0**-6)},
    # A backend may compute in the inputs' dtype (mlx_fast's compiled kernel does): a few roundings.
    "gated_activation": {"float32": (1e-6, 1e-5), "float16": (2.0**-10, 2.0**-8), "bfloat16": (2.0**-7, 2.0**-5)},
    # Sums of K = 256..512 products of O(1) terms (outputs of O(20)); a backend may accumulate in
    # the activation dtype, as MLX's fused CPU kernel does.
    "quantized_matmul": {"float32": (1e-3, 1e-4), "float16": (0.4, 2.0**-8), "bfloat16": (3.0, 2.0**-5)},
    "gather_matmul": {"float32": (1e-3, 1e-4), "float16": (0.4, 2.0**-8), "bfloat16": (3.0, 2.0**-5)},
    # Weights are float32 whatever the logits' dtype; indices compare exactly.
    "route": {"float32": (1e-6, 1e-5), "float16": (1e-6, 1e-5), "bfloat16": (1e-6, 1e-5)},
    # Float32 inside whatever the inputs' dtype: the outputs differ by summation order, then by one
    # rounding to the output dtype (the state stays float32).
    "gated_delta": {"float32": (1e-4, 1e-4), "float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-6)},
    "kimi_delta": {"float32": (1e-4, 1e-4), "float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-6)},
    "ssd": {"float32": (1e-4, 1e-4), "float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-6)},
}


@attrs.define
class ParityReport:
    """What :func:`check_kernel_parity` compared (``ran``) and what the backend declined
    (``skipped``: case -> the reasons its ``supports`` gave)."""

    ran: list[str] = attrs.field(factory=list)
    skipped: dict[str, list[str]] = attrs.field(factory=dict)


@attrs.frozen
class Case:
    name: str
    shapes: dict[str, Any]
    #: dtype -> (args, kwargs) of one call.
    make: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]


def check_kernel_parity(
    registry: Registry,
    op: str,
    backend: str,
    *,
    dtypes: Sequence[str] = DTYPES,
) -> ParityReport:
    """Compare backend ``backend`` of ``op`` (as registered in ``registry``, e.g.
    ``load_plugins().registries.kernels``) with the reference over shapes and ``dtypes``.

    Cases the backend declines through ``supports(ctx)`` on this machine are skipped and reported,
    not failed. Raises AssertionError naming the first case that differs beyond tolerance, or whose
    output shape or dtype differs.
    """
    import mlx.core as mx
    import numpy as np

    from mlxr_core.kernels import KernelContext, current_platform
    from mlxr_plugins.kernels import reference

    device, platform = current_platform()
    impl = registry.get(f"{op}:{backend}")
    expected_fn: Callable[..., mx.array] = getattr(reference, op)
    report = ParityReport()
    for dtype_name in dtypes:
        dtype = getattr(mx, dtype_name)
        for case in _cases(op):
            label = f"{op}:{backend} {case.name} {dtype_name}"
            ctx = KernelContext(op=op, device=device, platform=platform, dtype=dtype_name, shapes=case.shapes)
            reasons = list(impl.supports(ctx))
            if reasons:
                report.skipped[label] = reasons
                continue
            args, kwargs = case.make(dtype)
            actual, expected = impl.op(*args, **kwargs), expected_fn(*args, **kwargs)
            if op == "route":  # the top-k come in any order: compare them sorted by expert
                actual, expected = _by_expert(*actual), _by_expert(*expected)  # type: ignore[assignment]
            # An op may return several arrays (add_rms_norm: the sum and its norm).
            actuals = actual if isinstance(actual, tuple) else (actual,)
            expecteds = expected if isinstance(expected, tuple) else (expected,)
            assert len(actuals) == len(expecteds), f"{label}: {len(actuals)} outputs, not {len(expecteds)}"
            for index, (got, want) in enumerate(zip(actuals, expecteds, strict=True)):
                where = f"{label}" if len(actuals) == 1 else f"{label} output {index}"
                assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
                assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
                a, e = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
                atol, rtol = TOLERANCES[op][dtype_name]
                declared = getattr(impl, "parity_tolerance", None)
                if declared and dtype_name in declared:  # arithmetic that differs by design
                    atol, rtol = declared[dtype_name]
                if op == "gather_matmul" and dtype_name == "float32" and device == "gpu":
                    # MLX's CUDA float32 matmuls (gather_mm included) round like TF32: 0.018 off
                    # the float32 reference on an H100 for sums of 128 O(1) products.
                    atol, rtol = 5e-2, 2e-3
                if op == "gated_delta" and dtype_name == "float32" and device == "gpu":
                    # Likewise for the chunked form's matmuls (mlx_fast): its state was 2.5e-4 off
                    # after 70 positions on an H100.
                    atol, rtol = 2e-3, 2e-3
                excess = np.abs(a - e) - (atol + rtol * np.abs(e))
                worst = float(np.nanmax(excess)) if excess.size else 0.0
                assert np.isfinite(a).all() and worst <= 0, (
                    f"{where}: differs from the reference by up to {worst + atol:.3g} "
                    f"(atol {atol:g}, rtol {rtol:g})"
                )
            report.ran.append(label)
    return report


def _by_expert(indices: Any, weights: Any) -> tuple[Any, Any]:
    import mlx.core as mx

    order = mx.argsort(indices, axis=-1)
    return mx.take_along_axis(indices, order, axis=-1), mx.take_along_axis(weights, order, axis=-1)


def _cases(op: str) -> Iterator[Case]:
    import mlx.core as mx
    import numpy as np

    def normal(shape: tuple[int, ...], seed: int, dtype: Any) -> mx.array:
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)

    if op == "attention":
        for Hq, Hkv in ((8, 8), (8, 2)):
            for D in (64, 128):
                for L, S in ((1, 1), (1, 37), (5, 33)):
                    for mask in ("none", "causal", "array"):

                        def make(dtype: Any, Hq: int = Hq, Hkv: int = Hkv, D: int = D, L: int = L,
                                 S: int = S, mask: str = mask) -> tuple[tuple[Any, ...], dict[str, Any]]:
                            q = normal((2, Hq, L, D), 1, dtype)
                            k, v = normal((2, Hkv, S, D), 2, dtype), normal((2, Hkv, S, D), 3, dtype)
                            m: Any = {"none": None, "causal": "causal"}.get(mask)
                            if mask == "array":
                                m = normal((2, 1, L, S), 4, dtype)
                            return (q, k, v), {"scale": D**-0.5, "mask": m}

                        masks = () if mask == "none" else (mask,)
                        shapes = {"head_dim": D, "n_heads": Hq, "n_kv_heads": Hkv, "masks": masks}
                        yield Case(f"Hq={Hq} Hkv={Hkv} D={D} L={L} S={S} mask={mask}", shapes, make)
        # Attention sinks (gpt-oss): one more logit per query head, never masked.
        for L, S, mask in ((1, 37, "causal"), (5, 33, "causal"), (5, 33, "array")):

            def make_sinks(dtype: Any, L: int = L, S: int = S,
                           mask: str = mask) -> tuple[tuple[Any, ...], dict[str, Any]]:
                q = normal((2, 8, L, 64), 1, dtype)
                k, v = normal((2, 2, S, 64), 2, dtype), normal((2, 2, S, 64), 3, dtype)
                m: Any = "causal" if mask == "causal" else normal((2, 1, L, S), 4, dtype)
                return (q, k, v), {"scale": 64**-0.5, "mask": m, "sinks": normal((8,), 5, dtype)}

            shapes = {"head_dim": 64, "n_heads": 8, "n_kv_heads": 2, "masks": (mask,), "sinks": True}
            yield Case(f"Hq=8 Hkv=2 D=64 L={L} S={S} mask={mask} sinks", shapes, make_sinks)
    elif op == "rms_norm":
        for D in (64, 96, 4096):

            def make_norm(dtype: Any, D: int = D) -> tuple[tuple[Any, ...], dict[str, Any]]:
                return (normal((2, 5, D), 5, dtype), normal((D,), 6, dtype), 1e-6), {}

            yield Case(f"D={D}", {"hidden_size": D}, make_norm)
    elif op == "add_rms_norm":
        # Decode rows ([B, 1, D]) and prompt chunks; D below, at and above one block's threads.
        for shape in ((1, 1, 64), (3, 1, 640), (2, 5, 2048), (1, 3, 4096)):

            def make_add_norm(dtype: Any, shape: tuple[int, ...] = shape) -> tuple[tuple[Any, ...], dict[str, Any]]:
                D = shape[-1]
                return (normal(shape, 10, dtype), normal(shape, 11, dtype), normal((D,), 12, dtype), 1e-5), {}

            yield Case(f"shape={shape}", {"hidden_size": shape[-1]}, make_add_norm)
    elif op == "rope":
        # Prompt chunks (L=6) and decode steps (L=1: one position per row, the offset an int, a
        # scalar array, or one per row as a batch of different lengths passes it).
        for D, dims in ((64, 64), (128, 64)):
            for traditional in (False, True):
                for L, offset in ((6, 0), (6, 7), (1, 0), (1, 7), (1, "array"), (1, "rows")):

                    def make_rope(dtype: Any, D: int = D, dims: int = dims, traditional: bool = traditional,
                                  L: int = L, offset: Any = offset) -> tuple[tuple[Any, ...], dict[str, Any]]:
                        x = normal((2, 4, L, D), 7, dtype)
                        at = {"array": mx.array(5), "rows": mx.array([3, 11])}.get(offset, offset)
                        return (x, dims), {"traditional": traditional, "base": 10000.0, "scale": 1.0,
                                           "offset": at}

                    shapes = {"head_dim": D, "rope_dims": dims, "rope_traditional": traditional}
                    name = f"D={D} dims={dims} traditional={traditional} L={L} offset={offset}"
                    yield Case(name, shapes, make_rope)
    elif op == "gated_activation":
        # One decode row, a prompt chunk, an odd width (no whole SIMD vector), the two halves of one
        # fused gate_up projection's output (strided views), and transposed (non-contiguous) rows.
        layouts: tuple[tuple[tuple[int, ...], str], ...] = (
            ((1, 1, 64), "dense"), ((2, 7, 1536), "dense"), ((3, 37), "dense"), ((2, 3, 576), "halves"),
            ((5, 40), "transposed"),
        )
        for extent, layout in layouts:
            for activation in ("silu", "gelu_tanh"):

                def make_gated(dtype: Any, shape: tuple[int, ...] = extent, layout: str = layout,
                               activation: str = activation) -> tuple[tuple[Any, ...], dict[str, Any]]:
                    if layout == "halves":
                        gate, up = mx.split(normal((*shape[:-1], 2 * shape[-1]), 23, dtype) * 3, 2, axis=-1)
                    elif layout == "transposed":
                        gate, up = normal(shape[::-1], 24, dtype).T * 3, normal(shape[::-1], 25, dtype).T
                    else:
                        gate, up = normal(shape, 26, dtype) * 3, normal(shape, 27, dtype)
                    return (gate, up), {"activation": activation}

                yield Case(f"shape={extent} {layout} {activation}", {"activation": activation}, make_gated)
    elif op == "quantized_matmul":
        # Affine packings, then MLX's float modes (no biases; a backend may decline them by mode).
        for L, K, N, bits, group_size, mode in (
            (1, 256, 128, 4, 64, "affine"), (7, 512, 96, 8, 32, "affine"), (16, 256, 64, 4, 32, "affine"),
            (1, 256, 64, 4, 16, "nvfp4"), (7, 256, 96, 8, 32, "mxfp8"), (16, 256, 64, 4, 32, "mxfp4"),
        ):

            def make_qmm(dtype: Any, L: int = L, K: int = K, N: int = N, bits: int = bits,
                         group_size: int = group_size, mode: str = mode) -> tuple[tuple[Any, ...], dict[str, Any]]:
                w, scales, *rest = mx.quantize(normal((N, K), 8, dtype), group_size, bits, mode=mode)
                kwargs = {"transpose": True, "group_size": group_size, "bits": bits, "mode": mode}
                return (normal((L, K), 9, dtype), w, scales, rest[0] if rest else None), kwargs

            packed: dict[str, Any] = {"bits": bits, "group_size": group_size, "quant_mode": mode}
            label = "" if mode == "affine" else f" {mode}"
            yield Case(f"L={L} K={K} N={N} bits={bits} group={group_size}{label}", packed, make_qmm)
    elif op == "gather_matmul":
        # Decode (one token, top-2 of 8 experts), a prompt chunk sorted by expert (as MoE layers
        # pass it from 64 rows), dense and packed experts (affine 4/8-bit, mxfp4, nvfp4, mxfp8).
        for N, k, K, M, packing, sort in (
            (1, 2, 256, 64, None, False), (6, 2, 128, 96, (4, 32, "affine"), False),
            (3, 4, 256, 64, (8, 64, "affine"), False), (40, 2, 128, 64, (4, 32, "affine"), True),
            (4, 2, 128, 64, (4, 32, "mxfp4"), False), (40, 2, 128, 64, None, True),
            (4, 2, 128, 64, (4, 16, "nvfp4"), False), (40, 2, 128, 64, (8, 32, "mxfp8"), True),
        ):

            def make_gmm(dtype: Any, N: int = N, k: int = k, K: int = K, M: int = M,
                         packing: Any = packing, sort: bool = sort) -> tuple[tuple[Any, ...], dict[str, Any]]:
                experts = 8
                w = normal((experts, M, K), 13, dtype)
                indices = mx.array(np.random.default_rng(14).integers(0, experts, (N, k)), dtype=mx.uint32)
                x = normal((N, 1, 1, K), 15, dtype)
                kwargs: dict[str, Any] = {"transpose": True, "sorted_indices": sort}
                if sort:  # one row per (token, expert), ordered by expert
                    flat = indices.flatten()
                    order = mx.argsort(flat)
                    x, indices = x.reshape(N, 1, K)[order // k], flat[order]
                if packing is None:
                    return (x, w, None, None), {**kwargs, "indices": indices}
                bits, group_size, mode = packing
                w, scales, *rest = mx.quantize(w, group_size, bits, mode=mode)
                biases = rest[0] if rest else None
                kwargs.update(group_size=group_size, bits=bits, mode=mode, indices=indices)
                return (x, w, scales, biases), kwargs

            experts_packed: dict[str, Any] = (
                {"bits": packing[0], "group_size": packing[1], "quant_mode": packing[2]} if packing else {}
            )
            name = f"N={N} top-{k} K={K} M={M} {packing or 'dense'}{' sorted' if sort else ''}"
            yield Case(name, experts_packed, make_gmm)
    elif op == "route":
        # One decode token, a few, a prompt chunk; 8 to 300 experts (not a multiple of 32 too).
        for rows, experts, k, scoring, normalize in (
            (1, 128, 8, "softmax", True), (5, 8, 2, "softmax", True), (3, 64, 4, "softmax", False),
            (40, 300, 6, "sigmoid", True), (2, 32, 4, "sigmoid", False),
        ):

            def make_route(dtype: Any, rows: int = rows, experts: int = experts, k: int = k,
                           scoring: str = scoring, normalize: bool = normalize) -> tuple[tuple[Any, ...], dict[str, Any]]:
                # Distinct logits, well apart: a near tie may rank either way in any dtype.
                order = np.random.default_rng(16).permuted(np.tile(np.arange(experts), (rows, 1)), axis=1)
                logits = mx.array(order * (4.0 / experts) - 2.0).astype(dtype)
                return (logits,), {"top_k": k, "scoring": scoring, "normalize": normalize}

            yield Case(f"rows={rows} experts={experts} top-{k} {scoring} normalize={normalize}", {}, make_route)
        # DeepSeek-V3's choice: a correction bias, the best 4 of 8 groups (and of 1: no grouping).
        for rows, experts, k, groups, top_groups in ((1, 256, 8, 8, 4), (24, 64, 6, 8, 4), (3, 16, 2, 1, 1)):

            def make_biased(dtype: Any, rows: int = rows, experts: int = experts, k: int = k, groups: int = groups,
                            top_groups: int = top_groups) -> tuple[tuple[Any, ...], dict[str, Any]]:
                rng = np.random.default_rng(17)
                order = rng.permuted(np.tile(np.arange(experts), (rows, 1)), axis=1)
                logits = mx.array(order * (4.0 / experts) - 2.0).astype(dtype)
                bias = mx.array(rng.permutation(experts) * (0.3 / experts), dtype=mx.float32)
                return (logits,), {"top_k": k, "scoring": "sigmoid", "normalize": True, "bias": bias,
                                   "groups": groups, "top_groups": top_groups}

            name = f"rows={rows} experts={experts} top-{k} biased, {top_groups} of {groups} groups"
            yield Case(name, {}, make_biased)
    elif op == "gated_delta":
        # Decode (one position onto a state), a short prompt, one across a chunk boundary; one and two
        # value heads per key head; head dims the fused kernels take and one they hand on (32).
        for B, L, Hk, Hv, Dk, Dv, with_state in (
            (2, 1, 2, 4, 128, 128, True), (1, 5, 2, 2, 64, 64, False), (1, 70, 2, 4, 128, 64, True),
            (2, 3, 1, 2, 32, 32, True),
        ):

            def make_delta(dtype: Any, B: int = B, L: int = L, Hk: int = Hk, Hv: int = Hv, Dk: int = Dk,
                           Dv: int = Dv, with_state: bool = with_state) -> tuple[tuple[Any, ...], dict[str, Any]]:
                # q and k as the layer hands them over: L2-normalized per head, q scaled by Dk**-0.5.
                q, k = normal((B, L, Hk, Dk), 17, mx.float32), normal((B, L, Hk, Dk), 18, mx.float32)
                q = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5
                k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
                g = -mx.random.uniform(0.0, 0.5, (B, L, Hv), key=mx.random.key(20))
                beta = mx.sigmoid(normal((B, L, Hv), 21, mx.float32)).astype(dtype)
                state = normal((B, Hv, Dk, Dv), 22, mx.float32) if with_state else None
                return (q.astype(dtype), k.astype(dtype), normal((B, L, Hv, Dv), 19, dtype), g, beta, state), {}

            shapes = {"linear_key_head_dim": Dk, "linear_value_head_dim": Dv}
            name = f"B={B} L={L} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}{' state' if with_state else ''}"
            yield Case(name, shapes, make_delta)
    elif op == "kimi_delta":
        # Decode, a short prompt, one across chunk boundaries, from zeros and onto a state.
        for B, L, H, Dk, Dv, with_state in ((2, 1, 2, 64, 32, True), (1, 5, 2, 32, 32, False), (1, 70, 2, 64, 32, True)):

            def make_kimi(dtype: Any, B: int = B, L: int = L, H: int = H, Dk: int = Dk, Dv: int = Dv,
                          with_state: bool = with_state) -> tuple[tuple[Any, ...], dict[str, Any]]:
                return kimi_delta_inputs(B, L, H, Dk, Dv, with_state=with_state, dtype=dtype, seed=L), {}

            name = f"B={B} L={L} H={H} Dk={Dk} Dv={Dv}{' state' if with_state else ''}"
            yield Case(name, {"linear_head_dim": Dk}, make_kimi)
    elif op == "ssd":
        # Decode onto a state, a short prompt from zeros, one across a chunk boundary.
        for B, L, H, P, N, with_state in ((2, 1, 4, 16, 32, True), (1, 5, 2, 8, 16, False), (1, 70, 2, 16, 16, True)):

            def make_ssd(dtype: Any, B: int = B, L: int = L, H: int = H, P: int = P, N: int = N,
                         with_state: bool = with_state) -> tuple[tuple[Any, ...], dict[str, Any]]:
                return ssd_inputs(B, L, H, P, N, with_state=with_state, dtype=dtype, seed=L), {}

            yield Case(f"B={B} L={L} H={H} P={P} N={N}{' state' if with_state else ''}", {}, make_ssd)
    else:
        raise ValueError(f"no parity cases for op {op!r} (ops with cases: {', '.join(PARITY_OPS)})")


def gated_delta_inputs(
    B: int = 1,
    L: int = 5,
    Hk: int = 2,
    Hv: int = 2,
    Dk: int = 64,
    Dv: int = 32,
    *,
    with_state: bool = True,
    dtype: Any = None,
    seed: int = 0,
) -> tuple[Any, ...]:
    """Arguments of ``gated_delta`` as a Gated DeltaNet layer hands them over: q and k
    L2-normalized per head (q scaled by ``Dk ** -0.5``), v, ``g <= 0``, ``beta`` in (0, 1), and a
    float32 state (or None, zeros) drawn from ``seed``; q, k, v and beta in ``dtype`` (float32)."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, L, Hk, Dk), key=keys[0])
    k = mx.random.normal((B, L, Hk, Dk), key=keys[1])
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
    v = mx.random.normal((B, L, Hv, Dv), key=keys[2])
    g = -mx.random.uniform(0.0, 0.5, (B, L, Hv), key=keys[3])
    beta = mx.sigmoid(mx.random.normal((B, L, Hv), key=keys[4]))
    state = mx.random.normal((B, Hv, Dk, Dv), key=keys[5]) if with_state else None
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), state


def kimi_delta_inputs(
    B: int = 1,
    L: int = 5,
    H: int = 2,
    Dk: int = 32,
    Dv: int = 16,
    *,
    with_state: bool = True,
    dtype: Any = None,
    seed: int = 0,
    decay: float = 0.5,
) -> tuple[Any, ...]:
    """Arguments of ``kimi_delta`` as a Kimi delta attention layer hands them over (as
    :func:`gated_delta_inputs`, with ``g`` ``[B, L, H, Dk]`` uniform in ``[-decay, 0]``)."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, L, H, Dk), key=keys[0])
    k = mx.random.normal((B, L, H, Dk), key=keys[1])
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
    v = mx.random.normal((B, L, H, Dv), key=keys[2])
    g = -mx.random.uniform(0.0, decay, (B, L, H, Dk), key=keys[3])
    beta = mx.sigmoid(mx.random.normal((B, L, H), key=keys[4]))
    state = mx.random.normal((B, H, Dk, Dv), key=keys[5]) if with_state else None
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), state


def ssd_inputs(
    B: int = 1,
    L: int = 5,
    H: int = 2,
    P: int = 8,
    N: int = 16,
    *,
    with_state: bool = True,
    dtype: Any = None,
    seed: int = 0,
) -> tuple[Any, ...]:
    """Arguments of ``ssd`` as a Mamba-2 layer hands them over: C and B (``q``, ``k``) and x
    (``v``) after the convolution's SiLU, ``dt`` (``beta``) a softplus, ``g = -A dt`` <= 0, and a
    float32 state (or None) drawn from ``seed``; q, k, v and beta in ``dtype`` (float32)."""
    import mlx.core as mx
    import mlx.nn as nn

    dtype = dtype or mx.float32
    keys = mx.random.split(mx.random.key(seed), 6)
    q, k = (nn.silu(mx.random.normal((B, L, H, N), key=keys[i])) for i in (0, 1))
    v = nn.silu(mx.random.normal((B, L, H, P), key=keys[2]))
    dt = nn.softplus(mx.random.normal((B, L, H), key=keys[3]) - 2.0)
    g = -mx.random.uniform(0.5, 4.0, (H,), key=keys[4]) * dt
    state = mx.random.normal((B, H, P, N), key=keys[5]) if with_state else None
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, dt.astype(dtype), state
