"""Keys and values stored quantized (``models[].kv_cache``), attended to without unpacking them.

Each position's key and value heads are ``mx.quantize``'d along the head dimension in groups of
``group_size`` (a packed ``uint32`` array, one scale and one bias per group, in the activations'
dtype), so a position is quantized on its own and the same wherever and whenever it is written:
a row's packed keys are the same alone, in a batch, after a prefix-cache hit or a chunked prefill.
Attention runs over the packed arrays through ``mx.quantized_matmul`` (:func:`quantized_attention`; on CUDA,
whose ``quantized_matmul`` has no batched weights, over them dequantized for the step:
queries against the keys, probabilities against the values, grouped-query heads broadcast).

``start_after`` (N) keeps short sequences exact: the query at position ``p`` attends over the
full-precision keys and values when ``p < N`` and over the packed cache from ``p = N`` on, so a
sequence stays full precision until it holds N tokens and is quantized after. To that end the cache
keeps a full-precision copy beside the packed arrays while some row holds fewer than N positions
(a chunk that crosses N computes both attentions and takes each query's own), and drops it once
every row holds N. A full-precision copy that is needed again and was dropped (a prefix-cache hit
of fewer than N positions from a longer entry, a draft rollback below N) is rebuilt by dequantizing
the packed positions: the one place where a sequence under N sees quantized values.

:class:`QuantizedKVCache` (one sequence) and :class:`BatchQuantizedKVCache` (the running batch,
rows right-aligned after left padding as in :class:`~mlxr_core.model.cache.BatchKVCache`) follow
the cache protocol of :mod:`mlxr_core.model.cache`. Attention layers find them by
:data:`QUANTIZED_CACHES` and call :meth:`BatchQuantizedKVCache.update_and_attend` instead of
``update_and_fetch`` and the attention kernel.

This is the ``affine`` KV cache method (``models[].kv_cache.method``, registered by the
``kv_caches`` plugin, see :mod:`mlxr_core.model.kv_storage`). :class:`PackedRows` is the part any
per-position packed storage shares (rows of packed arrays joining, leaving, growing); other
methods (``turboquant``) build on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import mlx.core as mx

from mlxr_core.errors import ConfigError
from mlxr_core.model.cache import CACHE_STEP, KVCache, RightAlignedRows
from mlxr_core.model.masks import window_mask

if TYPE_CHECKING:
    from mlxr_core.config.schema import KVCacheConfig
    from mlxr_core.model.kv_storage import KVStorage

#: Packed arrays per position: keys' (words, scales, biases), then values'.
PACKED = 6


@attrs.frozen
class KVQuantization:
    """How keys and values are stored: ``bits`` per element in groups of ``group_size`` along the
    head dimension, full precision for the first ``start_after`` positions (see the module)."""

    bits: int
    group_size: int = 64
    start_after: int = 0

    def bytes_per_position(self, heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes one position's keys and values take in one layer: packed words plus a scale and
        a bias (``itemsize`` each) per group."""
        per_head = head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * itemsize
        return 2 * heads * per_head

    def full_precision_positions(self, tokens: int) -> int:
        """Positions of a ``tokens``-long sequence also held in full precision (``start_after``)."""
        return min(tokens, self.start_after)

    def make_cache(self, layer: int) -> QuantizedKVCache:
        """A fresh cache for one sequence in attention layer ``layer`` (any: all are alike)."""
        return QuantizedKVCache(self)


#: Queries from which a CPU attends over the packed keys and values dequantized (the same values,
#: stored packed all the same), through the layer's own attention kernel (the fused one full
#: precision uses) where the caller hands it over: MLX's CPU ``quantized_matmul`` costs each query
#: row a pass over the cache, where a dense matmul goes through BLAS; at 3,000 cached positions,
#: 16 rows are 1.7x (4-bit) to 3.1x (8-bit) faster dense, 512 rows (a prefill chunk) 3.5-5.3x, one
#: row (a decode step) 0.4-0.7x (``bench/kv_prefill.py``).
DENSE_ROWS = 16


def quantized_attention(
    queries: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    *,
    scale: float,
    mask: str | mx.array | None,
    group_size: int,
    bits: int,
    sinks: mx.array | None = None,
    kernel: Callable[..., mx.array] | None = None,
) -> mx.array:
    """The attention kernel's contract (:mod:`mlxr_core.kernels`) over packed keys and values:
    ``queries`` ``[B, Hq, L, D]``; ``keys``, ``values`` each ``(words, scales, biases)`` of
    ``[B, Hkv, S, D]`` quantized along ``D``. Scores and the softmax in the queries' dtype (the
    softmax precise), as mlx-lm's ``quantized_scaled_dot_product_attention``; a prompt's chunk of
    :data:`DENSE_ROWS` queries or more on a CPU over them dequantized, through ``kernel`` (the
    layer's attention kernel) when given."""
    B, Hq, L, D = queries.shape
    Hkv = keys[0].shape[1]
    R = Hq // Hkv
    chunk_on_cpu = L >= DENSE_ROWS and mx.default_device() == mx.cpu
    if chunk_on_cpu and kernel is not None:
        # The kernel full precision runs (fused, no [L, S] mask or scores of its own to build):
        # the dense grouped matmuls below cost 2-6x it on a 512-token chunk.
        k, v = (mx.dequantize(w, s, b, group_size=group_size, bits=bits) for w, s, b in (keys, values))
        extra = {} if sinks is None else {"sinks": sinks}
        return kernel(queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale, mask=mask, **extra)
    # Grouped-query heads: [B, Hkv, R, L, D] queries against [B, Hkv, 1, S, *] keys.
    q = (queries * scale).reshape(B, Hkv, R, L, D)
    k_words, k_scales, k_biases = (part[:, :, None] for part in keys)
    v_words, v_scales, v_biases = (part[:, :, None] for part in values)
    if _no_batched_quantized_matmul() or chunk_on_cpu:
        k = mx.dequantize(k_words, k_scales, k_biases, group_size=group_size, bits=bits)
        v = mx.dequantize(v_words, v_scales, v_biases, group_size=group_size, bits=bits)
        probs = grouped_softmax(q @ k.swapaxes(-1, -2), mask, sinks)
        return (probs @ v).reshape(B, Hq, L, -1)
    scores = mx.quantized_matmul(q, k_words, k_scales, k_biases, transpose=True, group_size=group_size, bits=bits)
    probs = grouped_softmax(scores, mask, sinks)
    out = mx.quantized_matmul(probs, v_words, v_scales, v_biases, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, Hq, L, -1)


def _no_batched_quantized_matmul() -> bool:
    """Whether ``mx.quantized_matmul`` lacks batched weights on this device: MLX 0.32's CUDA
    backend has no implementation for them ("No implementation for problem shape: 1x4097x64x32"),
    so there the packed keys and values are dequantized for the step (stored packed all the same)."""
    return bool(mx.default_device() == mx.gpu and mx.cuda.is_available())


def grouped_softmax(scores: mx.array, mask: str | mx.array | None, sinks: mx.array | None) -> mx.array:
    """Attention probabilities from grouped-query ``scores`` ``[B, Hkv, R, L, S]``: the kernel
    contract's ``mask`` (``"causal"``, boolean or additive, ``[B | 1, Hq | 1, L | 1, S]``) and
    ``sinks`` (one logit per query head), the softmax precise."""
    _, Hkv, R, L, S = scores.shape
    Hq = Hkv * R
    if isinstance(mask, str):
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :]  # bottom-right causal
    if mask is not None:
        if mask.ndim == 4:  # [B | 1, Hq | 1, L | 1, S] -> [B | 1, Hkv | 1, R | 1, L | 1, S]
            mask = mask.reshape(mask.shape[0], Hkv, R, *mask.shape[2:]) if mask.shape[1] == Hq else mask[:, :, None]
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-math.inf, dtype=scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, Hkv, R, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    return probs


class PackedCache:
    """A cache that stores keys and values its own way and attends over them itself: attention
    layers call its ``update_and_attend(queries, keys, values, *, scale, mask, window, attention,
    **extra)`` instead of ``update_and_fetch`` and their kernel (see :data:`QUANTIZED_CACHES`)."""

    attends: ClassVar[bool] = True


class PackedRows(PackedCache, RightAlignedRows):
    """One layer's keys and values for a batch, stored per position: ``arrays`` (what
    :meth:`encode` makes of the positions' keys and values) each ``[B, H, capacity, *]``, and
    ``full``, full-precision keys and values in the same positions while a method keeps them.
    Rows are right-aligned as in :class:`~mlxr_core.model.cache.BatchKVCache`. A cache with no
    positions yet has no arrays (their shapes come with the first keys, or the rows it joins)."""

    step: int = CACHE_STEP

    def __init__(self, arrays: list[mx.array], full: list[mx.array] | None, left_padding: list[int], length: int):
        self.arrays = arrays
        self.full = full
        self.left_padding = left_padding
        self.length = length
        self._offset: mx.array | None = None

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2] if self.arrays else 0

    @property
    def aligned(self) -> list[mx.array]:
        """The arrays indexed by position (capacity long): ``arrays``, then ``full`` if kept."""
        return [*self.arrays, *(self.full or [])]

    @property
    def state(self) -> list[mx.array]:
        return self.aligned

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.state)

    def row_lengths(self) -> list[int]:
        return [self.length - pad for pad in self.left_padding]

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """The packed arrays of ``[B, H, L, D]`` keys and values, each ``[B, H, L, *]``."""
        raise NotImplementedError

    def single(self) -> Any:
        """An empty single-sequence cache of this kind (what :meth:`extract` fills)."""
        raise NotImplementedError

    def keeps_full(self) -> bool:
        """Whether the rows still need their full-precision copy (``full``)."""
        return False

    def _rebuild_full(self) -> None:
        raise NotImplementedError

    def write(self, keys: mx.array, values: mx.array) -> int:
        """Encode ``keys``/``values`` (``[B, H, L, D]``, the next ``L`` positions of every row)
        into the arrays (and ``full`` while kept); returns the first new position."""
        L = keys.shape[2]
        if not self.arrays:
            self._allocate(keys, values)
        if self.length + L > self.capacity:
            self._reserve(self.length + L)
        start = self.length
        self.length += L
        self._offset = None
        for array, part in zip(self.arrays, self.encode(keys, values), strict=True):
            array[:, :, start : self.length] = part
        if self.full is not None:
            self.full[0][:, :, start : self.length] = keys
            self.full[1][:, :, start : self.length] = values
        return start

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        """Zero-length arrays shaped for ``keys``/``values`` (a cache that had none)."""
        B = keys.shape[0]
        if self.length == 0 and len(self.left_padding) != B:
            self.left_padding = [0] * B
        empty = self.encode(keys[:, :, :0], values[:, :, :0])
        self.arrays = [mx.zeros((B, *a.shape[1:]), dtype=a.dtype) for a in empty]

    def _reserve(self, needed: int) -> None:
        grow = -(-needed // self.step) * self.step - self.capacity
        if grow > 0:
            self.arrays = [_pad_positions(a, right=grow) for a in self.arrays]
            if self.full is not None:
                self.full = [_pad_positions(a, right=grow) for a in self.full]

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows in ``keep`` (in that order), dropping padding no row needs."""
        index = mx.array(keep)
        self.left_padding = [self.left_padding[i] for i in keep]
        shift = min(self.left_padding) if self.left_padding else 0
        self.arrays = [a[index, :, shift:] for a in self.arrays]
        if self.full is not None:
            self.full = [a[index, :, shift:] for a in self.full]
            if not self.keeps_full():
                self.full = None
        self.left_padding = [pad - shift for pad in self.left_padding]
        self.length -= shift
        self._offset = None

    def extend(self, other: PackedRows) -> None:
        """Append ``other``'s rows, aligning both sides' ends."""
        for empty, shaped in ((self, other), (other, self)):
            if not empty.arrays and shaped.arrays:
                empty.arrays = [mx.zeros((empty.batch_size, *a.shape[1:2], 0, *a.shape[3:]), a.dtype) for a in shaped.arrays]
        if (self.full is None) != (other.full is None) and self.arrays:
            for side in (self, other):  # rows that hold N positions need no copy: zeros
                if side.full is None:
                    side._rebuild_full()
        length = max(self.length, other.length)
        capacity = max(self.capacity + length - self.length, other.capacity + length - other.length)
        sides = []
        for cache in (self, other):
            before = length - cache.length
            after = capacity - before - cache.capacity
            sides.append([_pad_positions(a, left=before, right=after) for a in cache.aligned])
        state = [mx.concatenate([mine, theirs], axis=0) for mine, theirs in zip(*sides, strict=True)]
        packed = len(self.arrays)
        self.arrays, self.full = state[:packed], state[packed:] or None
        self.left_padding = [pad + length - self.length for pad in self.left_padding] + [
            pad + length - other.length for pad in other.left_padding
        ]
        self.length = length
        self._offset = None

    def rollback(self, drop: Sequence[int]) -> None:
        """Forget the last ``drop[i]`` positions of row ``i`` (rejected draft tokens), in the
        packed arrays and the full-precision copy alike (see
        :meth:`~mlxr_core.model.cache.RightAlignedRows._roll_back`); a copy dropped and needed
        again below ``start_after`` is rebuilt by the next write."""
        arrays = self._roll_back(drop, self.aligned)
        packed = len(self.arrays)
        self.arrays, self.full = arrays[:packed], arrays[packed:] or None

    def extract(self, row: int) -> Any:
        """Row ``row`` as a single-sequence cache without its padding."""
        start = self.left_padding[row]
        cache = self.single()
        arrays = [a[row : row + 1, :, start : self.length] for a in self.aligned]
        if arrays:
            cache.restore(tuple(arrays), self.length - start)
        return cache


class BatchQuantizedKVCache(PackedRows):
    """Affine-quantized keys and values of one layer for a batch: ``arrays`` holds the keys'
    words, scales and biases, then the values', each ``[B, H, capacity, *]``; ``full`` the
    full-precision keys and values ``[B, H, capacity, D]`` while some row holds fewer than
    ``start_after`` positions (see :class:`PackedRows`)."""

    def __init__(
        self,
        spec: KVQuantization,
        arrays: list[mx.array],
        full: list[mx.array] | None,
        left_padding: list[int],
        length: int,
    ):
        super().__init__(arrays, full, left_padding, length)
        self.spec = spec

    @classmethod
    def empty(cls, spec: KVQuantization, rows: int = 1) -> BatchQuantizedKVCache:
        return cls(spec, [], None, [0] * rows, 0)

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        quantize = partial(mx.quantize, group_size=self.spec.group_size, bits=self.spec.bits)
        return [*quantize(keys), *quantize(values)]

    def single(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.spec)

    def keeps_full(self) -> bool:
        return min(self.row_lengths(), default=0) < self.spec.start_after

    def update_and_attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: str | mx.array | None,
        window: int | None,
        attention: Callable[..., mx.array],
        **extra: Any,
    ) -> mx.array:
        """Write ``keys``/``values`` (``[B, H, L, D]``, the next ``L`` positions of every row) and
        attend ``queries`` over every position: the packed cache, or for queries before
        ``start_after`` the full-precision copy through ``attention`` (the layer's kernel).
        ``extra`` goes to both (``sinks``)."""
        N, L = self.spec.start_after, keys.shape[2]
        before = self.row_lengths()
        if not self.arrays:
            self._allocate(keys, values)
        if self.length + L > self.capacity:
            self._reserve(self.length + L)
        if N > 0 and min(before) < N and self.full is None:
            self._rebuild_full()
        self.write(keys, values)

        S = self.length
        if window is not None:
            mask = window_mask(mask, L, S, window)
        use_full = [n < N for n in before] if self.full is not None else [False] * len(before)
        last_full = [n + L <= N for n in before]
        out: mx.array | None = None
        if any(use_full):
            assert self.full is not None
            out = attention(queries, self.full[0][:, :, :S], self.full[1][:, :, :S], scale=scale, mask=mask, **extra)
        if not all(last_full):
            packed = quantized_attention(
                queries,
                [a[:, :, :S] for a in self.arrays[:3]],
                [a[:, :, :S] for a in self.arrays[3:]],
                scale=scale,
                mask=mask,
                group_size=self.spec.group_size,
                bits=self.spec.bits,
                sinks=extra.get("sinks"),
                kernel=attention,
            )
            if out is not None:  # each query its own: full precision before position N
                positions = mx.array(before)[:, None] + mx.arange(L)[None, :]
                out = mx.where((positions < N)[:, None, :, None], out, packed)
            else:
                out = packed
        if self.full is not None and min(self.row_lengths()) >= N:
            self.full = None
        assert out is not None
        return out

    def _rebuild_full(self) -> None:
        """The full-precision copy from the packed positions (see the module: only where it was
        dropped and is needed again)."""
        group_size, bits = self.spec.group_size, self.spec.bits
        self.full = [
            mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)
            if words.size  # MLX cannot dequantize an empty array
            else mx.zeros((*words.shape[:-1], words.shape[-1] * 32 // bits), dtype=scales.dtype)
            for words, scales, biases in (self.arrays[:3], self.arrays[3:])
        ]

class PackedSequence(PackedCache):
    """One sequence's cache over a one-row :class:`PackedRows` (no padding), which
    :meth:`to_batch` hands over as is; a method's class adds ``snapshot`` and ``restore``."""

    partial_reuse: ClassVar[bool] = True

    def __init__(self, rows: PackedRows):
        self.rows = rows

    @property
    def offset(self) -> int:
        return self.rows.length

    def __len__(self) -> int:
        return self.rows.length

    def update_and_attend(self, queries: mx.array, keys: mx.array, values: mx.array, **kwargs: Any) -> mx.array:
        """See the rows' ``update_and_attend``."""
        out: mx.array = self.rows.update_and_attend(queries, keys, values, **kwargs)  # type: ignore[attr-defined]
        return out

    @property
    def state(self) -> list[mx.array]:
        return self.rows.state

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (rejected draft tokens); return how many were dropped."""
        n = max(0, min(self.rows.length, n))
        self.rows.length -= n
        return n

    def to_batch(self) -> PackedRows:
        return self.rows

    def reserve_bytes(self, tokens: int, itemsize: int) -> int:
        return 0  # counted from the model's head shapes (see kv_bytes_per_token)


class QuantizedKVCache(PackedSequence):
    """One sequence's packed keys and values: a one-row :class:`BatchQuantizedKVCache` (no
    padding), which :meth:`to_batch` hands over as is. See the module for ``start_after``."""

    rows: BatchQuantizedKVCache

    def __init__(self, spec: KVQuantization):
        super().__init__(BatchQuantizedKVCache.empty(spec))
        self.spec = spec

    def snapshot(self) -> tuple[mx.array, ...]:
        # Copies: the running request goes on writing its arrays in place.
        return tuple(mx.contiguous(a[:, :, : self.rows.length]) for a in self.rows.state)

    def restore(self, arrays: tuple[mx.array, ...], length: int) -> None:
        """The first ``length`` positions of a :meth:`snapshot`; under ``start_after`` positions
        from a snapshot that no longer held the full-precision copy, it is dequantized."""
        rows = self.rows
        rows.left_padding = [0] * arrays[0].shape[0]
        rows.arrays = [a[:, :, :length] for a in arrays[:PACKED]]
        rows.full = [a[:, :, :length] for a in arrays[PACKED:]] or None
        rows.length = length
        if length >= self.spec.start_after:
            rows.full = None
        elif rows.full is None:
            rows._rebuild_full()
        rows._reserve(length)
        rows._offset = None


#: The caches an attention layer calls ``update_and_attend`` on (an ``isinstance`` target).
QUANTIZED_CACHES = (PackedCache,)


def quantize_caches(caches: list[Any], storage: KVStorage) -> list[Any]:
    """``caches`` (a fresh ``make_cache()``) with each full-attention :class:`KVCache` replaced by
    ``storage``'s cache for that layer (:class:`QuantizedKVCache` for a :class:`KVQuantization`);
    recurrent states and other kinds are kept."""
    return [storage.make_cache(layer) if type(cache) is KVCache else cache for layer, cache in enumerate(caches)]


class AffineMethod:
    """The ``affine`` KV cache method (:mod:`mlxr_core.model.kv_storage`): this module's caches."""

    def problems(self, setting: KVCacheConfig) -> list[tuple[str, str]]:
        if setting.bits not in (8, 4):
            return [("bits", f"the affine method takes 8 or 4, got {setting.bits}")]
        if setting.window:
            return [("window", "the affine method keeps no recent-token window; use start_after, or remove it")]
        return []

    def configure(self, setting: KVCacheConfig, head_dims: list[int]) -> KVQuantization:
        if any(dim % setting.group_size for dim in head_dims):
            raise ConfigError(
                f"models[].kv_cache.group_size {setting.group_size} does not divide the head size "
                f"{', '.join(map(str, head_dims))}; pick one of 32, 64, 128 that does",
                field="models[].kv_cache.group_size",
            )
        return KVQuantization(setting.bits, setting.group_size, setting.start_after)


def _pad_positions(array: mx.array, *, left: int = 0, right: int = 0) -> mx.array:
    """Zero-pad the position axis (2) of a ``[B, H, S, *]`` array."""
    if left == 0 and right == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (left, right), (0, 0)])
