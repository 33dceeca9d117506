"""Qwen2.5-VL's vision side: dynamic-resolution patches, a ViT with 2D rotary positions and window
attention, and the patch merger into the language model's width.

An image is resized to multiples of ``patch_size * spatial_merge_size`` pixels (28) within
``min_pixels`` and ``max_pixels`` (:func:`~mlxr_plugins.archs.qwen_vl_images.smart_resize`), normalized with CLIP's mean and std, and
cut into 14x14 patches, each copied ``temporal_patch_size`` times (a still image is a video of
two equal frames). The processor gives them as transformers' ``pixel_values`` rows are laid out,
grouped ``[t, h / m, w / m, m, m, features]`` (``m`` the merge size): every 2x2 block of patches
becomes one token, so the shape's first three axes are the image's grid of tokens.

The tower: the patch embedding (a Conv3d whose kernel equals its stride, so a linear map of
each flattened patch), blocks of RMS norm, attention with 2D RoPE (half of each head's
frequencies rotate by the patch's row, half by its column) and a SwiGLU MLP; attention stays
within windows of ``window_size`` pixels except in the ``fullatt_block_indexes`` blocks; the
merger (RMS norm, four patches' features side by side, an MLP with GELU) gives one token per 2x2
block, in row-major order. Checkpoint names: ``visual.*`` (as transformers saves them),
``model.visual.*``, or ``vision_tower.*`` with the patch convolution channels last (folders
mlx-vlm wrote).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers import ConfigArgs
from mlxr_core.model.vision import ImageProcessor, ImageTokens
from mlxr_plugins.archs.qwen_vl_images import QwenImageProcessor, token_grid

ACTIVATIONS = {"silu": nn.silu, "gelu": nn.gelu, "gelu_pytorch_tanh": nn.gelu_approx}
#: ``Qwen2_5_VLConfig`` defaults: the token ids of an image and the text around it.
IMAGE_TOKEN_ID, IMAGE_TEXT = 151_655, "<|image_pad|>"
#: Where the tower's tensors sit, and whether the patch convolution's channels come last there.
PREFIXES = {"model.visual.": False, "visual.": False, "vision_tower.": True}


@dataclasses.dataclass
class VisionArgs(ConfigArgs):
    """A ``qwen2_5_vl`` checkpoint's ``vision_config`` (Hugging Face names and defaults)."""

    family = "qwen2_5_vl vision"
    #: The released checkpoints' configs say ``in_chans``.
    aliases = {"in_channels": ("in_chans",)}
    limits = {name: (1, 1 << 16) for name in (
        "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size",
    )}  # fmt: skip
    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = dataclasses.field(default_factory=lambda: [7, 15, 23, 31])
    rope_theta: float = 10000.0

    @classmethod
    def read(cls, config: dict[str, Any]) -> Self:
        """From a checkpoint config's ``vision_config`` (its ``rope_parameters``' theta read too)."""
        vision = dict(config.get("vision_config") or {})
        rope = vision.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            vision.setdefault("rope_theta", rope["rope_theta"])
        return cls.from_config(vision)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}",
                                 key="vision_config.hidden_act")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelLoadError(
                f"hidden_size {self.hidden_size} must split into num_heads {self.num_heads} heads of a "
                "multiple of 4 features (2D rotary positions)", key="vision_config.hidden_size",
            )  # fmt: skip

    @property
    def window_blocks(self) -> int:
        """A window's side in merged blocks (tokens)."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size)


def patch_rotary(shape: tuple[int, ...], args: VisionArgs) -> tuple[mx.array, mx.array]:
    """cos and sin ``[patches, head_dim]`` of each patch of a ``[t, h, w, m, m, ...]`` image: half
    the frequencies turn with its row, half with its column."""
    dims = args.hidden_size // args.num_heads // 2
    inv_freq = 1.0 / args.rope_theta ** (np.arange(0, dims, 2, dtype=np.float32) / dims)
    t, h, w, m = shape[0], shape[1], shape[2], shape[3]
    _, rows, cols, block_rows, block_cols = np.indices((t, h, w, m, m)).reshape(5, -1)
    angles = np.concatenate([np.outer(rows * m + block_rows, inv_freq), np.outer(cols * m + block_cols, inv_freq)], axis=1)
    angles = np.concatenate([angles, angles], axis=1)
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


def rotate_half(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


class Windows:
    """Window attention's regrouping of one image shape's patches: the grid of tokens padded to
    whole windows of ``side`` x ``side`` tokens, each window's patches one row of a batch
    (:meth:`split`), and back (:meth:`join`); :attr:`mask` hides the padding's keys."""

    def __init__(self, shape: tuple[int, ...], side: int):
        t, h, w, m = shape[0], shape[1], shape[2], shape[3]
        self.grid, self.side, self.block = (t, h, w), side, m * m
        self.padded = (-(-h // side) * side, -(-w // side) * side)
        H, W = self.padded
        valid = np.zeros((t, H, W), dtype=bool)
        valid[:, :h, :w] = True
        windows = valid.reshape(t, H // side, side, W // side, side).transpose(0, 1, 3, 2, 4)
        self.mask = mx.array(np.repeat(windows.reshape(-1, side * side), self.block, axis=1))[:, None, None, :]

    def split(self, x: mx.array) -> mx.array:
        """``[N, heads, patches, d]`` -> ``[N * windows, heads, patches per window, d]``."""
        N, heads, _, d = x.shape
        (t, h, w), s, (H, W) = self.grid, self.side, self.padded
        x = x.reshape(N, heads, t, h, w, self.block, d)
        x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, H - h), (0, W - w), (0, 0), (0, 0)])
        x = x.reshape(N, heads, t, H // s, s, W // s, s, self.block, d).transpose(0, 2, 3, 5, 1, 4, 6, 7, 8)
        return x.reshape(-1, heads, s * s * self.block, d)

    def join(self, y: mx.array, N: int) -> mx.array:
        """:meth:`split`'s inverse, the padding dropped."""
        _, heads, _, d = y.shape
        (t, h, w), s, (H, W) = self.grid, self.side, self.padded
        y = y.reshape(N, t, H // s, W // s, heads, s, s, self.block, d).transpose(0, 4, 1, 2, 5, 3, 6, 7, 8)
        y = y.reshape(N, heads, t, H, W, self.block, d)[:, :, :, :h, :w]
        return y.reshape(N, heads, t * h * w * self.block, d)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        D = args.hidden_size
        self.heads = args.num_heads
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, windows: Windows | None) -> mx.array:
        """Attention over the whole image, or within each of ``windows``."""
        N, L, D = x.shape
        qkv = self.qkv(x).reshape(N, L, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
        queries, keys, values = rotate_half(qkv[0], cos, sin), rotate_half(qkv[1], cos, sin), qkv[2]
        scale = (D // self.heads) ** -0.5
        if windows is None:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
        else:
            mask = mx.tile(windows.mask, (N, 1, 1, 1))
            queries, keys, values = windows.split(queries), windows.split(keys), windows.split(values)
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
            out = windows.join(out, N)
        result: mx.array = self.proj(out.transpose(0, 2, 1, 3).reshape(N, L, D))
        return result


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        D, F = args.hidden_size, args.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(D, F), nn.Linear(D, F), nn.Linear(F, D)
        self.activation = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        result: mx.array = self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        return result


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.norm2 = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, windows: Windows | None) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        features = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.proj = nn.Linear(features, args.hidden_size, bias=False)


class PatchMerger(nn.Module):
    """``[N, patches, hidden] -> [N, patches / m^2, out]``: each block's patches side by side."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = nn.RMSNorm(args.hidden_size, eps=1e-6)
        self.mlp = [nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, args.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ln_q(x).reshape(x.shape[0], -1, self.width)
        for layer in self.mlp:
            h = layer(h)
        return h


class Qwen25Vision(nn.Module):
    """``module(pixels [N, t, h, w, m, m, features]) -> [N, t * h * w, text hidden]``."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)

    def __call__(self, pixels: mx.array) -> mx.array:
        shape = tuple(pixels.shape[1:])
        N = pixels.shape[0]
        x = self.patch_embed.proj(pixels.reshape(N, -1, pixels.shape[-1]))
        cos, sin = patch_rotary(shape, self.args)
        windowed = Windows(shape, self.args.window_blocks)
        full = set(self.args.fullatt_block_indexes)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if index in full else windowed)
        return self.merger(x)


class Qwen25VisionArchitecture:
    """The :class:`mlxr_core.model.vision.VisionArchitecture` of ``qwen2_5_vl`` checkpoints."""

    def build(self, config: dict[str, Any]) -> nn.Module:
        return Qwen25Vision(VisionArgs.read(config))

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The tower's tensors without their prefix; the patch convolution's ``[D, C, T, P, P]``
        (``[D, T, P, P, C]`` from mlx-vlm) as the linear map of a flattened ``[C, T, P, P]`` patch."""
        out = {}
        for name, array in weights.items():
            prefix = next((p for p in PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            name = name[len(prefix) :]
            if name == "patch_embed.proj.weight" and array.ndim == 5:
                if PREFIXES[prefix]:
                    array = array.transpose(0, 4, 1, 2, 3)
                array = array.reshape(array.shape[0], -1)
            out[name] = array
        return out

    def processor(self, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> ImageProcessor:
        return QwenImageProcessor.from_config(VisionArgs.read(config), preprocessor)

    def image_tokens(self, config: dict[str, Any]) -> ImageTokens:
        """``<|image_pad|>`` (which Qwen's template writes between ``<|vision_start|>`` and
        ``<|vision_end|>``) becomes one ``<|image_pad|>`` per token of the image's grid."""
        token_id = int(config.get("image_token_id", IMAGE_TOKEN_ID))
        return ImageTokens(token_id, 0, IMAGE_TEXT, IMAGE_TEXT, grid=token_grid)
