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
without bias (:meth:`Codec.key_terms`, :meth:`Codec.query_terms`).
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


def pack(codes: mx.array, bits: int) -> mx.array:
    """``[..., D]`` codes below ``2**bits`` -> ``[..., D * bits // 8]`` bytes: each run of 8 codes
    in ``bits`` bytes, code ``j`` at bit ``bits * j``."""
    *lead, D = codes.shape
    groups = codes.astype(mx.uint32).reshape(*lead, D // 8, 8)
    word = (groups << (bits * mx.arange(8, dtype=mx.uint32))).sum(axis=-1)  # disjoint bit fields
    parts = (word[..., None] >> (8 * mx.arange(bits, dtype=mx.uint32))) & 0xFF
    return parts.astype(mx.uint8).reshape(*lead, D * bits // 8)


def unpack(packed: mx.array, bits: int) -> mx.array:
    """The codes :func:`pack` stored, ``[..., D]`` ``uint32``."""
    *lead, size = packed.shape
    parts = packed.astype(mx.uint32).reshape(*lead, size // bits, bits)
    word = (parts << (8 * mx.arange(bits, dtype=mx.uint32))).sum(axis=-1)
    codes = (word[..., None] >> (bits * mx.arange(8, dtype=mx.uint32))) & ((1 << bits) - 1)
    return codes.reshape(*lead, size // bits * 8)


@attrs.frozen(eq=False)
class Codec:
    """One layer's rotation, sketch and codebooks for heads of ``dim``: keys on ``bits - 1`` bits
    and a sign sketch, values on ``bits``. Arrays are float32."""

    dim: int
    bits: int
    rotation: mx.array
    sketch: mx.array
    key_levels: mx.array
    key_edges: mx.array
    value_levels: mx.array
    value_edges: mx.array

    def _direction(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``[..., D]`` -> norms ``[..., 1]`` and rotated unit directions ``[..., D]``."""
        x = x.astype(mx.float32)
        norm = mx.linalg.norm(x, axis=-1, keepdims=True)
        return norm, (x / mx.maximum(norm, 1e-30)) @ self.rotation

    def encode_keys(self, keys: mx.array) -> list[mx.array]:
        """``[..., D]`` keys -> level codes (``bits - 1`` bits each), sketch signs (1 bit each),
        and ``[..., 2]`` float16: the norm, and the norm times the residual's norm."""
        norm, unit = self._direction(keys)
        codes = (unit[..., None] > self.key_edges).sum(axis=-1)
        residual = unit - mx.take(self.key_levels, codes)
        signs = (residual @ self.sketch.T) >= 0
        scales = mx.concatenate(
            [norm, norm * mx.linalg.norm(residual, axis=-1, keepdims=True)], axis=-1
        )
        return [pack(codes, self.bits - 1), pack(signs, 1), scales.astype(mx.float16)]

    def encode_values(self, values: mx.array) -> list[mx.array]:
        """``[..., D]`` values -> level codes (``bits`` bits each) and ``[..., 1]`` float16 norms."""
        norm, unit = self._direction(values)
        codes = (unit[..., None] > self.value_edges).sum(axis=-1)
        return [pack(codes, self.bits), norm.astype(mx.float16)]

    def key_terms(self, codes: mx.array, signs: mx.array, scales: mx.array) -> mx.array:
        """Stored keys as ``[..., 2D]`` rows whose inner product with :meth:`query_terms` is the
        estimate of ``<q, k>``: the levels times the norm, then the signs times the sketch's
        weight ``sqrt(pi/2) / D * |k| |r|``."""
        scales = scales.astype(mx.float32)
        levels = mx.take(self.key_levels, unpack(codes, self.bits - 1)) * scales[..., :1]
        weight = scales[..., 1:] * (math.sqrt(math.pi / 2) / self.dim)
        return mx.concatenate([levels, (2.0 * unpack(signs, 1) - 1.0) * weight], axis=-1)

    def query_terms(self, queries: mx.array) -> mx.array:
        """``[..., D]`` queries -> ``[..., 2D]``: rotated, then rotated and sketched."""
        rotated = queries @ self.rotation
        return mx.concatenate([rotated, rotated @ self.sketch.T], axis=-1)

    def values_rotated(self, codes: mx.array, norms: mx.array) -> mx.array:
        """Stored values, still rotated: ``[..., D]`` (``@ rotation.T`` turns them back)."""
        return mx.take(self.value_levels, unpack(codes, self.bits)) * norms.astype(mx.float32)

    def decode_keys(self, codes: mx.array, signs: mx.array, scales: mx.array) -> mx.array:
        """Keys whose inner product with any query is the stored estimate (:meth:`key_terms`)."""
        terms = self.key_terms(codes, signs, scales)
        D = self.dim
        return (terms[..., :D] + terms[..., D:] @ self.sketch) @ self.rotation.T

    def decode_values(self, codes: mx.array, norms: mx.array) -> mx.array:
        return self.values_rotated(codes, norms) @ self.rotation.T


def _edges(levels: np.ndarray) -> np.ndarray:
    return (levels[1:] + levels[:-1]) / 2


@functools.cache
def layer_codec(dim: int, bits: int, layer: int) -> Codec:
    """Layer ``layer``'s codec for heads of ``dim`` (built once, from numpy, so any thread may)."""
    rng = np.random.default_rng([SEED, layer, dim])
    signs = rng.choice(np.array([-1.0, 1.0]), dim)
    sketch = rng.standard_normal((dim, dim))
    key_levels, _ = lloyd_max(dim, bits - 1)
    value_levels, _ = lloyd_max(dim, bits)

    def array(values: np.ndarray) -> mx.array:
        return mx.array(values.astype(np.float32))

    return Codec(
        dim=dim,
        bits=bits,
        rotation=array(rotation_matrix(signs)),
        sketch=array(sketch),
        key_levels=array(key_levels),
        key_edges=array(_edges(key_levels)),
        value_levels=array(value_levels),
        value_edges=array(_edges(value_levels)),
    )
