"""Exact repacking of ggml's 32-element blocks into MLX affine quantization (group size 32).

A ggml block of Q4_0, Q4_1 or Q8_0 is a float16 scale ``d`` (and for Q4_1 a float16 minimum ``m``)
followed by 32 integers; it dequantizes to ``d * q + c`` with one constant ``c`` per block. MLX's
affine quantization stores the same thing per group: ``w = scales * q + biases`` with unsigned ``q``
packed little-endian into uint32 words (element ``i`` of a word in bits ``bits*i .. bits*i+bits-1``).

============  ========================  ==========  ===========
ggml type     ggml value                MLX scale   MLX bias
============  ========================  ==========  ===========
Q4_0          ``d * (q - 8)``           ``d``       ``-8 d``
Q4_1          ``d * q + m``             ``d``       ``m``
Q8_0          ``d * x`` (int8 ``x``)    ``d``       ``-128 d``  (``q = x + 128``)
============  ========================  ==========  ===========

Only the bit layout differs: ggml's 4-bit block keeps elements ``0..15`` in the low nibbles of its
16 bytes and ``16..31`` in the high nibbles, while MLX packs elements ``2j, 2j+1`` into byte ``j``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

GROUP_SIZE = 32

#: ggml types with an exact MLX affine layout -> MLX bits.
EXACT_BITS = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
}


class Affine(NamedTuple):
    """One tensor in MLX affine form: ``weight`` uint32 ``[..., in*bits/32]``, ``scales`` and
    ``biases`` float32 ``[..., in/32]`` (float32 holds every float16 scale and product exactly)."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def repack(data: np.ndarray, qtype: GGMLQuantizationType) -> Affine:
    """Repack raw ggml blocks (``uint8 [..., bytes_per_row]``, as ``GGUFReader`` exposes them)."""
    if qtype == GGMLQuantizationType.Q4_0:
        d, qs = _split_blocks(data, 18, 2)
        scales = _half(d)
        return Affine(_pack_nibbles(qs), scales, -8 * scales, 4)
    if qtype == GGMLQuantizationType.Q4_1:
        dm, qs = _split_blocks(data, 20, 4)
        return Affine(_pack_nibbles(qs), _half(dm[..., :2]), _half(dm[..., 2:]), 4)
    if qtype == GGMLQuantizationType.Q8_0:
        d, qs = _split_blocks(data, 34, 2)
        scales = _half(d)
        # int8 x -> uint8 x + 128 is a flip of the sign bit.
        return Affine(_words(qs ^ np.uint8(0x80)), scales, -128 * scales, 8)
    raise ValueError(f"{qtype.name} has no exact MLX affine layout")


def _split_blocks(
    data: np.ndarray, block_bytes: int, head_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split rows of blocks into the per-block header (scales) and the packed quants."""
    if data.dtype != np.uint8 or data.shape[-1] % block_bytes:
        raise ValueError(
            f"expected rows of {block_bytes}-byte blocks, got {data.dtype} {data.shape}"
        )
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // block_bytes, block_bytes)
    return blocks[..., :head_bytes], blocks[..., head_bytes:]


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 pairs of bytes ``[..., n_blocks, 2]`` -> float32 ``[..., n_blocks]``."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _pack_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml 4-bit block order -> MLX order, ``[..., n_blocks, 16]`` bytes -> uint32 words."""
    even, odd = qs[..., 0::2], qs[..., 1::2]  # bytes 2j and 2j+1 of each block
    low = (even & np.uint8(0x0F)) | (odd << np.uint8(4))  # elements 2j, 2j+1
    high = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))  # elements 16+2j, 16+2j+1
    return _words(np.concatenate([low, high], axis=-1))


def _words(blocks: np.ndarray) -> np.ndarray:
    """Bytes ``[..., n_blocks, k]`` -> little-endian uint32 ``[..., n_blocks * k / 4]``."""
    flat = np.ascontiguousarray(blocks).reshape(*blocks.shape[:-2], -1)
    return flat.view("<u4")


def unpermute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (rows along axis 0).

    ``convert_hf_to_gguf`` reorders each head's rows ``[first half, second half]`` into interleaved
    pairs so ggml's adjacent-pair RoPE matches Hugging Face's half-split RoPE; this restores the
    Hugging Face order. Rows are independent, so it applies alike to dense weights, biases and to
    the packed weights, scales and biases of a quantized tensor.
    """
    rows = x.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def permute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of :func:`unpermute_rows`), for writing GGUF files."""
    rows = x.shape[0]
    return x.reshape(n_heads, 2, rows // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
