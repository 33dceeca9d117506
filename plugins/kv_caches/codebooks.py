"""The arithmetic of TurboQuant-style storage (:mod:`mlxr_plugins.kv_caches.turboquant`): the
per-layer rotation and sketch, Lloyd-Max codebooks for rotated coordinates, bit packing.

A head vector ``x`` of size ``D`` is stored as its norm and its direction ``u = x / |x|`` rotated by
``R = H diag(signs)`` (a Walsh-Hadamard matrix, normalized, after a seeded random sign per
coordinate): orthogonal, so inner products are kept, and it spreads any vector over all
coordinates. For a uniformly random rotation each coordinate of ``R u`` has the density
``∝ (1 - t²)^((D - 3) / 2)`` on ``[-1, 1]`` (about ``N(0, 1/D)``), whatever ``u``; the randomized
Hadamard transform is the fast stand-in for it. Each coordinate is then the index of its nearest
level in the Lloyd-Max codebook for that density (:func:`lloyd_max`), ``bits`` bits.

Keys add a 1-bit sketch of the residual ``r = R u - levels`` (QJL): the signs of ``S r`` for a
seeded Gaussian ``D x D`` matrix ``S``. For a query ``q``,
``sqrt(pi/2) / D * |r| * <S R q, sign(S r)>`` is an unbiased estimate of ``<R q, r>`` over the draw
of ``S`` (``E[<s, a> sign(<s, r>)] = sqrt(2/pi) <a, r> / |r|`` for a Gaussian row ``s``), with
variance ``(pi/2 |R q|² |r|² - <R q, r>²) / D``; with the levels' part it estimates ``<q, u>``
without bias (:meth:`Codec.scores`).

Codes are stored in bit planes of 4, 2 or 1 bits (:data:`PLANES`: 3-bit codes as a 2-bit and a
1-bit plane), a whole number of codes per byte, so a lookup per byte in a 256-row table turns
stored bytes into levels.
"""

from __future__ import annotations

import functools
import math

import attrs
import mlx.core as mx
import numpy as np

#: Seed of every layer's signs and sketch (with the layer's index and head size).
SEED = 0x7A3C
#: Points of the grid the codebooks are fitted on.
GRID = 1 << 15


@functools.cache
def lloyd_max(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """The ``2**bits`` Lloyd-Max levels (ascending) for one coordinate of a uniformly random unit
    vector in ``R^dim`` and the mean squared error ``E|u - levels(u)|²`` they leave on the whole
    unit vector (``dim`` coordinates): the MSE distortion TurboQuant bounds by
    ``sqrt(3) pi / 2 * 4**-bits`` (0.36, 0.117, 0.03, 0.009 for 1 to 4 bits at large ``dim``)."""
    x = np.linspace(-1.0, 1.0, GRID + 2)[1:-1]
    log_density = 0.5 * (dim - 3) * np.log1p(-x * x)
    weight = np.exp(log_density - log_density.max())
    weight /= weight.sum()
    n = 1 << bits
    levels = np.interp((np.arange(n) + 0.5) / n, np.cumsum(weight), x)  # from the quantiles
    for _ in range(1000):
        cells = np.searchsorted((levels[1:] + levels[:-1]) / 2, x)
        updated = np.bincount(cells, weight * x, n) / np.bincount(cells, weight, n)
        converged = np.max(np.abs(updated - levels)) < 1e-12
        levels = updated
        if converged:
            break
    levels = (levels - levels[::-1]) / 2  # the density is even: so are its levels, exactly
    cells = np.searchsorted((levels[1:] + levels[:-1]) / 2, x)
    return levels, dim * float(np.sum(weight * (x - levels[cells]) ** 2))


def rotation_matrix(signs: np.ndarray) -> np.ndarray:
    """``R`` as a ``[D, D]`` matrix acting on rows (``x @ R`` is ``H (signs * x)``, ``H`` the
    normalized Walsh-Hadamard matrix). ``D`` a power of two, or one times 12, 20 or 28 (MLX's
    ``hadamard_transform``); raises ValueError for another."""
    dim = signs.shape[0]
    return np.array(
        mx.hadamard_transform(mx.array(np.diag(signs).astype(np.float32)), scale=dim**-0.5)
    )


#: How codes of each width are stored: bit planes of these widths, low bits first. Each plane
#: holds ``8 // width`` codes per byte, so that one table lookup per byte unpacks it.
PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,)}


@functools.cache
def byte_codes(width: int) -> np.ndarray:
    """``[256, 8 // width]``: the codes a byte of a ``width``-bit plane holds, first code lowest."""
    per = 8 // width
    return (np.arange(256)[:, None] >> (width * np.arange(per))) & ((1 << width) - 1)


def pack(codes: mx.array, bits: int) -> mx.array:
    """``[..., D]`` codes below ``2**bits`` -> ``[..., D * bits // 8]`` bytes: the bit planes of
    :data:`PLANES` one after another, each ``8 // width`` codes per byte."""
    *lead, D = codes.shape
    codes = codes.astype(mx.uint32)
    planes, shift = [], 0
    for width in PLANES[bits]:
        per = 8 // width
        part = ((codes >> shift) & ((1 << width) - 1)).reshape(*lead, D // per, per)
        planes.append((part << (width * mx.arange(per, dtype=mx.uint32))).sum(axis=-1).astype(mx.uint8))
        shift += width
    return mx.concatenate(planes, axis=-1)


def unpack(packed: mx.array, bits: int, tables: dict[int, mx.array] | None = None) -> mx.array:
    """The codes :func:`pack` stored, ``[..., D]``; ``tables`` (width -> a table of
    :func:`byte_codes`' rows, as an ``mx`` array) may give them another form, such as levels."""
    *lead, size = packed.shape
    D = size * 8 // bits
    codes: mx.array | None = None
    offset, shift = 0, 0
    for width in PLANES[bits]:
        plane = packed[..., offset : offset + D * width // 8]
        table = tables[width] if tables is not None else mx.array(byte_codes(width).astype(np.uint32))
        part = mx.take(table, plane, axis=0).reshape(*lead, D)
        codes = part if codes is None else codes + (part << shift)
        offset, shift = offset + D * width // 8, shift + width
    assert codes is not None
    return codes


class Levels:
    """A codebook's levels and how to look up packed codes in it: with one bit plane, one table
    lookup per byte gives the levels (:func:`byte_codes` mapped through them); with more, the
    codes are put together from their planes first."""

    def __init__(self, levels: np.ndarray, bits: int):
        self.bits = bits
        self.levels = mx.array(levels.astype(np.float32))
        self.edges = mx.array(((levels[1:] + levels[:-1]) / 2).astype(np.float32))
        (single,) = PLANES[bits] if len(PLANES[bits]) == 1 else (None,)
        self.table = mx.array(levels[byte_codes(single)].astype(np.float32)) if single else None
        self.code_tables = {w: mx.array(byte_codes(w).astype(np.uint32)) for w in PLANES[bits]}

    def encode(self, x: mx.array) -> mx.array:
        """Each coordinate's nearest level, packed."""
        return pack((x[..., None] > self.edges).sum(axis=-1), self.bits)

    def nearest(self, x: mx.array) -> mx.array:
        """Each coordinate's nearest level."""
        return mx.take(self.levels, (x[..., None] > self.edges).sum(axis=-1))

    def decode(self, packed: mx.array) -> mx.array:
        """The levels of packed codes, float32 ``[..., D]``."""
        if self.table is not None:
            return unpack(packed, self.bits, {self.bits: self.table})
        return mx.take(self.levels, unpack(packed, self.bits, self.code_tables))


@attrs.frozen(eq=False)
class Codec:
    """One layer's rotation, sketch and codebooks for heads of ``dim``: keys on ``bits - 1`` bits
    and a sign sketch (``sketch``; without it keys on ``bits`` like the values: TurboQuant's MSE
    variant, lower variance, no longer unbiased), values on ``bits``. Arrays are float32."""

    dim: int
    bits: int
    sketch_keys: bool
    rotation: mx.array
    sketch: mx.array
    keys: Levels
    values: Levels
    signs: Levels = attrs.field(factory=lambda: Levels(np.array([-1.0, 1.0]), 1))

    def _direction(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``[..., D]`` -> norms ``[..., 1]`` and rotated unit directions ``[..., D]``."""
        x = x.astype(mx.float32)
        norm = mx.linalg.norm(x, axis=-1, keepdims=True)
        return norm, (x / mx.maximum(norm, 1e-30)) @ self.rotation

    @property
    def key_arrays(self) -> int:
        """How many arrays :meth:`encode_keys` makes."""
        return 3 if self.sketch_keys else 2

    def encode_keys(self, keys: mx.array) -> list[mx.array]:
        """``[..., D]`` keys -> level codes (``bits - 1`` bits each), sketch signs (1 bit each),
        and ``[..., 2]`` float16: the norm, and the norm times the residual's norm; without the
        sketch, level codes (``bits`` bits each) and ``[..., 1]`` float16 norms."""
        if not self.sketch_keys:
            norm, unit = self._direction(keys)
            return [self.keys.encode(unit), norm.astype(mx.float16)]
        norm, unit = self._direction(keys)
        residual = unit - self.keys.nearest(unit)
        scales = mx.concatenate([norm, norm * mx.linalg.norm(residual, axis=-1, keepdims=True)], axis=-1)
        return [self.keys.encode(unit), self.signs.encode(residual @ self.sketch.T), scales.astype(mx.float16)]

    def encode_values(self, values: mx.array) -> list[mx.array]:
        """``[..., D]`` values -> level codes (``bits`` bits each) and ``[..., 1]`` float16 norms."""
        norm, unit = self._direction(values)
        return [self.values.encode(unit), norm.astype(mx.float16)]

    def query_terms(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """``[..., D]`` queries -> rotated, and rotated then sketched."""
        rotated = queries @ self.rotation
        return rotated, rotated @ self.sketch.T

    def scores(self, queries: mx.array, *keys: mx.array) -> mx.array:
        """Estimates of ``<q, k>``: ``queries`` ``[..., L, D]`` (each group of heads sharing
        stored keys ``[..., S, *]``, broadcast on the axis before ``L``) -> ``[..., L, S]``: the
        levels' part times each key's norm plus the sketch's times ``sqrt(pi/2) / D |k| |r|``.
        ``keys``: what :meth:`encode_keys` made."""
        if not self.sketch_keys:
            codes, norms = keys
            levels = self.keys.decode(codes)[..., None, :, :]
            return ((queries @ self.rotation) @ levels.swapaxes(-1, -2)) * norms.astype(mx.float32)[..., None, :, 0][..., None, :]
        codes, signs, scales = keys
        rotated, sketched = self.query_terms(queries)
        scales = scales.astype(mx.float32)[..., None, :, :]
        weight = scales[..., 1] * (math.sqrt(math.pi / 2) / self.dim)
        levels = self.keys.decode(codes)[..., None, :, :]
        signs_ = self.signs.decode(signs)[..., None, :, :]
        return (rotated @ levels.swapaxes(-1, -2)) * scales[..., 0][..., None, :] + (
            sketched @ signs_.swapaxes(-1, -2)
        ) * weight[..., None, :]

    def weighted_values(self, probs: mx.array, codes: mx.array, norms: mx.array) -> mx.array:
        """``probs`` ``[..., L, S]`` against stored values ``[..., S, *]`` (broadcast as in
        :meth:`scores`) -> ``[..., L, D]``, rotated back."""
        weights = probs * norms.astype(mx.float32)[..., None, :, 0][..., None, :]
        return (weights @ self.values.decode(codes)[..., None, :, :]) @ self.rotation.T

    def decode_keys(self, *keys: mx.array) -> mx.array:
        """Keys whose inner product with any query is the stored estimate (:meth:`scores`)."""
        if not self.sketch_keys:
            codes, norms = keys
            return (self.keys.decode(codes) * norms.astype(mx.float32)) @ self.rotation.T
        codes, signs, scales = keys
        scales = scales.astype(mx.float32)
        weight = scales[..., 1:] * (math.sqrt(math.pi / 2) / self.dim)
        rotated = self.keys.decode(codes) * scales[..., :1] + (self.signs.decode(signs) * weight) @ self.sketch
        return rotated @ self.rotation.T

    def decode_values(self, codes: mx.array, norms: mx.array) -> mx.array:
        return (self.values.decode(codes) * norms.astype(mx.float32)) @ self.rotation.T


@functools.cache
def layer_codec(dim: int, bits: int, layer: int, sketch_keys: bool = True) -> Codec:
    """Layer ``layer``'s codec for heads of ``dim`` (built once, from numpy, so any thread may)."""
    rng = np.random.default_rng([SEED, layer, dim])
    signs = rng.choice(np.array([-1.0, 1.0]), dim)
    sketch = rng.standard_normal((dim, dim))
    return Codec(
        dim=dim,
        bits=bits,
        sketch_keys=sketch_keys,
        rotation=mx.array(rotation_matrix(signs).astype(np.float32)),
        sketch=mx.array(sketch.astype(np.float32)),
        keys=Levels(lloyd_max(dim, bits - sketch_keys)[0], bits - sketch_keys),
        values=Levels(lloyd_max(dim, bits)[0], bits),
    )
