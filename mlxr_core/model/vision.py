"""The vision contract: how an architecture turns images into embeddings at its image tokens.

An :class:`~mlxr_core.model.arch.Architecture` of a multimodal family implements
:class:`ProvidesVision`: ``vision(config)`` returns a :class:`VisionArchitecture` (or None for a
text-only checkpoint of that family). The vision side is a module of its own, built and loaded
beside the text model from the same checkpoint, so the text graph (its compiled decode step,
fusing, quantization) stays as it is. One image goes through three steps:

1. ``processor(pil_image) -> pixels``, a float32 array in the family's layout (Gemma 3:
   ``[C, H, W]``; Qwen2.5-VL: its patches grouped by grid, whose shape gives the image's size),
   with Pillow and numpy only (no MLX, no torch), on any thread;
2. ``module(pixels [N, *shape]) -> [N, tokens, hidden]`` (tower and projector; images of one
   shape together), on the engine thread;
3. :func:`merge_embeddings` puts those rows at the prompt's image tokens (:class:`ImageTokens`),
   and the text model runs from the merged embeddings under :func:`image_prefill_mask`.

An image's number of tokens is fixed (Gemma 3: 256) or follows from its size
(:attr:`ImageTokens.grid`: Qwen2.5-VL's dynamic resolution); in the second case the language
model also places the image's tokens on a grid of rotary positions (M-RoPE,
:mod:`mlxr_core.model.layers.mrope`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import numpy as np

from mlxr_core.errors import ModelLoadError, RequestError

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from PIL import Image

    from mlxr_core.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)


class ImageProcessor(Protocol):
    """One image -> the pixel values its vision tower takes."""

    def __call__(self, image: Image.Image) -> np.ndarray:
        """float32 pixels in the family's layout, resized, rescaled and normalized as it does."""
        ...


@runtime_checkable
class DraftsImages(Protocol):
    """An optional capability of an :class:`ImageProcessor` that resizes every image to one size:
    the server may then decode a large image at a smaller scale (a JPEG at 1/2, 1/4 or 1/8) that
    still holds twice that size, for a fraction of the memory."""

    def draft_size(self) -> tuple[int, int]:
        """The ``(width, height)`` every image is resized to."""
        ...


@attrs.frozen
class ImageTokens:
    """Where one image's embeddings go in a prompt.

    A chat template writes :attr:`marker` once per image; before tokenizing, each marker becomes
    :attr:`before`, the image's run of :attr:`token_text` (one :attr:`image_token_id` each), then
    :attr:`after` (:meth:`expand`); the image's embeddings replace those positions' embeddings,
    in order. A run is :attr:`tokens_per_image` long, or where :attr:`grid` is set, as long as
    the image's grid of tokens.
    """

    image_token_id: int
    tokens_per_image: int
    #: What a chat template writes per image (Gemma 3: ``<start_of_image>``).
    marker: str
    #: The text of one image token (Gemma 3: ``<image_soft_token>``).
    token_text: str
    #: What comes before and after an image's tokens (Gemma 3: ``\n\n<start_of_image>`` and
    #: ``<end_of_image>\n\n``).
    before: str = ""
    after: str = ""
    #: Whether an image's tokens attend to each other both ways during prefill (Gemma 3: yes).
    bidirectional: bool = False
    #: A processed image's ``(t, h, w)`` grid of tokens, where their count follows from the
    #: image's size and the language model takes M-RoPE positions (Qwen2.5-VL); None: a fixed
    #: :attr:`tokens_per_image` and ordinary positions.
    grid: Callable[[np.ndarray], tuple[int, int, int]] | None = None
    #: How many views of the image a processed image holds, each a run of
    #: :attr:`tokens_per_image` (Gemma 3's pan-and-scan: the whole image, then its crops); None: one.
    views: Callable[[np.ndarray], int] | None = None
    #: The text of an image of several views, from each view's run (Gemma 3: "Here is the original
    #: image ... and here are some crops to help you see better ...").
    several_views: Callable[[list[str]], str] | None = None
    #: The whole text of one processed image, where its views' layout shapes it (Idefics3: its
    #: tiles labelled by row and column, then the whole image); None: built from the fields above.
    layout: Callable[[np.ndarray], str] | None = None

    def views_for(self, pixels: np.ndarray) -> int:
        """The views one processed image holds."""
        return 1 if self.views is None else self.views(pixels)

    def tokens_for(self, pixels: np.ndarray) -> int:
        """The image tokens of one processed image."""
        if self.grid is None:
            return self.tokens_per_image * self.views_for(pixels)
        t, h, w = self.grid(pixels)
        return t * h * w

    def expand_for(self, text: str, pixels: Sequence[np.ndarray]) -> str:
        """``text`` with its :attr:`marker` for each processed image replaced by that image's
        tokens (:meth:`expand`, or :attr:`layout` where set)."""
        if self.layout is not None:
            return self._replace(text, [self.layout(p) for p in pixels])
        return self.expand(text, [self.tokens_for(p) for p in pixels], [self.views_for(p) for p in pixels])

    def expand(self, text: str, counts: Sequence[int] | None = None, views: Sequence[int] | None = None) -> str:
        """``text`` with every :attr:`marker` replaced by its image's tokens: ``counts[k]`` for
        the ``k``-th (RequestError when the markers and counts differ in number), or
        :attr:`tokens_per_image` each without ``counts``; in ``views[k]`` runs where given."""
        if counts is None:
            counts = [self.tokens_per_image] * text.count(self.marker)
        runs = [self._runs(count, n) for count, n in zip(counts, views or [1] * len(counts), strict=True)]
        return self._replace(text, runs)

    def _replace(self, text: str, images: Sequence[str]) -> str:
        """``text`` with its ``k``-th :attr:`marker` replaced by ``images[k]``."""
        parts = text.split(self.marker)
        if len(images) != len(parts) - 1:
            raise RequestError(
                f"the prompt renders {len(parts) - 1} images for the {len(images)} images sent; write "
                "each image once, as an image part of a message", field="messages",
            )  # fmt: skip
        return "".join(part + image for part, image in zip(parts, [*images, ""], strict=True))

    def _runs(self, count: int, views: int) -> str:
        each = [self.before + self.token_text * (count // views) + self.after for _ in range(views)]
        if views == 1 or self.several_views is None:
            return "".join(each)
        return self.several_views(each)

    def count(self, ids: Sequence[int]) -> int:
        """Images a tokenized prompt holds room for: at :attr:`tokens_per_image` each (RequestError
        when a run of image tokens is not a whole number of images), or where the count varies
        with the image (:attr:`grid`), one per run of image tokens."""
        is_image = np.asarray(ids) == self.image_token_id
        if self.grid is not None:
            return int(np.sum(is_image[1:] & ~is_image[:-1]) + (len(ids) > 0 and is_image[0]))
        positions = int(np.sum(is_image))
        if positions % self.tokens_per_image:
            raise RequestError(
                f"the prompt holds {positions} image tokens, not a multiple of {self.tokens_per_image} per image"
            )
        return positions // self.tokens_per_image


class VisionArchitecture(Protocol):
    """The vision side of a multimodal family: an image processor, a module (tower and projector)
    and the tokens its output replaces. Returned by :meth:`ProvidesVision.vision`."""

    def build(self, config: dict[str, Any]) -> nn.Module:
        """The tower and projector: ``module(pixels [N, *processor's shape]) -> [N, tokens, text
        hidden]``."""
        ...

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The checkpoint's vision tensors under the module's names (the text model's dropped)."""
        ...

    def processor(self, config: dict[str, Any], preprocessor: dict[str, Any] | None) -> ImageProcessor:
        """The image processor; ``preprocessor`` is the checkpoint's ``preprocessor_config.json``
        when it has one (it wins over the family's defaults)."""
        ...

    def image_tokens(self, config: dict[str, Any]) -> ImageTokens:
        """Where an image's embeddings go in a prompt."""
        ...


@runtime_checkable
class ProvidesVision(Protocol):
    """An optional capability of an :class:`~mlxr_core.model.arch.Architecture`: image input."""

    def vision(self, config: dict[str, Any]) -> VisionArchitecture | None:
        """The vision side for ``config``, or None when this checkpoint is text only."""
        ...


@attrs.frozen
class Vision:
    """A loaded model's vision side (``LoadedModel.vision``): the module with its weights, the
    image processor and the prompt's image tokens."""

    module: nn.Module
    processor: ImageProcessor
    tokens: ImageTokens

    def encode(self, pixels: Sequence[np.ndarray]) -> mx.array:
        """Images as the processor gave them -> every image's token embeddings, in order,
        ``[tokens, hidden]``; consecutive images of one shape go through the module together."""
        import mlx.core as mx

        parts, start = [], 0
        while start < len(pixels):
            stop = start + 1
            while stop < len(pixels) and pixels[stop].shape == pixels[start].shape:
                stop += 1
            out = self.module(mx.array(np.stack(pixels[start:stop])))
            parts.append(out.reshape(-1, out.shape[-1]))
            start = stop
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]


def load_vision(
    checkpoint: Checkpoint, arch: object, dtype: mx.Dtype, settings: dict[str, Any] | None = None
) -> Vision | None:
    """The vision side of ``checkpoint`` when ``arch`` provides one for its config (else None):
    built, its tensors loaded strictly in ``dtype`` (quantized ones dequantized), the processor
    reading the checkpoint's image settings or the folder's ``preprocessor_config.json``, with
    ``settings`` (``models[].vision``, in that file's names) over them. Raises ModelLoadError
    naming the file and tensor."""
    import json
    import re

    import mlx.core as mx

    if not isinstance(arch, ProvidesVision):
        return None
    config = checkpoint.config
    vision = arch.vision(config)
    if vision is None:
        return None
    where = str(checkpoint.vision_path or checkpoint.path)
    weights = vision.sanitize(dequantized_vision(checkpoint, vision, dtype), config)
    if not weights:
        log.warning("%s holds no vision tensors: serving text only", checkpoint.path.name)
        return None
    module = vision.build(config)
    try:
        module.load_weights([(name, array.astype(dtype)) for name, array in weights.items()], strict=True)
    except ValueError as exc:
        named = re.search(r"\b((?:\w+\.)+(?:weight|bias|\w+_weight))\b", str(exc))
        tensor = file_tensor_name(checkpoint, named.group(1)) if named else None
        raise ModelLoadError(f"the vision weights do not fit the {config.get('model_type')} vision graph: {exc}",
                             path=where, tensor=tensor) from exc
    mx.eval(module.parameters())
    module.eval()
    preprocessor = checkpoint.preprocessor
    found = checkpoint.path / "preprocessor_config.json"
    if preprocessor is None and found.is_file():
        preprocessor = json.loads(found.read_text(encoding="utf-8"))
    if settings:
        preprocessor = {**(preprocessor or {}), **settings}
    warn_without_pillow(checkpoint.path.name)
    return Vision(module, vision.processor(config, preprocessor), vision.image_tokens(config))


def pillow_installed() -> bool:
    """Whether Pillow, which every image is decoded with, can be imported."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def warn_without_pillow(model: str) -> bool:
    """Log a warning when Pillow is missing, so a vision model's images would be refused (400);
    whether it was."""
    if pillow_installed():
        return False
    log.warning("%s has a vision tower but Pillow is not installed: requests with images will be "
                "refused until you pip install 'mlxr[vision]'", model)
    return True


def file_tensor_name(checkpoint: Checkpoint, name: str) -> str:
    """The file's name of the tensor the vision graph calls ``name``: the vision side's
    ``sanitize`` strips the tower's prefix (``visual.``), so the one checkpoint name ending in
    ``.{name}`` is taken where ``name`` itself is not there; ``name`` where none or several are."""
    names = checkpoint.tensor_names
    if name in names:
        return names[name]
    found = [file_name for checkpoint_name, file_name in names.items() if checkpoint_name.endswith(f".{name}")]
    return found[0] if len(found) == 1 else name


def dequantized_vision(checkpoint: Checkpoint, vision: VisionArchitecture, dtype: mx.Dtype) -> dict[str, mx.array]:
    """The checkpoint's weights with every quantized module the vision side keeps dequantized to
    ``dtype`` (a tower quantized with the text model, or a quantized mmproj): the tower runs once
    per image, where dense weights cost little. The text model's modules stay as they are."""
    import mlx.core as mx

    weights = checkpoint.weights
    kept = {
        module: spec
        for module, spec in checkpoint.quantization.items()
        if f"{module}.scales" in weights
        and vision.sanitize({f"{module}.scales": weights[f"{module}.scales"]}, checkpoint.config)
    }
    if not kept:
        return weights
    dense = dict(weights)
    for module, spec in kept.items():
        packed, scales, biases = (dense.pop(f"{module}.{part}", None) for part in ("weight", "scales", "biases"))
        if packed is None or scales is None:
            continue  # sanitize keeps it, but the checkpoint lacks its packed weight: the load names it
        try:
            dense[f"{module}.weight"] = mx.dequantize(
                packed, scales, biases, group_size=spec.group_size, bits=spec.bits, mode=spec.mode
            ).astype(dtype)
        except ValueError as exc:
            tensor = checkpoint.tensor_names.get(f"{module}.weight", f"{module}.weight")
            raise ModelLoadError(f"cannot dequantize {spec.bits}-bit groups of {spec.group_size}: {exc}",
                                 path=str(checkpoint.vision_path or checkpoint.path), tensor=tensor) from exc
    return dense


@attrs.frozen
class ResizeNormalize:
    """The plain ViT preprocessing (SigLIP, CLIP): RGB, resized to ``size`` (height, width) with
    Pillow's ``resample`` filter, times ``rescale``, minus ``mean``, over ``std``, channels first.
    Computed as transformers' Pillow backend does (uint8 resize, float64 rescale, float32 after)."""

    size: tuple[int, int]
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 2  # PIL.Image.Resampling.BILINEAR

    @classmethod
    def from_config(cls, preprocessor: dict[str, Any] | None, size: int) -> ResizeNormalize:
        """From a ``preprocessor_config.json`` (tolerant: missing keys take the defaults, a square
        ``size`` side when it names none)."""
        settings = preprocessor or {}
        side = settings.get("size") or {}
        height, width = side.get("height", size), side.get("width", size)
        defaults = cls((height, width))
        return cls(
            (int(height), int(width)),
            tuple(float(v) for v in settings.get("image_mean", defaults.mean)),
            tuple(float(v) for v in settings.get("image_std", defaults.std)),
            float(settings.get("rescale_factor", defaults.rescale)),
            int(settings.get("resample", defaults.resample)),
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        height, width = self.size
        rgb = image if image.mode == "RGB" else image.convert("RGB")  # converting RGB would copy it whole
        return self.normalize(rgb.resize((width, height), resample=self.resample))

    def draft_size(self) -> tuple[int, int]:
        """The ``(width, height)`` every image is resized to (:class:`DraftsImages`)."""
        height, width = self.size
        return width, height

    def normalize(self, image: Image.Image) -> np.ndarray:
        """An RGB image as it is (no resizing) -> ``[C, H, W]`` float32, rescaled and normalized."""
        pixels = (np.asarray(image).astype(np.float64) * self.rescale).astype(np.float32)
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        return ((pixels - mean) / std).transpose(2, 0, 1)


class EmbeddingsModel(Protocol):
    """A text model that runs from given embeddings (:class:`~mlxr_core.model.layers.CausalLM`)."""

    def embed(self, inputs: mx.array) -> mx.array: ...

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        **positions: mx.array,
    ) -> mx.array: ...


def logits_with_images(
    model: EmbeddingsModel,
    inputs: mx.array,
    images: mx.array | None,
    tokens: ImageTokens,
    cache: list[Any] | None = None,
    offset: int = 0,
    positions: mx.array | None = None,
) -> mx.array:
    """A prefill's logits ``[B, L, vocab]`` with image embeddings ``images`` (:meth:`Vision.encode`'s
    ``[tokens, D]``, or the module's ``[N, T, D]``; None: no image in these inputs) at the image
    tokens of ``inputs [B, L]``, which follow ``offset`` positions of ``cache``; bidirectional
    within each image where :attr:`ImageTokens.bidirectional`; at rotary ``positions`` (M-RoPE's
    ``[3, B, L]``) where given."""
    import mlx.core as mx

    is_image = inputs == tokens.image_token_id
    # The image token may lie outside the embedding table; its positions' rows are replaced anyway.
    embeddings = model.embed(mx.where(is_image, 0, inputs))
    if images is not None:
        embeddings = merge_embeddings(embeddings, inputs, images, tokens.image_token_id)
    mask = image_prefill_mask(inputs, tokens.image_token_id, offset) if tokens.bidirectional else None
    at = {} if positions is None else {"positions": positions}
    return model(inputs, cache, mask, embeddings=embeddings, **at)


def merge_embeddings(
    embeddings: mx.array, inputs: mx.array, images: mx.array, image_token_id: int
) -> mx.array:
    """``embeddings [B, L, D]`` with the positions where ``inputs [B, L]`` is ``image_token_id``
    replaced, in row-major order, by the rows of ``images`` (``[N, T, D]`` or ``[rows, D]``;
    Hugging Face's ``masked_scatter``). Raises RequestError when the counts differ. Rows wider
    than ``D`` carry more per token than its input embedding (Qwen3-VL's deepstack features):
    the text positions are zero past ``D``."""
    import mlx.core as mx

    is_image = inputs == image_token_id
    positions, rows = int(np.array(is_image).sum()), images.size // images.shape[-1]
    if positions != rows:
        raise RequestError(f"the prompt has {positions} image token positions for {rows} image embeddings")
    if rows == 0:
        return embeddings
    extra = images.shape[-1] - embeddings.shape[-1]
    if extra > 0:
        embeddings = mx.pad(embeddings, [(0, 0), (0, 0), (0, extra)])
    flat = images.reshape(rows, images.shape[-1]).astype(embeddings.dtype)
    index = mx.maximum(mx.cumsum(is_image.reshape(-1).astype(mx.int32)) - 1, 0).reshape(inputs.shape)
    return mx.where(is_image[..., None], flat[index], embeddings)


def image_prefill_mask(inputs: mx.array, image_token_id: int, offset: int = 0) -> mx.array:
    """The boolean ``[B, 1, L, offset + L]`` prefill mask of ``inputs [B, L]`` that follow
    ``offset`` cached positions: causal, and each run of image tokens also sees itself whole
    (Gemma 3's bidirectional attention within an image). An image must lie within one chunk."""
    import mlx.core as mx

    B, L = inputs.shape
    is_image = inputs == image_token_id
    starts = is_image & ~mx.concatenate([mx.zeros((B, 1), mx.bool_), is_image[:, :-1]], axis=1)
    block = mx.where(is_image, mx.cumsum(starts.astype(mx.int32), axis=1), 0)  # 0: text
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)
    causal = mx.arange(L)[:, None] >= mx.arange(L)[None, :]
    local = same | causal
    if offset:
        local = mx.concatenate([mx.ones((B, L, offset), mx.bool_), local], axis=2)
    return local[:, None]
