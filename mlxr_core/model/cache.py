"""Per-layer caches, as a declared protocol the engine works through.

A model's architecture makes one cache per layer for a sequence (``make_cache``): a
:class:`LayerCache`. Attention layers take a :class:`KVCache` (keys and values by position; a
sliding-window layer keeps every position and masks, see :mod:`mlxr_core.model.masks`), recurrent
layers (Gated DeltaNet, Mamba-style, short convolutions) a :class:`StateCache` (a few fixed-size
arrays whatever the length: a convolution's last inputs, an SSM state; :class:`RecurrentCache`
names them for mlxr's own layers). While a request is prefilled the engine
holds its per-sequence caches; when it joins the running batch each becomes a
:class:`BatchLayerCache` (:meth:`LayerCache.to_batch`) that rows join (``extend``) and leave
(``filter``). The prefix cache stores :meth:`LayerCache.snapshot` and gives a fresh cache back
with :meth:`LayerCache.restore`; a recurrent state holds exactly the positions it has seen, so it
can be restored only at the end of the stored prefix, never part way (:attr:`partial_reuse`). The
drafting decoders roll back rejected draft tokens with :meth:`LayerCache.trim`, which a recurrent
state cannot do (:meth:`LayerCache.is_trimmable`); inside the batch each row forgets its own
rejected tokens with its batch cache's ``rollback(drop)`` (:func:`rolls_back`). The KV budget reserves
:func:`reserve_bytes` per request. An attention layer that stores something else than a key and
a value per head (multi-head latent attention: one latent and one rotary key a position) keeps
them in a :class:`KVCache` that declares its width, which the budget counts
(:func:`position_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import Any, ClassVar, Protocol, runtime_checkable

import mlx.core as mx

from mlxr_core.model.masks import window_mask

#: An attention kernel's ``into_cache``: ``(queries, keys, values, k_buffer, v_buffer, start, *,
#: scale, mask) -> (out, k_buffer, v_buffer)`` with the new positions written at ``start`` and
#: attention over the first ``start + L``, or None where it declines (see
#: :meth:`mlxr_plugins.kernels.cpu_native.Attention.into_cache`).
IntoCache = Callable[..., "tuple[mx.array, mx.array, mx.array] | None"]


@runtime_checkable
class BatchLayerCache(Protocol):
    """One layer's cache for the running batch: one row per request."""

    #: Whether the layer attends over positions, so a left-padded row needs the batch's mask
    #: (:meth:`BatchKVCache.mask`); a recurrent layer's rows have no padding.
    attends: ClassVar[bool]

    @property
    def batch_size(self) -> int: ...

    @property
    def state(self) -> list[mx.array]: ...

    @property
    def nbytes(self) -> int: ...

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows in ``keep``, in that order."""
        ...

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows (a batch cache of the same kind)."""
        ...

    def extract(self, row: int) -> LayerCache:
        """Row ``row`` as a single-sequence cache."""
        ...


@runtime_checkable
class LayerCache(Protocol):
    """One layer's cache for one sequence."""

    #: See :attr:`BatchLayerCache.attends`.
    attends: ClassVar[bool]
    #: Whether :meth:`restore` can take fewer positions than a snapshot holds (keys and values
    #: can be cut at any position; a recurrent state cannot).
    partial_reuse: ClassVar[bool]
    #: Positions seen.
    offset: int

    @property
    def state(self) -> list[mx.array]:
        """The arrays holding the cache (to evaluate after a prefill chunk); empty when unused."""
        ...

    @property
    def nbytes(self) -> int: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; return how many were dropped."""
        ...

    def to_batch(self) -> BatchLayerCache:
        """This sequence as a one-row batch cache (its arrays, not copies)."""
        ...

    def snapshot(self) -> tuple[mx.array, ...]:
        """Arrays holding the :attr:`offset` positions seen, unshared with this cache."""
        ...

    def restore(self, arrays: tuple[mx.array, ...], length: int) -> None:
        """Take the first ``length`` positions of a :meth:`snapshot` (all of them unless
        :attr:`partial_reuse`) as this (fresh) cache's content."""
        ...

    def reserve_bytes(self, tokens: int, itemsize: int) -> int:
        """Bytes this layer needs for a sequence of ``tokens`` positions whose activations take
        ``itemsize`` bytes each; 0 where the layer's shapes are known only once it runs (keys and
        values: :func:`reserve_bytes` counts them from the model's head shapes)."""
        ...


def attending_layer(caches: Sequence[Any]) -> int | None:
    """Index of the first cache whose layer attends (where a batch's padding mask comes from)."""
    return next((i for i, cache in enumerate(caches) if getattr(cache, "attends", True)), None)


def batch_mask(caches: Sequence[Any]) -> mx.array | None:
    """The padding mask of a batch (from its first attention layer), None when no row is padded."""
    index = attending_layer(caches)
    if index is None or not caches[index].padded:
        return None
    mask: mx.array = caches[index].mask()
    return mask


def rolls_back(caches: Sequence[Any]) -> bool:
    """Whether every batch cache of ``caches`` can forget each row's rejected draft tokens alone
    (``rollback(drop)``): attention caches trim, mlxr's recurrent layers keep the states of the
    verified span (:meth:`BatchStateCache.keep_positions`); a cache may say it cannot
    (``rolls_back = False``: the mlx-lm bridge's recurrent layers, TurboQuant's tail)."""
    return all(callable(getattr(cache, "rollback", None)) and getattr(cache, "rolls_back", True) for cache in caches)


def prompts_mask(left_padding: Sequence[int], length: int) -> mx.array:
    """Boolean ``[B, 1, length, length]`` mask of a batch of prompts prefilled together,
    right-aligned after ``left_padding[i]`` padding positions: each position sees the earlier
    positions of its own prompt and itself. A padding position sees itself only, so that no
    row of attention is empty (its output is never used, but must stay finite)."""
    positions = mx.arange(length)
    rows, cols = positions[:, None], positions[None, :]
    pads = mx.array(list(left_padding))[:, None, None]
    mask: mx.array = ((cols <= rows) & (cols >= pads)) | (cols == rows)
    return mask[:, None]


def plain_attention(caches: Sequence[Any]) -> bool:
    """Whether every layer's cache is a plain :class:`KVCache` (what :func:`prefill_together`
    takes: a recurrent state or a packed cache would take in the padding)."""
    return all(type(cache) is KVCache for cache in caches)


def prefill_together(model: Any, prompts: Sequence[Sequence[int]], layers: int) -> list[BatchKVCache]:
    """``prompts`` prefilled by one forward pass of ``model`` into a batch cache per layer (of
    ``layers``), right-aligned: the shorter ones after padding, which :func:`prompts_mask` hides
    (evaluated). The rows then decode as the engine's batch does (:func:`batch_mask`)."""
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    ids = mx.array([[0] * pad + list(prompt) for pad, prompt in zip(pads, prompts, strict=True)], dtype=mx.int32)
    caches = [BatchKVCache.for_prompts(pads) for _ in range(layers)]
    model(ids, cache=caches, mask=prompts_mask(pads, longest) if any(pads) else None)
    mx.eval([array for cache in caches for array in cache.state])
    return caches


def position_bytes(caches: Sequence[Any], heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes one position takes in the attention layers of ``caches`` (a fresh ``make_cache()``),
    activations of ``itemsize`` bytes: a cache's declared :attr:`KVCache.width`, else a key and a
    value of ``head_dim`` for each of ``heads`` key/value heads."""
    return sum(
        (getattr(cache, "width", None) or 2 * heads * head_dim) * itemsize for cache in caches if cache.attends
    )


def reserve_bytes(caches: Sequence[Any], tokens: int, kv_per_token: int, itemsize: int) -> int:
    """Bytes one sequence of ``tokens`` positions needs in ``caches`` (a fresh ``make_cache()``):
    ``kv_per_token`` per position for the attention layers, plus each other layer's own."""
    fixed = sum(cache.reserve_bytes(tokens, itemsize) for cache in caches if not cache.attends)
    return tokens * kv_per_token + fixed

#: Positions a cache's buffers grow by. Not 256: MLX's CUDA backend sends one-position attention
#: over a cache whose capacity is a multiple of 256 (mlx-lm's step) to cuDNN, whose per-call host
#: work outweighs its device time at these lengths, and every other one to its own vector kernel.
#: A one-token decode step on the GPU is bound by the host, and the vector kernel's step is faster
#: (H100, Llama-3.2-1B shape, bare decode loop, six alternating rounds, median tok/s: bf16 612 vs
#: 556 with 256, 4-bit 477 vs 456; with the other defaults of today, 535 vs 441 and 361 vs 337;
#: ``bench/results/decode_profile_*_h100.json``, ``bench/decode_profile.py --variants``). With 264
#: a capacity is a multiple of 256 only from 8,448 positions on, where cuDNN's kernel earns its
#: cost. Other backends do not care.
CACHE_STEP = 264


class WritesAndAttends:
    """``write_and_attend`` for a cache of two buffers ``keys``, ``values`` (``[B, H, C, D]``)
    written from a position on: :meth:`_written`, :meth:`_make_room` and :meth:`_advance` say
    where, make the room and move on."""

    keys: Any
    values: Any
    #: False for a subclass that stores positions its own way (its own ``update_and_fetch``
    #: without the hooks below): it keeps the plain path. Decided once per class.
    _writes_in_place: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "update_and_fetch" in cls.__dict__:
            cls._writes_in_place = "_advance" in cls.__dict__

    def write_and_attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        into_cache: IntoCache,
        *,
        scale: float,
        mask: str | mx.array | None,
        window: int | None = None,
    ) -> mx.array | None:
        """``update_and_fetch`` and the attention of ``queries`` over the result (``window``:
        each query's last positions only) in one call of an attention kernel's ``into_cache``,
        which writes the buffers in place (held here alone, as a slice update's are). None, with
        nothing written, where the kernel declines, or where a subclass stores positions its own
        way (its own ``update_and_fetch``)."""
        if not self._writes_in_place:
            return None
        start, length = self._written(), keys.shape[2]
        self._make_room(keys, values, start + length)
        if window is not None:
            mask = window_mask(mask, queries.shape[2], start + length, window)
        result = into_cache(queries, keys, values, self.keys, self.values, start, scale=scale, mask=mask)
        if result is None:
            return None
        out, self.keys, self.values = result
        self._advance(start + length)
        return out

    def _written(self) -> int:
        """Where the next positions go."""
        raise NotImplementedError

    def _make_room(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Buffers shaped for ``keys``, ``values`` and holding at least ``needed`` positions."""
        raise NotImplementedError

    def _advance(self, length: int) -> None:
        """``length`` positions are now written."""
        raise NotImplementedError


class KVCache(WritesAndAttends):
    """Keys and values of one layer, ``[B, H, S, D]``, grown in steps of :attr:`step` positions.

    The buffers are pre-allocated so a decode step writes one position in place instead of
    concatenating (which would copy the whole cache every token).
    """

    attends: ClassVar[bool] = True
    partial_reuse: ClassVar[bool] = True
    #: Positions added each time the buffers grow.
    step: int = CACHE_STEP

    def __init__(self, width: int | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        #: Number of valid positions.
        self.offset = 0
        #: Elements one position stores, keys and values together, where the layer declares it
        #: (multi-head latent attention keeps one latent and one rotary key, not a key and a
        #: value per head); None: a key and a value per key/value head (see :func:`position_bytes`).
        self.width = width

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``[B, H, L, D]``) and return every valid position so far."""
        start, length = self.offset, keys.shape[2]
        if self.keys is None or self.values is None or start + length > self.keys.shape[2]:
            self._grow(keys, values, start + length)
        assert self.keys is not None and self.values is not None
        self.offset = start + length
        # Explicit slices, not ``...``: this runs once per layer and token, and MLX parses an
        # index with an ellipsis a third slower.
        self.keys[:, :, start : self.offset] = keys
        self.values[:, :, start : self.offset] = values
        return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]

    def _written(self) -> int:
        return self.offset

    def _make_room(self, keys: mx.array, values: mx.array, needed: int) -> None:
        if self.keys is None or self.values is None or needed > self.keys.shape[2]:
            self._grow(keys, values, needed)

    def _advance(self, length: int) -> None:
        self.offset = length

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = -(-needed // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_keys = mx.zeros((batch, heads, capacity, k_dim), dtype=keys.dtype)
        new_values = mx.zeros((batch, heads, capacity, values.shape[3]), dtype=values.dtype)
        if self.keys is not None and self.values is not None and self.offset > 0:
            new_keys[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_values[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_keys, new_values

    @property
    def state(self) -> list[mx.array]:
        """The arrays holding the cache (to evaluate after a prefill chunk); empty when unused."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` can drop positions (a rotating window cache could not)."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (rejected draft tokens); return how many were dropped."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers (not only the valid positions)."""
        return sum(array.nbytes for array in self.state)

    def __len__(self) -> int:
        return self.offset

    def to_batch(self) -> BatchKVCache:
        if self.keys is None or self.values is None or self.offset == 0:
            return BatchKVCache.empty()
        return BatchKVCache.from_cache(self)

    def snapshot(self) -> tuple[mx.array, ...]:
        # Copies: the running request goes on writing its buffers in place.
        if self.keys is None or self.values is None:
            return ()
        return (
            mx.contiguous(self.keys[..., : self.offset, :]),
            mx.contiguous(self.values[..., : self.offset, :]),
        )

    def restore(self, arrays: tuple[mx.array, ...], length: int) -> None:
        keys, values = arrays
        self._grow(keys, values, length)
        assert self.keys is not None and self.values is not None
        self.offset = length
        self.keys[..., :length, :] = keys[..., :length, :]
        self.values[..., :length, :] = values[..., :length, :]

    def reserve_bytes(self, tokens: int, itemsize: int) -> int:
        return 0  # counted from the model's head shapes (see reserve_bytes)

    @classmethod
    def from_arrays(cls, keys: mx.array, values: mx.array) -> KVCache:
        """A cache holding ``keys``/``values`` (``[B, H, S, D]``) as its first ``S`` positions."""
        cache = cls()
        cache._grow(keys, values, keys.shape[2])
        assert cache.keys is not None and cache.values is not None
        cache.offset = keys.shape[2]
        cache.keys[..., : cache.offset, :] = keys
        cache.values[..., : cache.offset, :] = values
        return cache


class RightAlignedRows:
    """Rows of a batch cache ending together at position :attr:`length`, row ``i`` starting after
    ``left_padding[i]`` unused positions: each row's rotary position and the padding mask."""

    left_padding: list[int]
    length: int
    _offset: mx.array | None

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def offset(self) -> int | mx.array:
        """Each row's number of positions: where its next token's rotary position is. An int when
        every row has the same length (no per-row offsets to upload), else an ``[B]`` array."""
        first = self.left_padding[0] if self.left_padding else 0
        if all(pad == first for pad in self.left_padding):
            return self.length - first
        if self._offset is None:
            self._offset = mx.array([self.length - pad for pad in self.left_padding])
        return self._offset

    @property
    def padded(self) -> bool:
        """Whether some row starts after padding (only then does attention need a mask)."""
        return any(pad > 0 for pad in self.left_padding)

    def mask(self, extra: int = 1) -> mx.array:
        """Boolean ``[B, 1, 1, length + extra]`` mask letting each row see only its own positions
        (for a decode step that adds ``extra`` positions)."""
        positions = mx.arange(self.length + extra)
        pads = mx.array(self.left_padding)
        return (positions[None, :] >= pads[:, None])[:, None, None, :]

    def draft_mask(self, queries: int) -> mx.array:
        """Boolean ``[B, 1, queries, length + queries]`` mask of a step that adds ``queries``
        positions to every row (a verified draft): each new position sees its row's own earlier
        positions and itself."""
        positions = mx.arange(self.length + queries)
        rows = mx.arange(self.length, self.length + queries)
        pads = mx.array(self.left_padding)
        causal = positions[None, None, :] <= rows[None, :, None]
        return (causal & (positions[None, None, :] >= pads[:, None, None]))[:, None]

    def _roll_back(self, drop: Sequence[int], arrays: list[mx.array]) -> list[mx.array]:
        """Forget the last ``drop[i]`` positions of row ``i`` (its rejected draft tokens) in
        ``arrays`` (``[B, H, capacity, *]``, positions on axis 2). What every row drops is cut
        from the end; a row that drops more is moved right by the difference (its padding grows),
        so that the rows still end together and each looks as if the rejected tokens had never
        been written."""
        least = min(drop, default=0)
        self.length -= least
        self._offset = None
        extra = [n - least for n in drop]
        if not any(extra):
            return arrays
        length = self.length
        index = mx.maximum(mx.arange(length)[None, :] - mx.array(extra)[:, None], 0)
        moved = []
        for array in arrays:
            where = index.reshape(len(extra), 1, length, *([1] * (array.ndim - 3)))
            array[:, :, :length] = mx.take_along_axis(array[:, :, :length], where, axis=2)
            moved.append(array)
        self.left_padding = [pad + n for pad, n in zip(self.left_padding, extra, strict=True)]
        return moved


class BatchKVCache(RightAlignedRows, WritesAndAttends):
    """Keys and values of one layer for a batch of sequences of different lengths.

    Rows are right-aligned: every row ends at position :attr:`length`, and row ``i`` starts after
    ``left_padding[i]`` unused positions. Each row's rotary position (:attr:`offset`) is its own
    length, and :meth:`mask` hides the padding from attention. Rows join with :meth:`extend` (the
    shorter side is padded on the left) and leave with :meth:`filter`.
    """

    attends: ClassVar[bool] = True
    step: int = CACHE_STEP

    def __init__(self, keys: mx.array, values: mx.array, left_padding: list[int], length: int):
        self.keys = keys  # [B, H, capacity, D]; positions >= length are free
        self.values = values
        self.left_padding = left_padding
        self.length = length
        self._offset: mx.array | None = None

    @classmethod
    def from_cache(cls, cache: KVCache) -> BatchKVCache:
        """A one-row batch from a single-sequence cache (e.g. after its prefill)."""
        assert cache.keys is not None and cache.values is not None
        return cls(cache.keys, cache.values, [0] * cache.keys.shape[0], cache.offset)

    @classmethod
    def for_prompts(cls, left_padding: list[int]) -> BatchKVCache:
        """Rows with no positions yet, to prefill together: row ``i``'s prompt is written after
        ``left_padding[i]`` padding positions, so that every row ends at the same position (its
        heads and dtype are taken from the first keys written)."""
        nothing = mx.zeros((len(left_padding), 1, 0, 1))
        return cls(nothing, nothing, list(left_padding), 0)

    @classmethod
    def empty(cls) -> BatchKVCache:
        """One row with no positions (a one-token prompt's): its heads and dtype are taken from
        the first keys written to it or from the rows it joins."""
        return cls.for_prompts([0])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, length = self.length, keys.shape[2]
        if self.keys.shape[2] == 0:
            self._shape_like(keys, values)
        if start + length > self.keys.shape[2]:
            self._reserve(start + length)
        self.length = start + length
        self._offset = None
        self.keys[:, :, start : self.length] = keys  # explicit slices: see KVCache
        self.values[:, :, start : self.length] = values
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def _written(self) -> int:
        return self.length

    def _make_room(self, keys: mx.array, values: mx.array, needed: int) -> None:
        if self.keys.shape[2] == 0:
            self._shape_like(keys, values)
        if needed > self.keys.shape[2]:
            self._reserve(needed)

    def _advance(self, length: int) -> None:
        self.length = length
        self._offset = None

    def _shape_like(self, keys: mx.array, values: mx.array) -> None:
        """Give a cache with no positions allocated the heads and head size of ``keys`` and
        ``values``: the engine makes a one-token prompt's empty rows in one shape for every
        layer, and layers may differ (Gemma 4's global layers, layers sharing another's cache)."""
        B = self.keys.shape[0]
        self.keys = mx.zeros((B, keys.shape[1], 0, keys.shape[3]), dtype=keys.dtype)
        self.values = mx.zeros((B, values.shape[1], 0, values.shape[3]), dtype=values.dtype)

    def _reserve(self, needed: int) -> None:
        capacity = -(-needed // self.step) * self.step
        grow = capacity - self.keys.shape[2]
        if grow > 0:
            self.keys = _pad_positions(self.keys, right=grow)
            self.values = _pad_positions(self.values, right=grow)

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows in ``keep`` (in that order), dropping padding no row needs."""
        index = mx.array(keep)
        self.left_padding = [self.left_padding[i] for i in keep]
        shift = min(self.left_padding) if self.left_padding else 0
        self.keys = self.keys[index, :, shift:, :]
        self.values = self.values[index, :, shift:, :]
        self.left_padding = [pad - shift for pad in self.left_padding]
        self.length -= shift
        self._offset = None

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows, aligning both sides' ends."""
        for empty, full in ((self, other), (other, self)):
            if empty.keys.shape[2] == 0 and full.keys.shape[2] > 0:
                empty._shape_like(full.keys, full.values)
        length = max(self.length, other.length)
        capacity = max(self.keys.shape[2] + length - self.length, other.keys.shape[2] + length - other.length)
        parts = []
        for cache in (self, other):
            before = length - cache.length
            after = capacity - before - cache.keys.shape[2]
            parts.append(
                (
                    _pad_positions(cache.keys, left=before, right=after),
                    _pad_positions(cache.values, left=before, right=after),
                    [pad + before for pad in cache.left_padding],
                )
            )
        self.keys = mx.concatenate([parts[0][0], parts[1][0]], axis=0)
        self.values = mx.concatenate([parts[0][1], parts[1][1]], axis=0)
        self.left_padding = parts[0][2] + parts[1][2]
        self.length = length
        self._offset = None

    def rollback(self, drop: Sequence[int]) -> None:
        """Forget the last ``drop[i]`` positions of row ``i`` (see :meth:`_roll_back`)."""
        self.keys, self.values = self._roll_back(drop, [self.keys, self.values])

    def extract(self, row: int) -> KVCache:
        """Row ``row`` as a single-sequence cache without its padding."""
        start = self.left_padding[row]
        return KVCache.from_arrays(
            self.keys[row : row + 1, :, start : self.length, :],
            self.values[row : row + 1, :, start : self.length, :],
        )

    @property
    def state(self) -> list[mx.array]:
        return [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _pad_positions(array: mx.array, *, left: int = 0, right: int = 0) -> mx.array:
    """Zero-pad the position axis (2) of a ``[B, H, S, D]`` array."""
    if left == 0 and right == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (left, right), (0, 0)])


class StateCache:
    """A recurrent layer's state for one sequence: a few arrays ``[B, ...]`` (a convolution's last
    inputs, an SSM or DeltaNet state), each None until the layer first runs. The layer reads
    them by index and writes new arrays back (``cache[i] = ...``, never in place), so snapshots
    share them safely: the surface of mlx-lm's ``ArraysCache``, whose layers the mlx-lm bridge
    runs unchanged. ``nbytes_hint`` is what one sequence's state takes (for the KV budget before
    the layer runs; 0 when unknown)."""

    attends: ClassVar[bool] = False
    partial_reuse: ClassVar[bool] = False

    def __init__(self, slots: int, nbytes_hint: int = 0):
        self.arrays: list[mx.array | None] = [None] * slots
        self.nbytes_hint = nbytes_hint
        #: Positions seen (advanced by :meth:`advance`; set by :meth:`restore`).
        self.offset = 0
        #: mlx-lm's layers mask a batched prefill's rows by ``lengths``: none here.
        self.lengths = None

    def __getitem__(self, index: int) -> mx.array | None:
        return self.arrays[index]

    # No ``__len__``: mlx-lm's layers test a cache with ``if cache:``, which must hold before the
    # first position too.

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.arrays[index] = value

    def advance(self, length: int) -> None:
        self.offset += length

    def make_mask(self, N: int, **_: Any) -> None:
        """No mask: a sequence's own positions only (mlx-lm's layers ask)."""
        return None

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.arrays if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.state)

    def is_trimmable(self) -> bool:
        """False: the state after position n is gone once position n + 1 was added."""
        return False

    def trim(self, n: int) -> int:
        if n > 0:
            raise ValueError("a recurrent state cannot drop positions")
        return 0

    def empty_like(self) -> StateCache:
        """A fresh cache of this kind and shapes."""
        return StateCache(len(self.arrays), self.nbytes_hint)

    def to_batch(self) -> BatchStateCache:
        return BatchStateCache(list(self.arrays), [self.offset], self.empty_like())

    def snapshot(self) -> tuple[mx.array, ...]:
        if any(a is None for a in self.arrays):
            return ()
        return tuple(a for a in self.arrays if a is not None)

    def restore(self, arrays: tuple[mx.array, ...], length: int) -> None:
        if arrays:
            self.arrays = list(arrays)
        self.offset = length

    def reserve_bytes(self, tokens: int, itemsize: int) -> int:
        return self.nbytes_hint


class RecurrentCache(StateCache):
    """:class:`StateCache` of a convolution then a recurrence, as mlxr's own layers use it:
    ``conv_state`` ``[B, *conv]`` (activations' dtype) and ``recurrent_state``
    ``[B, *recurrent]`` (float32), shapes per sequence declared so the KV budget can reserve
    them before the layer runs."""

    def __init__(self, conv: tuple[int, ...], recurrent: tuple[int, ...]):
        super().__init__(2)
        self.conv, self.recurrent = conv, recurrent

    @property
    def conv_state(self) -> mx.array | None:
        return self.arrays[0]

    @property
    def recurrent_state(self) -> mx.array | None:
        return self.arrays[1]

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None:
        """The states after ``length`` more positions."""
        self.arrays = [conv_state, recurrent_state]
        self.offset += length

    def empty_like(self) -> RecurrentCache:
        return RecurrentCache(self.conv, self.recurrent)

    def reserve_bytes(self, tokens: int, itemsize: int) -> int:
        return prod(self.conv) * itemsize + prod(self.recurrent) * 4


class BatchStateCache:
    """:class:`StateCache` for a batch: row ``i`` of each array is request ``i``'s. Rows have no
    padding (each decode step feeds every row one token), so joining is a concatenation; a row
    that has seen nothing holds zeros (the initial state). An array stays None while no row has
    it (a batch of one-token prompts before its first step). Same surface as the single
    sequence's, so a layer runs unchanged on either."""

    attends: ClassVar[bool] = False

    def __init__(self, arrays: list[mx.array | None], positions: list[int], template: StateCache):
        self.arrays = arrays
        self.positions = positions
        #: mlx-lm's layers mask a batched prefill's rows by ``lengths``: none here.
        self.lengths = None
        #: An empty cache of the rows' kind and shapes (what :meth:`extract` fills).
        self.template = template
        #: Set around a verification pass of drafts: the layer then hands over the states after
        #: each position (:meth:`keep_positions`), which :meth:`rollback` picks from per row.
        self.keeps_positions = False
        self._spans: tuple[list[mx.array], list[mx.array]] | None = None

    @property
    def rolls_back(self) -> bool:
        """mlxr's own recurrent layers (a :class:`RecurrentCache`'s) keep the states of a verified
        span; other layers (the mlx-lm bridge's) do not, so their rows draft nothing."""
        return isinstance(self.template, RecurrentCache)

    def keep_positions(self, convs: list[mx.array], states: list[mx.array]) -> None:
        """The convolution states and recurrent states after each position of a verified span
        (``[B, ...]`` each, in order), for :meth:`rollback`."""
        self._spans = (convs, states)

    def rollback(self, drop: Sequence[int]) -> None:
        """Undo the last ``drop[i]`` positions of row ``i``: its states become those after its
        last kept position of the verified span."""
        spans, self._spans = self._spans, None
        if not any(drop):
            return
        if spans is None:
            raise ValueError("a recurrent state can only roll back a span whose states it kept")
        convs, states = spans
        length = len(convs)
        rows = mx.arange(len(drop))
        index = mx.array([length - 1 - n for n in drop])
        self.arrays = [mx.stack(convs, axis=1)[rows, index], mx.stack(states, axis=1)[rows, index]]
        self.positions = [n - d for n, d in zip(self.positions, drop, strict=True)]

    __getitem__ = StateCache.__getitem__
    __setitem__ = StateCache.__setitem__
    make_mask = StateCache.make_mask
    state = StateCache.state
    nbytes = StateCache.nbytes

    @property
    def conv_state(self) -> mx.array | None:
        return self.arrays[0]

    @property
    def recurrent_state(self) -> mx.array | None:
        return self.arrays[1]

    @property
    def batch_size(self) -> int:
        return len(self.positions)

    @property
    def offset(self) -> int | mx.array:
        first = self.positions[0] if self.positions else 0
        if all(length == first for length in self.positions):
            return first
        return mx.array(self.positions)

    def advance(self, length: int) -> None:
        self.positions = [n + length for n in self.positions]

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None:
        self.arrays = [conv_state, recurrent_state]
        self.advance(length)

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep)
        self.positions = [self.positions[i] for i in keep]
        self.arrays = [None if a is None else a[index] for a in self.arrays]

    def extend(self, other: BatchStateCache) -> None:
        joined: list[mx.array | None] = []
        for mine, theirs in zip(self.arrays, other.arrays, strict=True):
            like = mine if mine is not None else theirs
            if like is None:
                joined.append(None)
                continue
            if mine is None:
                mine = mx.zeros((self.batch_size, *like.shape[1:]), dtype=like.dtype)
            if theirs is None:
                theirs = mx.zeros((other.batch_size, *like.shape[1:]), dtype=like.dtype)
            joined.append(mx.concatenate([mine, theirs], axis=0))
        self.arrays = joined
        self.positions = self.positions + other.positions

    def extract(self, row: int) -> StateCache:
        cache = self.template.empty_like()
        cache.arrays = [None if a is None else a[row : row + 1] for a in self.arrays]
        cache.offset = self.positions[row]
        return cache
