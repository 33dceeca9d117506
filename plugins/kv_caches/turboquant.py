"""TurboQuant-style keys and values (``models[].kv_cache: {method: turboquant, bits, window}``).

After TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, 2025): each position's key and value heads are
stored as a norm and a randomly rotated direction whose coordinates are indices into a Lloyd-Max
codebook, values on ``bits`` bits, keys on ``bits - 1`` bits plus a 1-bit sign sketch of their
residual that makes the estimated attention scores unbiased (the arithmetic:
:mod:`mlxr_plugins.kv_caches.codebooks`). A position is encoded on its own, when it is written, so
it is the same alone, in a batch, after a prefix-cache hit or a chunked prefill. Per head and
position: ``D (bits - 1) / 8 + D / 8 + 4`` bytes of key and ``D bits / 8 + 2`` of value (head size
64 at 3 bits: 54 bytes, against 256 in float16 and 512 in float32).

``window`` (W): the query at position ``p`` sees positions ``p - W < s <= p`` in full precision and
the older ones through their codes. The cache keeps a full-precision copy of each row's last
``W + TRIM_SLACK`` positions (the slack so that rolling back rejected draft tokens needs nothing
rebuilt); a window position the copy lacks (a prefix-cache hit more than the copy's length short
of the stored entry's end, a rollback past the slack) is rebuilt from its codes, so that position
is seen as its codes say, as if it had left the window.

Backends: the reference one, in ``mx``: per step the queries are rotated and sketched once, the
stored bytes of every position looked up in 256-row tables (keys' levels and signs, values'
levels, all still rotated), scores and the weighted sum of values are matmuls with the norms
applied to the scores and the weights, and the sum is rotated back once. On MLX's GPU backends
writing positions and a decode step (one query position) run fused kernels instead, which read
and write the packed bytes directly (:func:`fused_backend` picks them: CUDA,
:mod:`mlxr_plugins.kv_caches.turboquant_cuda`, tested on an H200; Metal,
:mod:`mlxr_plugins.kv_caches.turboquant_metal`, written but untested: never compiled or run, no
Apple machine here, so taken only with ``MLXR_TURBOQUANT_METAL=1``). :data:`FUSED` False keeps the
reference, for comparison.
``bench/kv_memory.py`` measures the cost of each against full precision.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import mlx.core as mx

from mlxr_core.errors import ConfigError
from mlxr_core.model import quantized_cache
from mlxr_core.model.cache import _pad_positions
from mlxr_core.model.masks import window_mask
from mlxr_core.model.quantized_cache import PackedRows, PackedSequence, grouped_softmax
from mlxr_plugins.kv_caches import turboquant_cuda, turboquant_metal
from mlxr_plugins.kv_caches.codebooks import Codec, layer_codec
from mlxr_plugins.kv_caches.turboquant_fused import FusedBackend

#: On MLX's GPU backends the cache is written and decode steps read it through fused kernels.
FUSED = True
#: Positions kept in full precision past the window: the most draft tokens a decoder rolls back.
TRIM_SLACK = 64
BITS = (4, 3, 2)


#: The Metal kernels have never run (no Apple machine where they were written): a Mac uses them
#: only with this set to 1, and the reference otherwise.
METAL_ENV = "MLXR_TURBOQUANT_METAL"


@functools.cache
def fused_backend() -> FusedBackend | None:
    """The fused kernels for MLX's GPU backend on this machine (CUDA or Metal), or None: the
    reference runs. Whether a call may take them (the default device, its shapes) is for the
    module's ``reasons`` and ``encode_reasons`` to say."""
    if mx.cuda.is_available():
        return turboquant_cuda
    if mx.metal.is_available() and os.environ.get(METAL_ENV) == "1":
        return turboquant_metal
    return None


@attrs.frozen
class TurboQuantKV:
    """The ``turboquant`` method's setting for a model (its :class:`KVStorage`)."""

    bits: int
    window: int = 0
    method: str = "turboquant"
    #: Keys on ``bits - 1`` bits and a 1-bit sign sketch (unbiased scores), else on ``bits``.
    sketch: bool = True

    @property
    def packed(self) -> int:
        """Arrays per position: keys' codes, signs (with the sketch) and norms; values' codes, norms."""
        return 5 if self.sketch else 4

    def bytes_per_position(self, heads: int, head_dim: int, itemsize: int) -> int:
        """Packed codes, sign sketch and float16 norms; the same whatever ``itemsize``."""
        if self.sketch:
            keys = head_dim * (self.bits - 1) // 8 + head_dim // 8 + 2 * 2
        else:
            keys = head_dim * self.bits // 8 + 2
        values = head_dim * self.bits // 8 + 2
        return heads * (keys + values)

    def full_precision_positions(self, tokens: int) -> int:
        return min(tokens, self.window + TRIM_SLACK) if self.window else 0

    def make_cache(self, layer: int) -> TurboQuantKVCache:
        return TurboQuantKVCache(self, layer)


class TurboQuantMethod:
    """The ``turboquant`` KV cache method (:mod:`mlxr_core.model.kv_storage`)."""

    name = "turboquant"
    sketch = True

    def problems(self, setting: Any) -> list[tuple[str, str]]:
        problems = []
        if setting.bits not in BITS:
            problems.append(("bits", f"the {self.name} method takes 4, 3 or 2, got {setting.bits}"))
        if setting.group_size != 64:
            problems.append(("group_size", f"the {self.name} method has no groups (each head has one norm); remove it"))
        if setting.start_after:
            problems.append(
                ("start_after", f"the {self.name} method keeps the most recent positions exact instead: use window")
            )
        return problems

    def configure(self, setting: Any, head_dims: list[int]) -> TurboQuantKV:
        for dim in head_dims:
            try:
                if dim % 8:
                    raise ValueError("not a multiple of 8")
                layer_codec(dim, setting.bits, 0)
            except ValueError as exc:
                raise ConfigError(
                    f"models[].kv_cache.method turboquant cannot rotate heads of size {dim} ({exc}); "
                    "use method affine",
                    field="models[].kv_cache.method",
                ) from None
        return TurboQuantKV(setting.bits, setting.window, self.name, self.sketch)


class TurboQuantMSEMethod(TurboQuantMethod):
    """The ``turboquant_mse`` KV cache method: keys on the codebook at ``bits`` like the values,
    without the sign sketch (TurboQuant's MSE variant: its scores are not unbiased, but their
    variance is lower, which is what the softmax feels; see ``bench/README.md``)."""

    name = "turboquant_mse"
    sketch = False


def _boolean(mask: str | mx.array | None) -> bool:
    """Whether ``mask`` says only which positions are seen (none, causal or boolean)."""
    return mask is None or isinstance(mask, str) or mask.dtype == mx.bool_


class BatchTurboQuantKVCache(PackedRows):
    """TurboQuant-stored keys and values of one layer for a batch (see the module): ``arrays``
    are the packed positions, ``tail`` the full-precision keys and values of the last positions
    (``[B, H, T, D]`` each, right-aligned with the rows: ending at :attr:`length`), or None."""

    #: The full-precision tail holds the last positions only: positions cut from its end could
    #: not be given back from the codes, so rows of this cache draft nothing in the batch.
    rolls_back: ClassVar[bool] = False

    def __init__(self, spec: TurboQuantKV, layer: int, rows: int = 1):
        super().__init__([], None, [0] * rows, 0)
        self.spec, self.layer = spec, layer
        self.tail: list[mx.array] | None = None
        self.dtype: mx.Dtype = mx.float32
        self._codec: Codec | None = None

    @property
    def state(self) -> list[mx.array]:
        return [*self.arrays, *(self.tail or [])]

    def codec(self, dim: int) -> Codec:
        if self._codec is None:
            self._codec = layer_codec(dim, self.spec.bits, self.layer, self.spec.sketch)
        return self._codec

    def encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        codec = self.codec(keys.shape[-1])
        fused = fused_backend()
        if FUSED and fused is not None and not fused.encode_reasons(keys):
            return fused.encode(codec, keys, values)
        return [*codec.encode_keys(keys), *codec.encode_values(values)]

    def single(self) -> TurboQuantKVCache:
        return TurboQuantKVCache(self.spec, self.layer)

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
        attend ``queries`` (``[B, Hq, L, D]``) over every position: through the codes, and the
        positions within ``spec.window`` of each query in full precision. ``window`` is the
        layer's sliding window; ``extra`` may hold ``sinks``. ``attention`` (the layer's kernel)
        takes a prompt chunk on a CPU (:meth:`_chunk_through_kernel`)."""
        B, Hq, L, D = queries.shape
        Hkv, W = keys.shape[1], self.spec.window
        T = self.tail[0].shape[2] if self.tail else 0
        self.dtype = keys.dtype
        self.write(keys, values)
        S = self.length
        if window is not None:
            mask = window_mask(mask, L, S, window)
        if L >= quantized_cache.DENSE_ROWS and mx.default_device() == mx.cpu and (not W or _boolean(mask)):
            return self._chunk_through_kernel(queries, keys, values, T, scale, mask, attention, extra)
        codec = self.codec(D)
        K = codec.key_arrays
        q = (queries * scale).reshape(B, Hkv, Hq // Hkv, L, D)
        packed_scores, packed_values = codec.scores, codec.weighted_values
        fused = fused_backend()
        if FUSED and fused is not None and not fused.reasons(queries):
            packed_scores = functools.partial(fused.scores, codec)
            packed_values = functools.partial(fused.weighted_values, codec)
        scores = packed_scores(q, *(a[:, :, :S] for a in self.arrays[:K]))  # [B, Hkv, R, L, S]
        if W:
            before = self.tail or [keys[:, :, :0], values[:, :, :0]]
            exact_keys, exact_values = (mx.concatenate([t, x], axis=2) for t, x in zip(before, (keys, values), strict=True))
            N = T + L  # exact positions S - N .. S - 1; query i is at S - L + i
            near = (T + mx.arange(L)[:, None] - mx.arange(N)[None, :]) < W
            exact = q @ exact_keys[:, :, None].swapaxes(-1, -2)
            scores = mx.concatenate([scores[..., : S - N], mx.where(near, exact, scores[..., S - N :])], axis=-1)
        probs = grouped_softmax(scores, mask, extra.get("sinks"))
        stored_values = [a[:, :, :S] for a in self.arrays[K:]]
        if W:
            zero = mx.array(0.0, dtype=probs.dtype)
            far = mx.concatenate([probs[..., : S - N], mx.where(near, zero, probs[..., S - N :])], axis=-1)
            out = packed_values(far, *stored_values)
            out = out + mx.where(near, probs[..., S - N :], zero) @ exact_values[:, :, None]
            keep = min(N, W + TRIM_SLACK)
            self.tail = [exact_keys[:, :, N - keep :], exact_values[:, :, N - keep :]]
        else:
            out = packed_values(probs, *stored_values)
        return out.reshape(B, Hq, L, D).astype(queries.dtype)

    def _chunk_through_kernel(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        T: int,
        scale: float,
        mask: str | mx.array | None,
        attention: Callable[..., mx.array],
        extra: dict[str, Any],
    ) -> mx.array:
        """A prompt chunk on a CPU (its positions already written; ``T`` the tail's length
        before): every position's key and value as its codes give them (the same scores and sums)
        through the layer's kernel, the fused one full precision runs, 2-3.5x faster than the
        lookups and matmuls of :meth:`update_and_attend` on a 512-token chunk. With a window, the
        last positions come twice, decoded and exact, and a boolean mask shows each query the
        copy it sees, so that one softmax spans both as that method's does."""
        S, L, W = self.length, keys.shape[2], self.spec.window
        codec = self.codec(keys.shape[-1])
        K = codec.key_arrays
        decoded_keys = codec.decode_keys(*(a[:, :, :S] for a in self.arrays[:K])).astype(queries.dtype)
        decoded_values = codec.decode_values(*(a[:, :, :S] for a in self.arrays[K:])).astype(queries.dtype)
        if not W:
            return attention(queries, decoded_keys, decoded_values, scale=scale, mask=mask, **extra)
        before = self.tail or [keys[:, :, :0], values[:, :, :0]]
        exact_keys, exact_values = (mx.concatenate([t, x], axis=2) for t, x in zip(before, (keys, values), strict=True))
        N = T + L  # exact positions S - N .. S - 1; query i is at S - L + i
        near = (T + mx.arange(L)[:, None] - mx.arange(N)[None, :]) < W
        if isinstance(mask, str):
            mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None, :]  # bottom-right causal
        shown = mx.ones((L, S), dtype=mx.bool_) if mask is None else mask
        far = mx.concatenate([mx.ones((L, S - N), dtype=mx.bool_), mx.logical_not(near)], axis=1)
        both = mx.concatenate([shown & far, shown[..., S - N :] & near], axis=-1)
        out = attention(
            queries,
            mx.concatenate([decoded_keys, exact_keys.astype(queries.dtype)], axis=2),
            mx.concatenate([decoded_values, exact_values.astype(queries.dtype)], axis=2),
            scale=scale,
            mask=both,
            **extra,
        )
        keep = min(N, W + TRIM_SLACK)
        self.tail = [exact_keys[:, :, N - keep :], exact_values[:, :, N - keep :]]
        return out

    def fill_window(self) -> None:
        """Give the tail every position of the window (the last ``min(length, W)``), rebuilding
        those it lacks from their codes (see the module)."""
        W = self.spec.window
        if not W or not self.arrays:
            return
        T = self.tail[0].shape[2] if self.tail else 0
        need = min(self.length, W)
        if need <= T:
            return
        start, stop = self.length - need, self.length - T
        K = self.spec.packed - 2
        codec = self.codec(self.arrays[K].shape[3] * 8 // self.spec.bits)
        rebuilt = [
            codec.decode_keys(*(a[:, :, start:stop] for a in self.arrays[:K])).astype(self.dtype),
            codec.decode_values(*(a[:, :, start:stop] for a in self.arrays[K:])).astype(self.dtype),
        ]
        self.tail = (
            [mx.concatenate([r, t], axis=2) for r, t in zip(rebuilt, self.tail, strict=True)]
            if self.tail
            else rebuilt
        )

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep)
        super().filter(keep)
        if self.tail:
            T = self.tail[0].shape[2]
            self.tail = [t[index, :, T - min(T, self.length) :] for t in self.tail]

    def extend(self, other: PackedRows) -> None:
        assert isinstance(other, BatchTurboQuantKVCache)
        sides = [(self.batch_size, self.tail), (other.batch_size, other.tail)]
        self._codec = self._codec or other._codec
        super().extend(other)
        like = self.tail or other.tail
        if like is None:
            return
        T = max(tail[0].shape[2] for _, tail in sides if tail)
        joined = []
        for part in range(2):
            pieces = [
                _pad_positions(tail[part], left=T - tail[part].shape[2])
                if tail
                else mx.zeros(
                    (rows, like[part].shape[1], T, like[part].shape[3]), dtype=like[part].dtype
                )
                for rows, tail in sides
            ]
            joined.append(mx.concatenate(pieces, axis=0))
        self.tail = joined

    def extract(self, row: int) -> TurboQuantKVCache:
        """Row ``row`` as a single-sequence cache without its padding."""
        start = self.left_padding[row]
        n = self.length - start
        cache = self.single()
        arrays = [a[row : row + 1, :, start : self.length] for a in self.arrays]
        tail = [t[row : row + 1, :, t.shape[2] - min(t.shape[2], n) :] for t in self.tail or []]
        if arrays:
            cache.restore((*arrays, *tail), n)
        return cache


class TurboQuantKVCache(PackedSequence):
    """One sequence's TurboQuant-stored keys and values: a one-row
    :class:`BatchTurboQuantKVCache`, which :meth:`to_batch` hands over as is."""

    rows: BatchTurboQuantKVCache

    def __init__(self, spec: TurboQuantKV, layer: int):
        super().__init__(BatchTurboQuantKVCache(spec, layer))

    def trim(self, n: int) -> int:
        n = super().trim(n)
        rows = self.rows
        if rows.tail and n:
            T = rows.tail[0].shape[2]
            rows.tail = [t[:, :, : max(0, T - n)] for t in rows.tail]
            rows.fill_window()
        return n

    def snapshot(self) -> tuple[mx.array, ...]:
        # Copies: the running request goes on writing its arrays in place.
        rows = self.rows
        return (*(mx.contiguous(a[:, :, : rows.length]) for a in rows.arrays), *(rows.tail or []))

    def restore(self, arrays: tuple[mx.array, ...], length: int) -> None:
        """The first ``length`` positions of a :meth:`snapshot`: the packed positions, and of its
        full-precision tail what lies before ``length`` (the rest of the window rebuilt)."""
        rows = self.rows
        packed, tail = arrays[: rows.spec.packed], arrays[rows.spec.packed :]
        stored = packed[0].shape[2]
        rows.left_padding = [0] * packed[0].shape[0]
        rows.arrays = [a[:, :, :length] for a in packed]
        rows.length = length
        rows._offset = None
        rows.tail = None
        if tail:
            rows.dtype = tail[0].dtype
            first = stored - tail[0].shape[2]  # the position of the tail's first column
            lo = min(length, max(first, length - min(length, rows.spec.window + TRIM_SLACK)))
            rows.tail = [t[:, :, lo - first : length - first] for t in tail]
        rows.fill_window()
        rows._reserve(length)
