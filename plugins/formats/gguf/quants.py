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

Q5_0, Q5_1 and the 32-element sub-blocks of Q4_K and Q5_K are affine groups of 32 too (Q4_K's
sub-block scale is ``d * sc`` and its bias ``-dmin * m``, from 6-bit ``sc``, ``m``); for those we
read the scales from the block header, take the values from ``gguf``'s exact dequantization and
recover each integer as ``round((w - bias) / scale)``: the result dequantizes in MLX to the very
floats ggml computes. Types with 16-element sub-blocks (Q2_K, Q3_K, Q6_K) or a non-linear codebook
(IQ4_NL) have no exact layout: :data:`NEAREST_BITS` names the MLX format they are requantized to.

MXFP4 (gpt-oss's experts) is not affine but is MLX's ``mxfp4`` mode, nibbles reordered
(:func:`repack_mxfp4`).
"""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType

GROUP_SIZE = 32

#: ggml types with an exact MLX affine layout -> MLX bits.
EXACT_BITS = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
    GGMLQuantizationType.Q5_0: 5,
    GGMLQuantizationType.Q5_1: 5,
    GGMLQuantizationType.Q4_K: 4,
    GGMLQuantizationType.Q5_K: 5,
}

#: ggml types without an exact layout -> bits of the MLX format (group 32) they are requantized to
#: when kept quantized: never fewer bits than the source, since requantizing SmolLM2 to 4 bits
#: (group 64) changed its argmax. Any other quantized type gets 8.
NEAREST_BITS = {
    GGMLQuantizationType.Q2_K: 4,
    GGMLQuantizationType.Q3_K: 4,
    GGMLQuantizationType.Q6_K: 8,
    GGMLQuantizationType.IQ4_NL: 8,
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
    if qtype in _GROUP_AFFINE:
        return _repack_from_values(data, qtype)
    raise ValueError(f"{qtype.name} has no exact MLX affine layout")


def _k_quant_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks ``[n, bytes]`` -> per-sub-block scales and biases ``[n, 8]``."""
    d, dmin = _half(blocks[:, 0:2][:, None]), _half(blocks[:, 2:4][:, None])
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _q5_0_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = _half(blocks[:, 0:2][:, None])
    return d, -16 * d


def _q5_1_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _half(blocks[:, 0:2][:, None]), _half(blocks[:, 2:4][:, None])


#: type -> (block bytes, elements per block, per-32-group scales and biases from raw blocks).
_GROUP_AFFINE = {
    GGMLQuantizationType.Q5_0: (22, 32, _q5_0_affine),
    GGMLQuantizationType.Q5_1: (24, 32, _q5_1_affine),
    GGMLQuantizationType.Q4_K: (144, 256, _k_quant_affine),
    GGMLQuantizationType.Q5_K: (176, 256, _k_quant_affine),
}


def _repack_from_values(data: np.ndarray, qtype: GGMLQuantizationType) -> Affine:
    """Exact repacking through the dequantized values: scales and biases from the block headers,
    the integers recovered from ``gguf``'s float32 values (see the module docstring)."""
    block_bytes, block_size, affine = _GROUP_AFFINE[qtype]
    bits = EXACT_BITS[qtype]
    if data.dtype != np.uint8 or data.shape[-1] % block_bytes:
        raise ValueError(
            f"expected rows of {block_bytes}-byte blocks, got {data.dtype} {data.shape}"
        )
    rows = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    scales, biases = affine(blocks)  # [n_blocks, block_size / 32]
    # Dequantize whole rows: ``gguf`` loops in Python over rows, so one block per row is slow.
    values = gguf.quants.dequantize(data, qtype).reshape(-1, block_size // GROUP_SIZE, GROUP_SIZE)
    safe = np.where(scales == 0, 1, scales)[..., None]  # a zero scale: every value is the bias
    q = np.rint((values - biases[..., None]) / safe).clip(0, 2**bits - 1).astype(np.uint8)
    columns = data.shape[-1] // block_bytes * block_size
    q = q.reshape(*rows, columns)
    return Affine(
        pack_bits(q, bits),
        scales.reshape(*rows, columns // GROUP_SIZE),
        biases.reshape(*rows, columns // GROUP_SIZE),
        bits,
    )


def repack_mxfp4(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 blocks (``uint8 [..., bytes_per_row]``: per 32 elements an e8m0 scale byte, then
    16 bytes holding element ``j`` in the low nibble of byte ``j`` and element ``j + 16`` in its
    high nibble) -> MLX ``mxfp4``: uint32 words ``[..., in / 8]`` (elements ``2j, 2j + 1`` in byte
    ``j``) and the scales, uint8 ``[..., in / 32]``. ggml's doubled e2m1 values times its halved
    scale are MLX's e2m1 values times the scale: the bytes carry over exactly."""
    scales, qs = _split_blocks(data, 17, 1)
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # element order
    paired = codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))
    return _words(paired), np.ascontiguousarray(scales[..., 0])


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned integers ``[..., n]`` (each < ``2**bits``) -> MLX's packing, uint32 ``[..., n*bits/32]``:
    a little-endian bit stream per row (element ``i`` at bits ``bits*i .. bits*i+bits-1``)."""
    if bits == 8:
        return _words(q[..., None, :])
    if bits == 4:
        return _words((q[..., 0::2] | (q[..., 1::2] << np.uint8(4)))[..., None, :])
    stream = np.unpackbits(q[..., None], axis=-1, bitorder="little")[..., :bits]
    packed = np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")
    return _words(packed[..., None, :])


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
