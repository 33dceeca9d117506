"""Per-layer key/value caches.

One cache object per attention layer and sequence. The attention layer calls
:meth:`KVCache.update_and_fetch` with the keys and values of the new positions and attends over what
it returns; the decoder reads :attr:`KVCache.offset` (positions held) and evaluates
:attr:`KVCache.state` after a prefill chunk. Sliding-window and batched caches subclass
:class:`KVCache` and keep the same surface.
"""

from __future__ import annotations

import mlx.core as mx

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


class KVCache:
    """Keys and values of one layer, ``[B, H, S, D]``, grown in steps of :attr:`step` positions.

    The buffers are pre-allocated so a decode step writes one position in place instead of
    concatenating (which would copy the whole cache every token).
    """

    #: Positions added each time the buffers grow.
    step: int = CACHE_STEP

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        #: Number of valid positions.
        self.offset = 0

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


class BatchKVCache:
    """Keys and values of one layer for a batch of sequences of different lengths.

    Rows are right-aligned: every row ends at position :attr:`length`, and row ``i`` starts after
    ``left_padding[i]`` unused positions. Each row's rotary position (:attr:`offset`) is its own
    length, and :meth:`mask` hides the padding from attention. Rows join with :meth:`extend` (the
    shorter side is padded on the left) and leave with :meth:`filter`.
    """

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
