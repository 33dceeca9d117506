"""Idefics3's and SmolVLM's vision side: a SigLIP tower (:mod:`mlxr_plugins.archs.siglip`) over
square tiles, then the connector: a pixel shuffle that folds each ``scale_factor x scale_factor``
block of patches into one token ``scale_factor**2`` times as wide, and one matrix into the text
model's width. A tile of ``image_size`` pixels gives ``(image_size / patch_size / scale_factor)**2``
tokens (SmolVLM-256M: 512 pixels, 64 tokens; Idefics3-8B: 364 pixels, 169 tokens). Every tile is
whole, so transformers' position ids for partly padded images and its patch mask never apply.

The image processor, as transformers' ``Idefics3ImageProcessor`` cuts an image: its longest edge
resized to ``size.longest_edge`` (LANCZOS), both sides then rounded up to whole tiles of
``max_image_size.longest_edge``; an image of more than one tile is split into its tiles row by row
and followed by the whole image resized to one tile. Its prompt text labels each tile
(``<fake_token_around_image><row_1_col_1><image>...``), a line per row, then the whole image
(``<fake_token_around_image><global-img><image>...<fake_token_around_image>``).

Checkpoint names: ``model.vision_model.*`` and ``model.connector.*`` (transformers), or the same
without ``model.`` (mlx-vlm).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError, RequestError
from mlxr_core.model.vision import ImageProcessor, ImageTokens, ResizeNormalize
from mlxr_plugins.archs.siglip import SiglipVisionArgs, SiglipVisionTower, sanitize_vision

if TYPE_CHECKING:
    from PIL import Image

#: ``Idefics3Config`` defaults, and the processor's text around an image's tokens.
IMAGE_TOKEN_ID, SCALE_FACTOR = 128_257, 2
IMAGE, AROUND, WHOLE = "<image>", "<fake_token_around_image>", "<global-img>"
#: transformers' cap on either side after the first resize (``MAX_IMAGE_SIZE``).
MAX_SIDE = 4096
LANCZOS = 1


class Connector(nn.Module):
    """``[N, patches, vision hidden] -> [N, patches / scale**2, text hidden]``: transformers'
    ``Idefics3Connector.pixel_shuffle``, then ``modality_projection.proj``."""

    def __init__(self, args: SiglipVisionArgs, text_hidden: int, scale: int):
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(args.hidden_size * scale * scale, text_hidden, bias=False)

    def __call__(self, patches: mx.array) -> mx.array:
        N, L, D = patches.shape
        side, s = math.isqrt(L), self.scale
        x = patches.reshape(N, side, side // s, D * s).transpose(0, 2, 1, 3)
        x = x.reshape(N, side // s, side // s, D * s * s).transpose(0, 2, 1, 3)
        result: mx.array = self.modality_projection.proj(x.reshape(N, L // (s * s), D * s * s))
        return result


class Idefics3Vision(nn.Module):
    """``module(pixels [N, views, C, H, W]) -> [N, views * tokens, text hidden]``, each image's
    views in the processor's order."""

    def __init__(self, args: SiglipVisionArgs, text_hidden: int, scale: int):
        super().__init__()
        self.vision_model = SiglipVisionTower(args)
        self.connector = Connector(args, text_hidden, scale)

    def __call__(self, pixels: mx.array) -> mx.array:
        N = pixels.shape[0]
        views = pixels.reshape(-1, *pixels.shape[-3:]).transpose(0, 2, 3, 1)
        out = self.connector(self.vision_model(views))
        return out.reshape(N, -1, out.shape[-1])


class TiledPixels(np.ndarray):
    """A processed image, ``[views, C, tile, tile]``, that knows its tiles' ``rows`` and ``cols``
    (0 and 0: one view, the whole image), which its prompt text names."""

    rows: int = 0
    cols: int = 0

    def __array_finalize__(self, obj: Any) -> None:
        self.rows, self.cols = getattr(obj, "rows", 0), getattr(obj, "cols", 0)


@attrs.frozen
class TiledResize:
    """Idefics3's image processor (see the module): ``image -> TiledPixels``."""

    normalize: ResizeNormalize
    longest_edge: int
    tile: int
    split: bool = True
    resample: int = LANCZOS
    #: Whether the image is first resized to :attr:`longest_edge` (transformers' ``do_resize``).
    resize: bool = True

    def __call__(self, image: Image.Image) -> np.ndarray:
        image = image.convert("RGB")
        if self.resize:
            image = self._resize(image, *scaled_to(image.height, image.width, self.longest_edge))
        rows = cols = 0
        if not self.split:
            views = [self._resize(image, self.tile, self.tile)]
        else:
            image = self._resize(image, *whole_tiles(image.height, image.width, self.tile))
            views = [image]
            if image.height > self.tile or image.width > self.tile:
                rows, cols, T = image.height // self.tile, image.width // self.tile, self.tile
                views = [image.crop((c * T, r * T, (c + 1) * T, (r + 1) * T)) for r in range(rows) for c in range(cols)]
                views.append(self._resize(image, T, T))
        pixels = np.stack([self.normalize.normalize(view) for view in views]).view(TiledPixels)
        pixels.rows, pixels.cols = rows, cols
        return pixels

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)


def scaled_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The size with the longest side ``longest`` (the other one rounded down, then up to an even
    number), both then scaled below :data:`MAX_SIDE` (transformers' two steps, truncations kept)."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / ratio)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * ratio)
    return max(height, 1), max(width, 1)


def whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides rounded up to whole tiles (transformers' ``resize_for_vision_encoder``)."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def prompt_text(pixels: np.ndarray, tokens_per_view: int) -> str:
    """One processed image's text, as transformers' ``Idefics3Processor`` writes it."""
    rows, cols = getattr(pixels, "rows", 0), getattr(pixels, "cols", 0)
    views = pixels.shape[0] if pixels.ndim == 4 else 1
    if views != (rows * cols + 1 if rows else 1):
        raise RequestError(f"an image of {views} views needs its tiles' rows and columns (the processor's TiledPixels)")
    run = IMAGE * tokens_per_view
    whole = f"{AROUND}{WHOLE}{run}{AROUND}"
    if not rows:
        return whole
    lines = ("".join(f"{AROUND}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows))
    return "".join(lines) + "\n" + whole


class Idefics3VisionArchitecture:
    """The :class:`mlxr_core.model.vision.VisionArchitecture` of ``idefics3`` and ``smolvlm``."""

    def args(self, config: dict[str, Any]) -> SiglipVisionArgs:
        return SiglipVisionArgs.from_config(config.get("vision_config") or {})

    def scale(self, config: dict[str, Any]) -> int:
        scale = int(config.get("scale_factor") or SCALE_FACTOR)
        if self.args(config).patches_per_side % scale:
            raise ModelLoadError(f"scale_factor {scale} must divide the tower's {self.args(config).patches_per_side} "
                                 "patches per side", key="scale_factor")
        return scale

    def build(self, config: dict[str, Any]) -> nn.Module:
        from mlxr_plugins.archs.idefics3 import Idefics3Architecture

        text_hidden = Idefics3Architecture().args(config).hidden_size
        return Idefics3Vision(self.args(config), text_hidden, self.scale(config))

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The tower's and connector's tensors, under either layout above."""
        return sanitize_vision(weights, "vision_model.", "connector.")

    def processor(self, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> ImageProcessor:
        """Tiles of the tower's ``image_size`` from an image resized to 4 tiles' length (the
        processor's defaults, LANCZOS, mean and std 0.5), or as ``preprocessor_config.json`` says."""
        settings = preprocessor or {}
        side = self.args(config).image_size
        tile = int((settings.get("max_image_size") or {}).get("longest_edge") or side)
        if tile != side:  # the model's tokens per image follow from the tower's size, as transformers'
            raise ModelLoadError(f"max_image_size.longest_edge {tile} is not the tower's image_size {side}",
                                 key="max_image_size")
        longest = int((settings.get("size") or {}).get("longest_edge") or 4 * tile)
        normalize = ResizeNormalize.from_config(settings, tile)
        split, resize = bool(settings.get("do_image_splitting", True)), bool(settings.get("do_resize", True))
        return TiledResize(normalize, longest, tile, split, int(settings.get("resample", LANCZOS)), resize)

    def image_tokens(self, config: dict[str, Any]) -> ImageTokens:
        """``<image>`` in a prompt becomes the image's text (:func:`prompt_text`)."""
        per_view = self.args(config).patches_per_side ** 2 // self.scale(config) ** 2
        token_id = int(config.get("image_token_id", IMAGE_TOKEN_ID))
        return ImageTokens(
            token_id, per_view, IMAGE, IMAGE, f"{AROUND}{WHOLE}", AROUND,
            views=lambda pixels: pixels.shape[0] if pixels.ndim == 4 else 1,
            layout=lambda pixels: prompt_text(pixels, per_view),
        )  # fmt: skip
