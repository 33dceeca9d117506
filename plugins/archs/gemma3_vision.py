"""Gemma 3's vision side: a SigLIP tower, then the multimodal projector (average pooling of the
patch grid to ``mm_tokens_per_image`` tokens, Gemma's ``1 + w`` RMS norm, one matrix into the
text model's width). Each image is 896x896 pixels in the released checkpoints, 256 tokens.

Checkpoint names, all accepted: ``model.vision_tower.vision_model.*`` and
``model.multi_modal_projector.*`` (transformers >= 4.52), ``vision_tower.vision_model.*`` and
``multi_modal_projector.*`` (earlier), ``vision_tower.*`` without ``vision_model`` (transformers 5's
saving). Pan-and-scan (transformers' ``do_pan_and_scan``: a wide or tall image also goes in as 2 to
``pan_and_scan_max_num_crops`` crops side by side, each 256 tokens more) applies where the
processor's settings turn it on (``models[].vision.pan_and_scan``); off by default, as there.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.vision import ImageProcessor, ImageTokens, ResizeNormalize
from mlxr_plugins.archs.siglip import SiglipVisionArgs, SiglipVisionTower, sanitize_vision

if TYPE_CHECKING:
    from PIL import Image

#: ``Gemma3Config`` defaults: 256 tokens per image, Gemma's image token ids.
TOKENS_PER_IMAGE = 256
IMAGE_TOKEN_ID = 262_144
#: The processor's text for one image (transformers' ``Gemma3Processor.full_image_sequence``).
BEGIN, SOFT_TOKEN, END = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
PARTS = {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."}


class GemmaNorm(nn.Module):
    """RMS norm scaling by ``1 + weight`` (Gemma's checkpoints store ``scale - 1``)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Gemma3Projector(nn.Module):
    """``[N, patches, vision hidden] -> [N, tokens, text hidden]``: the patch grid average-pooled
    to ``tokens_per_side`` squared tokens (row-major), normed, projected."""

    def __init__(self, args: SiglipVisionArgs, text_hidden: int, tokens_per_image: int):
        super().__init__()
        side = round(tokens_per_image**0.5)
        if side * side != tokens_per_image or args.patches_per_side % side:
            raise ModelLoadError(
                f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides the "
                f"{args.patches_per_side} patches per side", key="mm_tokens_per_image",
            )  # fmt: skip
        self.mm_input_projection_weight = mx.zeros((args.hidden_size, text_hidden))
        self.mm_soft_emb_norm = GemmaNorm(args.hidden_size, args.layer_norm_eps)
        self.patches_per_side, self.tokens_per_side = args.patches_per_side, side

    def __call__(self, patches: mx.array) -> mx.array:
        N, _, D = patches.shape
        P, S = self.patches_per_side, self.tokens_per_side
        pooled = patches.reshape(N, S, P // S, S, P // S, D).mean(axis=(2, 4)).reshape(N, S * S, D)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3Vision(nn.Module):
    """``module(pixels [N, C, H, W]) -> [N, mm_tokens_per_image, text hidden]``."""

    def __init__(self, args: SiglipVisionArgs, text_hidden: int, tokens_per_image: int):
        super().__init__()
        self.vision_tower = SiglipVisionTower(args)
        self.multi_modal_projector = Gemma3Projector(args, text_hidden, tokens_per_image)

    def __call__(self, pixels: mx.array) -> mx.array:
        """Also ``[N, views, C, H, W]`` (pan-and-scan): every view's tokens, image by image."""
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        return self.multi_modal_projector(self.vision_tower(pixels.transpose(0, 2, 3, 1)))


@attrs.frozen
class PanAndScan:
    """Gemma 3's pan-and-scan, as transformers' ``Gemma3ImageProcessor.pan_and_scan`` cuts an image:
    where one side is at least ``min_ratio`` times the other, about that many crops along it
    (rounded half up, at most one per ``min_crop_size`` pixels, 2 to ``max_num_crops``), none when
    a crop would be smaller than ``min_crop_size``. Gives ``[1 + crops, C, H, W]``: the whole
    image, then the crops left to right or top to bottom, each through ``resize``."""

    resize: ResizeNormalize
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio: float = 1.2

    def boxes(self, width: int, height: int) -> list[tuple[int, int, int, int]]:
        """The crops' ``(left, top, right, bottom)``, or none."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        count = min(math.floor(long / self.min_crop_size), math.floor(long / short + 0.5))
        count = min(self.max_num_crops, max(2, count))
        across, down = (count, 1) if width >= height else (1, count)
        crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        return [
            (left, top, min(left + crop_w, width), min(top + crop_h, height))
            for top, left in itertools.product(range(0, crop_h * down, crop_h), range(0, crop_w * across, crop_w))
        ]

    def __call__(self, image: Image.Image) -> np.ndarray:
        image = image.convert("RGB")
        views = [image, *(image.crop(box) for box in self.boxes(*image.size))]
        return np.stack([self.resize(view) for view in views])


def _tokens_per_image(config: dict[str, Any]) -> int:
    return int(config.get("mm_tokens_per_image") or TOKENS_PER_IMAGE)


class Gemma3VisionArchitecture:
    """The :class:`mlxr_core.model.vision.VisionArchitecture` of ``gemma3`` checkpoints."""

    def args(self, config: dict[str, Any]) -> SiglipVisionArgs:
        return SiglipVisionArgs.from_config(config.get("vision_config") or {})

    def build(self, config: dict[str, Any]) -> nn.Module:
        from mlxr_plugins.archs.gemma3 import Gemma3Args

        text_hidden = Gemma3Args.from_config(config).hidden_size
        return Gemma3Vision(self.args(config), text_hidden, _tokens_per_image(config))

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The tower's and projector's tensors, under any of the layouts above."""
        return sanitize_vision(weights, "vision_tower.", "multi_modal_projector.")

    def processor(self, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> ImageProcessor:
        """Resize to the tower's size (bilinear), rescale by 1/255, normalize with mean and std 0.5,
        or as ``preprocessor_config.json`` says; with its ``do_pan_and_scan``, :class:`PanAndScan`."""
        resize = ResizeNormalize.from_config(preprocessor, self.args(config).image_size)
        settings = preprocessor or {}
        if not settings.get("do_pan_and_scan"):
            return resize
        defaults = PanAndScan(resize)
        return PanAndScan(
            resize,
            int(settings.get("pan_and_scan_min_crop_size") or defaults.min_crop_size),
            int(settings.get("pan_and_scan_max_num_crops") or defaults.max_num_crops),
            float(settings.get("pan_and_scan_min_ratio_to_activate") or defaults.min_ratio),
        )

    def image_tokens(self, config: dict[str, Any]) -> ImageTokens:
        """``<start_of_image>`` in a prompt becomes the processor's sequence of soft tokens."""
        count = _tokens_per_image(config)
        token_id = config.get("image_token_index", config.get("image_token_id", IMAGE_TOKEN_ID))
        return ImageTokens(
            int(token_id), count, BEGIN, SOFT_TOKEN, f"\n\n{BEGIN}", f"{END}\n\n", bidirectional=True,
            views=lambda pixels: pixels.shape[0] if pixels.ndim == 4 else 1, several_views=with_crops,
        )


def with_crops(runs: list[str]) -> str:
    """An image of several views as transformers' ``Gemma3Processor`` writes it."""
    return f"Here is the original image {runs[0]} and here are some crops to help you see better {' '.join(runs[1:])}"
