"""Qwen2-VL's image processing, shared by Qwen2.5-VL and Qwen3-VL: the target size
(:func:`smart_resize`), and the patches as transformers' ``pixel_values`` rows are laid out
(:class:`QwenImageProcessor`; see :mod:`mlxr_plugins.archs.qwen2_5_vl_vision`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from mlxr_core.model.vision import ResizeNormalize

#: transformers' OPENAI_CLIP_MEAN and OPENAI_CLIP_STD, Qwen2-VL's processor defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PatchShape(Protocol):
    """What the processor reads of a vision config (``VisionArgs``)."""

    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as nearly as that allows."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenImageProcessor:
    """Pillow image -> ``[1, h / m, w / m, m, m, C * T * P * P]`` float32 patches (see the module)."""

    patch: int
    merge: int
    temporal: int
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC

    @classmethod
    def from_config(cls, args: PatchShape, preprocessor: dict[str, Any] | None) -> QwenImageProcessor:
        """From the vision config and a ``preprocessor_config.json`` (which wins where it speaks;
        its pixel bounds as ``min_pixels``/``max_pixels`` or in ``size``, as transformers wrote
        them over the years)."""
        settings = preprocessor or {}
        size = settings.get("size") or {}
        return cls(
            int(settings.get("patch_size", args.patch_size)),
            int(settings.get("merge_size", args.spatial_merge_size)),
            int(settings.get("temporal_patch_size", args.temporal_patch_size)),
            int(settings.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or cls.min_pixels),
            int(settings.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or cls.max_pixels),
            tuple(float(v) for v in settings.get("image_mean", CLIP_MEAN)),
            tuple(float(v) for v in settings.get("image_std", CLIP_STD)),
            float(settings.get("rescale_factor", cls.rescale)),
            int(settings.get("resample", cls.resample)),
        )

    def __call__(self, image: Any) -> np.ndarray:
        P, m, T = self.patch, self.merge, self.temporal
        height, width = smart_resize(image.height, image.width, P * m, self.min_pixels, self.max_pixels)
        pixels = ResizeNormalize((height, width), self.mean, self.std, self.rescale, self.resample)(image)
        C = pixels.shape[0]
        blocks = pixels.reshape(C, height // (P * m), m, P, width // (P * m), m, P).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], T, P, P))
        return np.ascontiguousarray(frames.reshape(1, *blocks.shape[:4], C * T * P * P))


def token_grid(pixels: np.ndarray) -> tuple[int, int, int]:
    """A processed image's ``(t, h, w)`` grid of tokens."""
    t, h, w = pixels.shape[:3]
    return int(t), int(h), int(w)
