"""Decode attention on MLX's CUDA backend: parity of the ``cuda`` kernel, its speed against
``mx.fast.scaled_dot_product_attention`` in the same run, and decode tokens/s end to end.

    python bench/kernels/decode_attention.py [--out DIR] [--sections parity,attention,masked,e2e]

(default: parity,attention,masked)

Run on the GPU machine (see bench/kernels/README.md for the exact command). Sections:

- ``parity``: the ``cuda`` backend, and ``mx.fast`` beside it, against float64 attention computed
  with NumPy, over float32/float16/bfloat16, GQA ratios 1/4/8 (and 6, 16), head dims 64/128/256,
  sequence lengths 1/37/1000/4097, batch 1 and 3, three K/V layouts (contiguous; a
  ``[..., :S, :]`` view of a larger cache buffer, as the KV cache hands it over; a transposed
  buffer whose feature stride is not 1, which takes the scalar-load path) and softly/sharply
  peaked scores. Tolerance: ``|out - exact| <= atol + rtol * |exact|`` with the CPU test suite's
  per-dtype values (float32's scaled by the peak factor: its error follows the scores' size). Then masked decode (the backend's op, which fuses it) against float64 attention under the same
  masks: per-row padding (boolean and additive), a window, one row's mask over the batch. Prefill
  (L > 1), and unmasked decode through the backend's op, are checked to be exactly ``mx.fast``.
- ``attention``: B=1, 32 query heads, 8 KV heads, D=128, bfloat16, contexts 1k/4k/8k/32k, and
  batch 8; plus D=64 (Llama 3.2 1B) at 4k. Time per call, ratio to ``mx.fast``, and the fraction of
  the copy bandwidth measured in the same run (bytes of K+V read / time). K/V are views of a
  cache buffer (the real case); ``mx.fast`` is also timed on contiguous arrays, and the fused
  kernel on a contiguous copy made inside the call (what ``ensure_row_contiguous=True`` would
  cost). Inputs rotate over enough sets to exceed L2.
- ``masked``: batched decode under a padding mask (rows that joined the batch at different steps),
  Llama-3.2-1B heads, B 8/32, contexts 400 to 8k: ``mx.fast`` with the mask against the backend's
  op, which fuses masked decode.
- ``e2e``: a Llama-3.2-1B-shaped model (random bfloat16 weights), 4096 tokens prefilled, then
  greedy decode with ``kernels: {attention: cuda}`` and ``{attention: mlx_fast}``, alternating.
  Since the backend's op hands unmasked decode to mx.fast, the two now run the same kernels; the
  section is kept for the results measured before that (bench/kernels/README.md).

Timing: a batch of calls is built lazily, then ``mx.eval`` runs it; the median over repeats of
(wall time / calls) is reported. Graph building is outside the timed region and reported apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_plugins.kernels import cuda, reference

TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-6)}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
L2_BYTES = 60e6  # H200 60 MB, H100 50 MB: rotate over at least 4x this


def log(*parts: Any) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------------------------
# parity


def exact_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None
) -> np.ndarray:
    """float64 attention of one query position, GQA by head index (query head h -> h // R),
    under an optional boolean (false hides) or additive mask broadcasting to ``[B, Hq, 1, S]``."""
    qn, kn, vn = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    R = qn.shape[1] // kn.shape[1]
    kg = np.repeat(kn, R, axis=1)  # [B, Hq, S, D]
    vg = np.repeat(vn, R, axis=1)
    scores = scale * np.einsum("bhld,bhsd->bhls", qn, kg)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = np.where(np.array(mask), scores, -np.inf)
        else:
            scores = scores + np.array(mask.astype(mx.float32), dtype=np.float64)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.asarray(np.einsum("bhls,bhsd->bhld", weights, vg))


def make_kv(
    B: int, Hkv: int, S: int, D: int, dtype: mx.Dtype, layout: str, key: mx.array
) -> tuple[mx.array, mx.array]:
    """K and V ``[B, Hkv, S, D]`` as a contiguous array, a cache view or a transposed buffer."""
    keys = mx.random.split(key, 2)
    if layout == "contiguous":
        k = mx.random.normal((B, Hkv, S, D), key=keys[0]).astype(dtype)
        v = mx.random.normal((B, Hkv, S, D), key=keys[1]).astype(dtype)
    elif layout == "cache_view":  # KVCache: capacity in steps of 256, attention sees [:S]
        capacity = -(-(S + 1) // 256) * 256
        k = mx.random.normal((B, Hkv, capacity, D), key=keys[0]).astype(dtype)[..., :S, :]
        v = mx.random.normal((B, Hkv, capacity, D), key=keys[1]).astype(dtype)[..., :S, :]
    elif layout == "transposed":  # feature stride S: the scalar-load path
        k = mx.random.normal((B, Hkv, D, S), key=keys[0]).astype(dtype).swapaxes(-1, -2)
        v = mx.random.normal((B, Hkv, D, S), key=keys[1]).astype(dtype).swapaxes(-1, -2)
    else:
        raise ValueError(layout)
    mx.eval(k, v)
    return k, v


def max_error(out: mx.array, exact: np.ndarray, atol: float, rtol: float) -> tuple[float, bool]:
    """(max |out - exact|, whether every element is finite and within atol + rtol * |exact|)."""
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    excess = np.abs(got - exact) - (atol + rtol * np.abs(exact))
    return float(np.abs(got - exact).max()), bool(np.isfinite(got).all() and excess.max() <= 0)


def parity(results: dict[str, Any], smoke: bool = False) -> None:
    cases = []
    lengths = [1, 37] if smoke else [1, 37, 1000, 4097]
    for dtype_name in DTYPES:
        for Hq, Hkv in [(8, 8), (8, 2), (8, 1)]:
            for D in cuda.FUSED_HEAD_DIMS:
                for S in lengths:
                    cases.append((dtype_name, Hq, Hkv, D, S, 1, "cache_view", 1.0))
    # GQA ratios 6 and 16: a block of 6 heads, and two blocks sharing one KV head.
    for Hq, Hkv in [(12, 2), (32, 2)]:
        cases.append(("bfloat16", Hq, Hkv, 128, 1000, 2, "cache_view", 1.0))
        cases.append(("float32", Hq, Hkv, 128, 1000, 2, "cache_view", 1.0))
    for dtype_name in DTYPES:
        for layout in ["contiguous", "cache_view", "transposed"]:
            for sharpness in [1.0, 8.0]:
                cases.append((dtype_name, 32, 8, 128, 1000, 3, layout, sharpness))
    rows: list[dict[str, Any]] = []
    failures = 0
    for index, (dtype_name, Hq, Hkv, D, S, B, layout, sharpness) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        key = mx.random.key(index)
        qkey, kvkey = mx.random.split(key, 2)
        q = (sharpness * mx.random.normal((B, Hq, 1, D), key=qkey)).astype(dtype)
        k, v = make_kv(B, Hkv, S, D, dtype, layout, kvkey)
        scale = D**-0.5
        exact = exact_attention(q, k, v, scale)
        plan = cuda.decode_plan(q, k, v, scale=scale, mask=None)
        fused = cuda.fused_attention(q, k, v, scale=scale, mask=None)
        causal = cuda.fused_attention(q, k, v, scale=scale, mask="causal")
        fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        ref = reference.attention(q, k, v, scale=scale)
        mx.eval(fused, causal, fast, ref)
        atol, rtol = TOL[dtype_name]
        if dtype_name == "float32":  # float32 score errors grow with the scores' magnitude
            atol, rtol = atol * sharpness, rtol * sharpness

        fused_err, fused_ok = max_error(fused, exact, atol, rtol)
        fast_err, _ = max_error(fast, exact, atol, rtol)
        ref_err, _ = max_error(ref, exact, atol, rtol)
        same_causal = bool(mx.array_equal(fused, causal).item())
        ok = fused_ok and same_causal and not isinstance(plan, str) and fused.shape == q.shape
        failures += not ok
        row: dict[str, Any] = {
            "dtype": dtype_name, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S, "layout": layout,
            "sharpness": sharpness, "fused": not isinstance(plan, str),
            "heads_per_block": None if isinstance(plan, str) else plan.heads_per_block,
            "n_splits": None if isinstance(plan, str) else plan.n_splits,
            "max_err_cuda": fused_err, "max_err_mx_fast": fast_err, "max_err_reference": ref_err,
            "causal_equals_none": same_causal, "ok": ok,
        }
        rows.append(row)
        if not ok:
            log("PARITY FAIL", row)
    failures += masked_parity(rows)
    # Delegation: prefill, and unmasked decode through the backend's op, are exactly mx.fast.
    delegated = []
    for L, mask_kind, op in [(4, "causal", "fused"), (7, None, "fused"), (1, None, "op"),
                             (1, "causal", "op")]:
        q = mx.random.normal((1, 8, L, 128)).astype(mx.bfloat16)
        k, v = make_kv(1, 2, 64, 128, mx.bfloat16, "cache_view", mx.random.key(99))
        call = cuda.fused_attention if op == "fused" else cuda.attention
        same = bool(
            mx.array_equal(
                call(q, k, v, scale=0.1, mask=mask_kind),
                mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask_kind),
            ).item()
        )
        delegated.append({"L": L, "mask": mask_kind, "call": op, "equals_mx_fast": same})
        failures += not same
    results["parity"] = {"cases": rows, "delegated": delegated, "failures": failures}
    worst: dict[str, float] = {}
    for row in rows:
        worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), row["max_err_cuda"])
    log(f"parity: {len(rows)} fused cases + {len(delegated)} delegated, {failures} failures; "
        f"worst |cuda - exact| per dtype: {worst}")


def padding_mask(B: int, S: int, seed: int, kind: str = "bool") -> mx.array:
    """A batch cache's mask: row ``i`` sees its last ``S - pad_i`` keys (``[B, 1, 1, S]``), as
    boolean or additive (0 / -inf in bfloat16); row 0 has no padding."""
    rng = np.random.default_rng(seed)
    pads = np.concatenate([[0], rng.integers(0, max(1, S // 2), size=B - 1)])
    visible = np.arange(S)[None, :] >= pads[:, None]
    mask = mx.array(visible)[:, None, None, :]
    if kind == "additive":
        return mx.where(mask, mx.array(0.0), mx.array(-math.inf)).astype(mx.bfloat16)
    return mask


def masked_parity(rows: list[dict[str, Any]]) -> int:
    """The fused kernel under array masks (the backend's op, which fuses them) against float64
    attention under the same mask: per-row padding as boolean and additive masks, a window mask
    shared by every row (``[1, S]``, as a sliding-window layer gives it), and a mask of one row
    broadcast over the batch. Returns the failures; appends a row per case to ``rows``."""
    failures = 0
    cases = []
    for dtype_name in DTYPES:
        for kind in ("bool", "additive"):
            cases.append((dtype_name, 3, 32, 8, 64, 300, kind))
    cases += [("bfloat16", 32, 32, 8, 64, 411, "bool"), ("bfloat16", 2, 8, 2, 128, 1000, "window"),
              ("float16", 4, 8, 8, 256, 37, "one_row")]
    for index, (dtype_name, B, Hq, Hkv, D, S, kind) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        qkey, kvkey = mx.random.split(mx.random.key(500 + index), 2)
        q = mx.random.normal((B, Hq, 1, D), key=qkey).astype(dtype)
        k, v = make_kv(B, Hkv, S, D, dtype, "cache_view", kvkey)
        if kind == "window":  # the last 256 keys
            mask = (mx.arange(S) >= S - 256)[None, :]
        elif kind == "one_row":  # [1, 1, 1, S]: the same padding for every row
            mask = mx.arange(S)[None, None, None, :] >= 5
        else:
            mask = padding_mask(B, S, index, kind)
            if dtype_name != "bfloat16" and kind == "additive":
                mask = mask.astype(dtype)
        scale = D**-0.5
        exact = exact_attention(q, k, v, scale, mask)
        plan = cuda.decode_plan(q, k, v, scale=scale, mask=mask)
        out = cuda.attention(q, k, v, scale=scale, mask=mask)
        fast = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        atol, rtol = TOL[dtype_name]
        err, ok = max_error(out, exact, atol, rtol)
        fast_err, _ = max_error(fast, exact, atol, rtol)
        ok = ok and not isinstance(plan, str) and out.shape == q.shape
        failures += not ok
        row = {"dtype": dtype_name, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S, "mask": kind,
               "fused": not isinstance(plan, str), "max_err_cuda": err,
               "max_err_mx_fast": fast_err, "ok": ok}
        rows.append(row)
        if not ok:
            log("MASKED PARITY FAIL", row, plan if isinstance(plan, str) else "")
    return failures


# --------------------------------------------------------------------------------------------
# timing


def timed(
    make_outputs: Callable[[int], list[mx.array]], calls: int, repeats: int = 7
) -> tuple[float, float]:
    """(median seconds per call of evaluation, seconds per call of graph building)."""
    mx.eval(make_outputs(min(calls, 4)))  # warm-up: JIT compilation, allocator
    evals, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = make_outputs(calls)
        t1 = time.perf_counter()
        mx.eval(outputs)
        t2 = time.perf_counter()
        builds.append((t1 - t0) / calls)
        evals.append((t2 - t1) / calls)
    return statistics.median(evals), statistics.median(builds)


def copy_bandwidth(smoke: bool = False) -> float:
    """Bytes read + written per second by an elementwise op over 512 MiB of bfloat16."""
    x = mx.random.normal((1024 if smoke else 256 * 1024 * 1024,)).astype(mx.bfloat16)
    mx.eval(x)
    seconds, _ = timed(lambda n: [x + float(i) for i in range(n)], calls=8)
    return 2 * x.nbytes / seconds


Triple = tuple[mx.array, mx.array, mx.array]
Call = Callable[[mx.array, mx.array, mx.array], mx.array]


def fast_call(scale: float) -> Call:
    """``mx.fast.scaled_dot_product_attention`` with no mask."""
    return functools.partial(_fast, scale=scale)


def _fast(q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def fused_call(scale: float, target: int, keys_per_step: int | None = None) -> Call:
    """The fused kernel with a given split target and rows per step (asserting it is fused)."""
    return functools.partial(_fused, scale=scale, target=target, keys_per_step=keys_per_step)


def _fused(q: mx.array, k: mx.array, v: mx.array, *, scale: float, target: int,
           keys_per_step: int | None) -> mx.array:
    plan = cuda.decode_plan(q, k, v, scale=scale, mask=None, target_blocks=target,
                            keys_per_step=keys_per_step)
    assert not isinstance(plan, str), plan
    return cuda.flash_decode(q, k, v, plan=plan)


def copy_first_call(scale: float) -> Call:
    """The fused kernel on row-contiguous copies: what ``ensure_row_contiguous=True`` costs."""
    return functools.partial(_copy_first, scale=scale)


def _copy_first(q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
    return cuda.fused_attention(q, mx.contiguous(k), mx.contiguous(v), scale=scale)


def rotating_sets(B: int, Hq: int, Hkv: int, D: int, S: int, dtype: mx.Dtype, seed: int) -> list[Triple]:
    """Enough (q, K/V cache views) input sets that rotating over them exceeds the L2 cache."""
    n_sets = max(2, math.ceil(4 * L2_BYTES / (2 * B * Hkv * S * D * 2)))
    sets = []
    for i in range(n_sets):
        q = mx.random.normal((B, Hq, 1, D), key=mx.random.key(seed + i)).astype(dtype)
        k, v = make_kv(B, Hkv, S, D, dtype, "cache_view", mx.random.key(seed + 1000 + i))
        sets.append((q, k, v))
    return sets


def batch(fn: Call, data: list[Triple]) -> Callable[[int], list[mx.array]]:
    """``n`` calls of ``fn``, rotating over ``data``, built lazily."""
    return lambda n: [fn(*data[i % len(data)]) for i in range(n)]


def bench_attention(results: dict[str, Any], bandwidth: float, smoke: bool = False) -> None:
    shapes = [(1, 32, 8, 128, S) for S in (1024, 4096, 8192, 32768)]
    shapes += [(8, 32, 8, 128, S) for S in (1024, 4096, 8192)]
    shapes += [(1, 32, 8, 64, 4096)]
    if smoke:
        shapes = [(1, 8, 2, 64, 300)]
    rows = []
    for B, Hq, Hkv, D, S in shapes:
        dtype = mx.bfloat16
        kv_bytes = 2 * B * Hkv * S * D * 2
        sets = rotating_sets(B, Hq, Hkv, D, S, dtype, seed=1000)
        n_sets = len(sets)
        contiguous = [(q, mx.contiguous(k), mx.contiguous(v)) for q, k, v in sets]
        mx.eval(contiguous)
        scale = D**-0.5
        calls = 8 if smoke else 200

        fast = fast_call(scale)

        fused = functools.partial(fused_call, scale)

        # Correctness of this very configuration before timing it.
        q, k, v = sets[0]
        diff = mx.abs(cuda.fused_attention(q, k, v, scale=scale).astype(mx.float32)
                      - fast(q, k, v).astype(mx.float32)).max().item()
        row: dict[str, Any] = {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S, "dtype": "bfloat16",
                               "kv_bytes": kv_bytes, "rotating_sets": n_sets, "calls": calls,
                               "max_abs_diff_vs_mx_fast": diff}
        variants: dict[str, tuple[Call, list[Triple]]] = {
            "mx_fast_view": (fast, sets),
            "mx_fast_contiguous": (fast, contiguous),
            "cuda_view": (fused(cuda.TARGET_BLOCKS), sets),
            "cuda_view_t132": (fused(132), sets),
            "cuda_view_t528": (fused(528), sets),
            "cuda_view_u2": (fused(cuda.TARGET_BLOCKS, 2), sets),
            "cuda_view_u8": (fused(cuda.TARGET_BLOCKS, 8), sets),
            "cuda_contiguous": (fused(cuda.TARGET_BLOCKS), contiguous),
            "cuda_copy_first": (copy_first_call(scale), sets),
        }
        for name, (fn, data) in variants.items():
            seconds, build = timed(batch(fn, data), calls)
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_build_us"] = build * 1e6
            row[f"{name}_bw_fraction"] = kv_bytes / seconds / bandwidth
        # One call at a time, each waited for: what a caller that evaluates every call sees
        # (launch and synchronization included).
        sync_calls: tuple[tuple[str, Call], ...] = (
            ("mx_fast", fast), ("cuda", fused(cuda.TARGET_BLOCKS)))
        for name, fn in sync_calls:
            latencies = []
            for i in range(30):
                q, k, v = sets[i % n_sets]
                t0 = time.perf_counter()
                mx.eval(fn(q, k, v))
                latencies.append(time.perf_counter() - t0)
            row[f"{name}_sync_us"] = statistics.median(latencies[5:]) * 1e6
        plan = cuda.decode_plan(*sets[0], scale=scale, mask=None)
        row["n_splits"] = None if isinstance(plan, str) else plan.n_splits
        row["speedup_vs_mx_fast_view"] = row["mx_fast_view_us"] / row["cuda_view_us"]
        row["speedup_vs_mx_fast_contiguous"] = row["mx_fast_contiguous_us"] / row["cuda_view_us"]
        rows.append(row)
        log(f"B={B} S={S:6d} D={D}: mx.fast {row['mx_fast_view_us']:8.1f} us (view) "
            f"{row['mx_fast_contiguous_us']:8.1f} us (contig) | cuda {row['cuda_view_us']:7.1f} us "
            f"(t132 {row['cuda_view_t132_us']:.1f}, t528 {row['cuda_view_t528_us']:.1f}, "
            f"u2 {row['cuda_view_u2_us']:.1f}, "
            f"u8 {row['cuda_view_u8_us']:.1f}; copy-first {row['cuda_copy_first_us']:.1f}) "
            f"sync: mx.fast {row['mx_fast_sync_us']:.1f} cuda {row['cuda_sync_us']:.1f} | "
            f"x{row['speedup_vs_mx_fast_view']:.2f}, {100 * row['cuda_view_bw_fraction']:.0f}% bw, "
            f"diff {diff:.3g}")
        del sets, contiguous
    results["attention"] = rows


def bench_masked(results: dict[str, Any], smoke: bool = False) -> None:
    """Batched decode under a padding mask (rows of different lengths), Llama-3.2-1B heads:
    ``mx.fast`` with the mask (boolean and additive), the backend's op (the fused kernel), and
    ``mx.fast`` without a mask for scale. Per call: device-bound time of queued calls, graph
    building, and one call waited for."""
    shapes = [(8, 400), (32, 400), (32, 2048), (8, 8192)] if not smoke else [(4, 50)]
    Hq, Hkv, D, dtype = (32, 8, 64, mx.bfloat16) if not smoke else (8, 2, 64, mx.bfloat16)
    scale = D**-0.5
    rows = []
    for B, S in shapes:
        kv_bytes = 2 * B * Hkv * S * D * 2
        sets = rotating_sets(B, Hq, Hkv, D, S, dtype, seed=3000)
        n_sets = len(sets)
        masks = {"bool": padding_mask(B, S, B + S), "additive": padding_mask(B, S, B + S, "additive")}
        mx.eval(masks)
        q, k, v = sets[0]
        diff = mx.abs(
            cuda.attention(q, k, v, scale=scale, mask=masks["bool"]).astype(mx.float32)
            - mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=masks["additive"])
            .astype(mx.float32)
        ).max().item()
        sdpa = mx.fast.scaled_dot_product_attention
        variants: dict[str, Call] = {
            "mx_fast_bool": functools.partial(sdpa, scale=scale, mask=masks["bool"]),
            "mx_fast_additive": functools.partial(sdpa, scale=scale, mask=masks["additive"]),
            "cuda_bool": functools.partial(cuda.attention, scale=scale, mask=masks["bool"]),
            "cuda_additive": functools.partial(cuda.attention, scale=scale, mask=masks["additive"]),
            "mx_fast_unmasked": fast_call(scale),
        }
        row: dict[str, Any] = {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S, "kv_bytes": kv_bytes,
                               "max_abs_diff_cuda_vs_mx_fast": diff}
        calls = 8 if smoke else 200
        for name, fn in variants.items():
            seconds, build = timed(batch(fn, sets), calls)
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_build_us"] = build * 1e6
            latencies = []
            for i in range(30):
                t0 = time.perf_counter()
                mx.eval(fn(*sets[i % n_sets]))
                latencies.append(time.perf_counter() - t0)
            row[f"{name}_sync_us"] = statistics.median(latencies[5:]) * 1e6
        row["speedup_bool"] = row["mx_fast_bool_us"] / row["cuda_bool_us"]
        row["speedup_bool_sync"] = row["mx_fast_bool_sync_us"] / row["cuda_bool_sync_us"]
        rows.append(row)
        log(f"masked B={B} S={S}: " + ", ".join(
            f"{name} {row[name + '_us']:.1f} us (build {row[name + '_build_us']:.1f}, "
            f"sync {row[name + '_sync_us']:.1f})" for name in variants
        ) + f" | x{row['speedup_bool']:.2f} queued, x{row['speedup_bool_sync']:.2f} waited, "
            f"diff {diff:.3g}")
        del sets
    results["masked"] = rows


# --------------------------------------------------------------------------------------------
# kernel time under Nsight Compute

PROFILE_SHAPES = [(1, 32, 8, 128, 1024), (1, 32, 8, 128, 8192), (1, 32, 8, 128, 32768),
                  (8, 32, 8, 128, 8192), (1, 32, 8, 64, 4096)]


@functools.cache
def _marker_kernel() -> Any:
    return mx.fast.cuda_kernel(name="mlxr_marker", input_names=["x"], output_names=["y"],
                               source="y[0] = x[0] + ID;")


def profile(out: Path) -> None:
    """Each call once per repeat, preceded by a marker kernel named after its index, for
    ``ncu`` to time every kernel of the call alone (cold L2, real clocks); see --summarize-ncu."""
    x = mx.zeros((1,))
    mx.eval(x)

    def marker(index: int) -> None:
        mx.eval(_marker_kernel()(inputs=[x], template=[("ID", index)], grid=(1, 1, 1),
                                 threadgroup=(1, 1, 1), output_shapes=[(1,)],
                                 output_dtypes=[mx.float32])[0])

    labels: dict[int, dict[str, Any]] = {}
    for B, Hq, Hkv, D, S in PROFILE_SHAPES:
        q = mx.random.normal((B, Hq, 1, D), key=mx.random.key(5)).astype(mx.bfloat16)
        k, v = make_kv(B, Hkv, S, D, mx.bfloat16, "cache_view", mx.random.key(6))
        mx.eval(q)
        calls = {
            "mx_fast": functools.partial(fast_call(D**-0.5), q, k, v),
            "cuda": functools.partial(cuda.fused_attention, q, k, v, scale=D**-0.5),
        }
        for backend, call in calls.items():
            mx.eval(call())  # compile outside the markers
            for rep in range(3):
                index = len(labels) + 1
                labels[index] = {"B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "S": S,
                                 "backend": backend, "rep": rep,
                                 "kv_bytes": 2 * B * Hkv * S * D * 2}
                marker(index)
                mx.eval(call())
                marker(0)  # closes the call: what follows (next inputs) is not counted
    (out / "profile_markers.json").write_text(json.dumps(labels))


def short_name(kernel: str) -> str:
    """A kernel's name without namespaces, template arguments' tail and parameters."""
    name = kernel.split("(")[0].replace("void ", "").replace("mlx::core::cu::", "")
    return name.replace("custom_kernel_", "")[:60]


def summarize_ncu(csv_path: Path, markers_path: Path, bandwidth: float | None) -> dict[str, Any]:
    """Sum ncu's gpu__time_duration of the kernels between consecutive markers, per call."""
    import csv
    import re

    labels = {int(key): value for key, value in json.loads(markers_path.read_text()).items()}
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    lines = csv_path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    groups: dict[int, list[tuple[str, float]]] = {}
    current = None
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        found = re.search(r"mlxr_marker_(\d+)", name)
        if found:
            current = int(found.group(1)) or None
            continue
        if current in labels:
            value = float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
            groups.setdefault(current, []).append((short_name(name), value))
    calls: dict[tuple[Any, ...], list[float]] = {}
    kernels: dict[tuple[Any, ...], list[str]] = {}
    for index, label in labels.items():
        key = (label["B"], label["S"], label["D"], label["backend"])
        calls.setdefault(key, []).append(sum(us for _, us in groups.get(index, [])))
        kernels[key] = [f"{name}: {us:.1f} us" for name, us in groups.get(index, [])]
    rows = []
    for (B, S, D, backend), times in calls.items():
        kv_bytes = 2 * B * 8 * S * D * 2
        us = statistics.median(times)
        rows.append({"B": B, "S": S, "D": D, "backend": backend, "gpu_us": us,
                     "bw_fraction": kv_bytes / (us * 1e-6) / bandwidth if bandwidth else None,
                     "kernels": kernels[(B, S, D, backend)]})
    return {"method": "ncu gpu__time_duration.sum per kernel, --cache-control all, "
                      "--clock-control none; median of 3 calls", "rows": rows}


# --------------------------------------------------------------------------------------------
# end to end

LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
}


def bench_e2e(results: dict[str, Any], smoke: bool = False) -> None:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.plugins import load_plugins
    from mlxr_plugins.archs.llama import LlamaArchitecture

    context, tokens, config = 4096, 128, dict(LLAMA_1B)
    if smoke:
        context, tokens = 64, 4
        config = {**LLAMA_1B, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}
    registry = load_plugins(strict=False).registries.kernels
    arch = LlamaArchitecture()
    shapes = arch.kernel_context(config)
    models: dict[str, nn.Module] = {}
    weights: list[tuple[str, mx.array]] | None = None
    for backend in ("mlx_fast", "cuda"):
        kernels = bind_kernels(registry, dtype="bfloat16", shapes=shapes,
                               choices={"attention": backend})
        assert kernels.chosen["attention"] == backend
        model = arch.build(config, kernels)
        if weights is None:
            model.set_dtype(mx.bfloat16)
            weights = list(tree_flatten(model.parameters()))  # type: ignore[arg-type]
        else:
            model.load_weights(weights)
        mx.eval(model.parameters())
        model.eval()
        models[backend] = model

    prompt = mx.random.randint(0, int(str(config["vocab_size"])), (1, context))
    caches = {}
    for backend, model in models.items():
        cache = arch.make_cache(model)
        for start in range(0, context, 512):
            model(prompt[:, start : start + 512], cache=cache)
            mx.eval([c.state for c in cache])
        caches[backend] = cache

    def decode(backend: str) -> float:
        model, cache = models[backend], caches[backend]

        def step(token: mx.array) -> mx.array:
            return mx.argmax(model(token.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)

        y = step(prompt[:, -1])
        mx.async_eval(y)
        t0 = None
        for n in range(tokens + 8):
            if n == 8:  # after a short warm-up
                t0 = time.perf_counter()
            next_y = step(y)
            mx.async_eval(next_y)
            y.item()
            y = next_y
        y.item()
        assert t0 is not None
        elapsed = time.perf_counter() - t0
        for c in cache:  # back to the prompt for the next round
            c.trim(tokens + 9)
        return tokens / elapsed

    # Same first tokens from both graphs (greedy on identical weights and cache).
    agree = []
    for backend in models:
        cache = caches[backend]
        logits = models[backend](prompt[:, -1:], cache=cache)
        agree.append(logits[0, -1].astype(mx.float32))
        for c in cache:
            c.trim(1)
    logit_diff = mx.abs(agree[0] - agree[1]).max().item()
    argmax_same = bool((mx.argmax(agree[0]) == mx.argmax(agree[1])).item())

    rounds: dict[str, list[float]] = {"mlx_fast": [], "cuda": []}
    for r in range(3):
        order = ["mlx_fast", "cuda"] if r % 2 == 0 else ["cuda", "mlx_fast"]
        for backend in order:
            rounds[backend].append(decode(backend))
    fast, fused = statistics.median(rounds["mlx_fast"]), statistics.median(rounds["cuda"])
    results["e2e"] = {
        "model": "Llama-3.2-1B-shaped (random bf16 weights, tied embeddings)",
        "context": context, "decode_tokens": tokens, "tok_s": rounds,
        "median_tok_s": {"mlx_fast": fast, "cuda": fused}, "speedup": fused / fast,
        "first_logits_max_abs_diff": logit_diff, "first_argmax_same": argmax_same,
    }
    log(f"e2e Llama-1B-shaped, {context} context: mlx_fast {fast:.1f} tok/s, cuda {fused:.1f} tok/s "
        f"(x{fused / fast:.2f}); rounds {rounds}; first logits diff {logit_diff:.3g}")


# --------------------------------------------------------------------------------------------


def summary(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}, mlx {results['mlx']}, "
             f"copy bandwidth {results.get('copy_bandwidth_TBs', float('nan')):.2f} TB/s"]
    if "parity" in results:
        p = results["parity"]
        lines.append(f"parity: {len(p['cases'])} fused + {len(p['delegated'])} delegated cases, "
                     f"{p['failures']} failures")
    if "attention" in results:
        lines.append("  B      S    D | mx.fast view  mx.fast contig |   cuda  (copy-first) | "
                     "speedup | cuda bw | mx.fast bw")
        for r in results["attention"]:
            lines.append(
                f"{r['B']:3d} {r['S']:6d} {r['D']:4d} | {r['mx_fast_view_us']:9.1f} us "
                f"{r['mx_fast_contiguous_us']:11.1f} us | {r['cuda_view_us']:6.1f} us "
                f"({r['cuda_copy_first_us']:7.1f}) | x{r['speedup_vs_mx_fast_view']:6.2f} | "
                f"{100 * r['cuda_view_bw_fraction']:5.0f}% | "
                f"{100 * r['mx_fast_view_bw_fraction']:5.0f}%"
            )
    for r in results.get("masked", []):
        lines.append(
            f"masked B={r['B']} S={r['S']}: mx.fast bool {r['mx_fast_bool_us']:.1f} us, additive "
            f"{r['mx_fast_additive_us']:.1f} us; cuda bool {r['cuda_bool_us']:.1f} us "
            f"(x{r['speedup_bool']:.2f}; waited for: {r['mx_fast_bool_sync_us']:.1f} vs "
            f"{r['cuda_bool_sync_us']:.1f} us); mx.fast unmasked {r['mx_fast_unmasked_us']:.1f} us"
        )
    if "e2e" in results:
        e = results["e2e"]
        lines.append(f"e2e decode at {e['context']}: mlx_fast {e['median_tok_s']['mlx_fast']:.1f} "
                     f"tok/s, cuda {e['median_tok_s']['cuda']:.1f} tok/s, x{e['speedup']:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--sections", default="parity,attention,masked")
    parser.add_argument("--summarize-ncu", type=Path, metavar="CSV",
                        help="summarize an ncu --csv log of `--sections profile` and exit")
    parser.add_argument("--bandwidth", type=float, help="copy bandwidth in TB/s, for --summarize-ncu")
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny shapes, to check the script itself (tests run it on CPU with a stand-in kernel)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize_ncu:
        bandwidth = args.bandwidth * 1e12 if args.bandwidth else None
        earlier = args.out.parent / "decode_attention.json"
        if bandwidth is None and earlier.exists():
            bandwidth = json.loads(earlier.read_text()).get("copy_bandwidth_TBs", 0) * 1e12 or None
        table = summarize_ncu(args.summarize_ncu, args.out / "profile_markers.json", bandwidth)
        (args.out / "ncu_summary.json").write_text(json.dumps(table, indent=1))
        for row in sorted(table["rows"], key=lambda r: (r["B"], r["S"], r["D"], r["backend"])):
            fraction = f"{100 * row['bw_fraction']:.0f}%" if row["bw_fraction"] else "-"
            log(f"ncu B={row['B']} S={row['S']:6d} D={row['D']:4d} {row['backend']:8s} "
                f"{row['gpu_us']:8.1f} us  {fraction:>5s} of copy bw  {row['kernels']}")
        return 0
    results: dict[str, Any] = {
        "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", "?"),
        "python": platform.python_version(), "argv": sys.argv,
    }
    try:
        import subprocess

        results["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
    except OSError:
        results["gpu"] = "unknown"
    log(f"{results['gpu']} | {results['device']} | mlx {results['mlx']}")
    sections = args.sections.split(",")
    status = 0
    if "parity" in sections:
        try:
            parity(results, args.smoke)
            status |= results["parity"]["failures"] > 0
        except Exception:
            traceback.print_exc()
            status = 1
    if "attention" in sections or "e2e" in sections:
        bandwidth = copy_bandwidth(args.smoke)
        results["copy_bandwidth_TBs"] = bandwidth / 1e12
        log(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")

    def guarded(section: Callable[[], None]) -> int:
        """Run a timing section; a failure is printed and makes the exit status 1."""
        try:
            section()
        except Exception:
            traceback.print_exc()
            return 1
        return 0

    if "attention" in sections:
        status |= guarded(lambda: bench_attention(results, results["copy_bandwidth_TBs"] * 1e12, args.smoke))
    if "masked" in sections:
        status |= guarded(lambda: bench_masked(results, args.smoke))
    if "profile" in sections:
        profile(args.out)
    if "e2e" in sections:
        status |= guarded(lambda: bench_e2e(results, args.smoke))
    if sections == ["profile"]:
        return status
    (args.out / "decode_attention.json").write_text(json.dumps(results, indent=1))
    text = summary(results)
    (args.out / "decode_attention.txt").write_text(text + "\n")
    log("\n" + text)
    return status


if __name__ == "__main__":
    sys.exit(main())
