"""Multimodal rotary positions (M-RoPE, Qwen2-VL and its successors).

Every token has three positions, temporal, height and width, and each rotary frequency reads one
of them: the first ``sections[0]`` frequencies the temporal one, the next ``sections[1]`` the
height, the last ``sections[2]`` the width. A text token has the same position on all three
axes, so over text M-RoPE is ordinary RoPE. An image's tokens share one temporal position and
count rows and columns from it, and the text after an image goes on from the largest position
before it plus one: a prompt with images ends at a rotary position below its length, and every
later token's position is its cache position plus that (negative) *shift*, which the engine keeps
per row of a batch and hands the decode step (:meth:`~mlxr_core.model.loader.LoadedModel.decode`).

:func:`mrope_positions` gives a prompt's ``[3, L]`` positions; :class:`MRotary` rotates by them
when given ``[3, B, L]`` positions, and is the ordinary rotary at an offset otherwise (decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.rope import Rotary


def mrope_positions(
    length: int, spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]]
) -> np.ndarray:
    """The ``[3, length]`` positions of a prompt whose image ``k`` fills ``spans[k]`` (``[start,
    end)``, in order) with a ``grids[k]`` = ``(t, h, w)`` grid of tokens, row-major: text counts
    on from the position after the largest one before it; an image's tokens take
    ``(p + t_i, p + row, p + column)`` from the position ``p`` where it starts."""
    positions = np.zeros((3, length), dtype=np.int64)
    next_position = 0  # the position of the next text token
    cursor = 0  # where the text before the next image starts
    for (start, end), (t, h, w) in zip(spans, grids, strict=True):
        if end - start != t * h * w:
            raise ValueError(f"an image of {t}x{h}x{w} tokens cannot fill {end - start} positions")
        positions[:, cursor:start] = next_position + np.arange(start - cursor)
        p = next_position + start - cursor
        grid = np.indices((t, h, w)).reshape(3, -1)
        positions[:, start:end] = p + grid
        next_position, cursor = p + max(t, h, w), end
    positions[:, cursor:] = next_position + np.arange(length - cursor)
    return positions


class MRotary:
    """M-RoPE over ``dims`` features (rotate-half layout, as Hugging Face's): ``rotary(x,
    positions [3, B, L])`` rotates ``x [B, heads, L, dims]`` by each token's three positions;
    ``rotary(x, offset)`` (an int or ``[B]``: every axis equal) is ``plain``'s rotation.
    ``interleaved`` (Qwen3-VL): frequency ``3i + 1`` reads the height for ``i`` below
    ``sections[1]``, ``3i + 2`` the width for ``i`` below ``sections[2]``, every other one the
    temporal position; else the sections are consecutive runs (Qwen2-VL, Qwen2.5-VL)."""

    def __init__(self, plain: Rotary, dims: int, base: float, sections: Sequence[int], *, interleaved: bool = False):
        if len(sections) != 3 or sum(sections) != dims // 2 or min(sections) < 0:
            raise ModelLoadError(
                f"mrope_section {list(sections)} must be three counts summing to half the head "
                f"size ({dims // 2})", key="rope_scaling.mrope_section",
            )  # fmt: skip
        self.plain = plain
        self.dims = dims
        self.inv_freq = 1.0 / base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        axis = np.repeat(np.arange(3), sections)
        if interleaved:
            axis = np.zeros(dims // 2, dtype=np.int64)
            axis[1 : 3 * sections[1] : 3], axis[2 : 3 * sections[2] : 3] = 1, 2
        #: Which of the three positions each frequency reads.
        self.axis = mx.array(axis)

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if not (isinstance(offset, mx.array) and offset.ndim == 3):
            return self.plain(x, offset)
        chosen = offset.astype(mx.float32)[self.axis]  # [dims / 2, B, L]
        angles = chosen.transpose(1, 2, 0) * self.inv_freq  # [B, L, dims / 2]
        cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]
        half = self.dims // 2
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half : self.dims].astype(mx.float32)
        rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
        if self.dims == x.shape[-1]:
            return rotated
        return mx.concatenate([rotated, x[..., self.dims :]], axis=-1)
