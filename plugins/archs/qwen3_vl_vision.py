"""Qwen3-VL's vision side: Qwen2.5-VL's patches and 2D rotary positions
(:mod:`mlxr_plugins.archs.qwen2_5_vl_vision`), with 16x16-pixel patches, a learned position
table resampled to each image's grid, layer-norm blocks with a GELU MLP and full attention
throughout, and DeepStack: the hidden states after each ``deepstack_visual_indexes`` block go
through a merger of their own and come out beside the final merger's, one more text-width
feature per token (:mod:`mlxr_plugins.archs.qwen3_vl` adds them to early decoder layers).

The position table is ``num_position_embeddings`` rows, a square grid; a patch at row ``r``,
column ``c`` of an ``h`` x ``w`` grid reads it bilinearly at ``(r (side - 1) / (h - 1), c (side -
1) / (w - 1))`` (corners aligned, as transformers' ``F.interpolate(align_corners=True)``).
Checkpoint names as Qwen2.5-VL's: ``model.visual.*`` (as transformers saves them), ``visual.*``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.vision import ImageProcessor
from mlxr_plugins.archs.qwen2_5_vl_vision import (
    ACTIVATIONS,
    Qwen25VisionArchitecture,
    QwenImageProcessor,
    VisionArgs,
    VisionAttention,
    patch_rotary,
)


@dataclasses.dataclass
class Qwen3VisionArgs(VisionArgs):
    """A ``qwen3_vl`` checkpoint's ``vision_config`` (Hugging Face names and defaults)."""

    family = "qwen3_vl vision"
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    patch_size: int = 16
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = dataclasses.field(default_factory=lambda: [8, 16, 24])

    def __post_init__(self) -> None:
        super().__post_init__()
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ModelLoadError(f"num_position_embeddings {self.num_position_embeddings} is not a square",
                                 key="vision_config.num_position_embeddings")

    @property
    def table_side(self) -> int:
        return round(self.num_position_embeddings**0.5)


def bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two table rows a grid coordinate reads and their weights (corners aligned)."""
    source = index * (side - 1) / max(size - 1, 1)
    floor = np.floor(source)
    taps = floor[:, None].astype(np.int64) + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None)
    return np.clip(taps, 0, side - 1), weights


class VisionMLP(nn.Module):
    def __init__(self, args: Qwen3VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.activation = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        result: mx.array = self.linear_fc2(self.activation(self.linear_fc1(x)))
        return result


class VisionBlock(nn.Module):
    def __init__(self, args: Qwen3VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, None)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``[N, patches, hidden] -> [N, patches / m^2, out]``: a layer norm (over each patch, or with
    ``after``, over each block's patches side by side), then an MLP with GELU."""

    def __init__(self, args: Qwen3VisionArgs, after: bool = False):
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.after = after
        self.norm = nn.LayerNorm(self.width if after else args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, args.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        blocks = x.reshape(x.shape[0], -1, self.width)
        h = self.norm(blocks) if self.after else self.norm(x).reshape(blocks.shape)
        result: mx.array = self.linear_fc2(nn.gelu(self.linear_fc1(h)))
        return result


class PatchEmbed(nn.Module):
    def __init__(self, args: Qwen3VisionArgs):
        super().__init__()
        features = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.proj = nn.Linear(features, args.hidden_size)


class Qwen3VLVision(nn.Module):
    """``module(pixels [N, t, h, w, m, m, features]) -> [N, t * h * w, (1 + deepstack) * text
    hidden]``: each token's input embedding, then its DeepStack features."""

    def __init__(self, args: Qwen3VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        self.deepstack_merger_list = [PatchMerger(args, after=True) for _ in args.deepstack_visual_indexes]

    def positions(self, shape: tuple[int, ...]) -> mx.array:
        """``[patches, hidden]``: the position table resampled to the image's grid of patches."""
        t, h, w, m = shape[0], shape[1], shape[2], shape[3]
        side = self.args.table_side
        _, rows, cols, block_rows, block_cols = np.indices((t, h, w, m, m)).reshape(5, -1)
        row_taps, row_weights = bilinear_taps(rows * m + block_rows, h * m, side)
        col_taps, col_weights = bilinear_taps(cols * m + block_cols, w * m, side)
        index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).astype(np.float32)
        table = self.pos_embed.weight[mx.array(index)]  # [patches, 4, hidden]
        return (table * mx.array(weight)[..., None]).sum(axis=1)

    def __call__(self, pixels: mx.array) -> mx.array:
        shape = tuple(pixels.shape[1:])
        N = pixels.shape[0]
        x = self.patch_embed.proj(pixels.reshape(N, -1, pixels.shape[-1])) + self.positions(shape)
        cos, sin = patch_rotary(shape, self.args)
        deep = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if index in self.args.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(index)]
                deep.append(merger(x))
        return mx.concatenate([self.merger(x), *deep], axis=-1)


class Qwen3VLVisionArchitecture(Qwen25VisionArchitecture):
    """The :class:`mlxr_core.model.vision.VisionArchitecture` of ``qwen3_vl`` checkpoints: the
    tensors and image tokens as Qwen2.5-VL's."""

    def build(self, config: dict[str, Any]) -> nn.Module:
        return Qwen3VLVision(Qwen3VisionArgs.read(config))

    def processor(self, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> ImageProcessor:
        """Qwen2.5-VL's processor with 16x16 patches and mean and std 0.5 unless the
        ``preprocessor_config.json`` says otherwise."""
        defaults = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
        return QwenImageProcessor.from_config(Qwen3VisionArgs.read(config), {**defaults, **(preprocessor or {})})
