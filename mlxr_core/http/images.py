"""Images in requests: each API hands over what its client sent (a data URI, base64 text), this
module checks the server's limits, decodes it with Pillow and runs the model's image processor, all
in a worker thread (never the event loop, never the engine thread).

A hostile image is a :class:`~mlxr_core.errors.RequestError` (400) naming its field: bytes past
``server.max_image_bytes``, more than ``server.max_image_pixels`` pixels (read from the header,
before decoding: a decompression bomb never expands), a side more than :data:`MAX_ASPECT` times
the other, text that is not base64, a file Pillow cannot read or that ends early.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
from typing import TYPE_CHECKING

import anyio
import attrs

from mlxr_core.engine.request import PromptImage
from mlxr_core.errors import RequestError

if TYPE_CHECKING:
    from mlxr_core.config.schema import ServerConfig
    from mlxr_core.engine.engine import ModelInfo
    from mlxr_core.model.vision import ImageProcessor

#: The most one side of an image may exceed the other (Qwen2-VL's processor refuses beyond 200).
MAX_ASPECT = 200


@attrs.frozen
class ImageInput:
    """One image as a client sent it: ``data`` is base64 text (``url`` False) or a URL."""

    data: str
    field: str
    url: bool = False

    @classmethod
    def from_url(cls, url: str, field: str) -> ImageInput:
        """OpenAI's ``image_url.url``: a ``data:<type>;base64,<data>`` URI, or a remote URL."""
        if url.startswith("data:"):
            header, comma, data = url.partition(",")
            if not comma or not header.endswith(";base64"):
                raise RequestError("a data URI image must be base64: data:image/png;base64,...", field=field)
            return cls(data, field)
        return cls(url, field, url=True)


async def load_images(server: ServerConfig, info: ModelInfo, inputs: list[ImageInput]) -> list[PromptImage]:
    """The request's images decoded and preprocessed for ``info``'s model, in a worker thread;
    RequestError for a text-only model, too many images, or any image refused (see the module)."""
    if not inputs:
        return []
    check_takes_images(info, inputs)
    processor = info.image_processor
    assert processor is not None
    if len(inputs) > server.max_images_per_request:
        raise RequestError(
            f"the request holds {len(inputs)} images, more than server.max_images_per_request "
            f"({server.max_images_per_request})", field=inputs[server.max_images_per_request].field,
        )  # fmt: skip
    for image in inputs:
        if image.url:
            raise RequestError(
                "image URLs are not fetched by this server; send the image inline as a data URI "
                "(data:image/png;base64,...)", field=image.field,
            )  # fmt: skip
    work = functools.partial(_decode_all, inputs, processor, server.max_image_bytes, server.max_image_pixels)
    return await anyio.to_thread.run_sync(work)


def check_takes_images(info: ModelInfo, inputs: list[ImageInput]) -> None:
    """RequestError naming the model when images go to a model without a vision tower (before
    its chat template is asked to render them)."""
    if inputs and info.image_processor is None:
        raise RequestError(
            f"the model {info.name!r} takes no images (it has no vision tower); send text only, "
            "or the image to a vision model", field=inputs[0].field,
        )  # fmt: skip


def _decode_all(
    inputs: list[ImageInput], processor: ImageProcessor, max_bytes: int, max_pixels: int
) -> list[PromptImage]:
    return [decode_image(image.data, image.field, processor, max_bytes, max_pixels) for image in inputs]


def decode_image(data: str, field: str, processor: ImageProcessor, max_bytes: int, max_pixels: int) -> PromptImage:
    """Base64 ``data`` -> the processor's pixels and the SHA-256 of the image's bytes."""
    from PIL import Image

    if len(data) * 3 // 4 > max_bytes + 3:
        raise RequestError(f"the image is larger than server.max_image_bytes ({max_bytes} bytes)", field=field)
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"the image is not valid base64 ({exc})", field=field) from None
    if len(raw) > max_bytes:
        raise RequestError(f"the image is larger than server.max_image_bytes ({max_bytes} bytes)", field=field)
    # Pillow refuses a header claiming more than twice this many pixels itself (before decoding).
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestError(
                    f"the image is {width}x{height} pixels, more than server.max_image_pixels ({max_pixels})",
                    field=field,
                )  # fmt: skip
            if max(width, height) > MAX_ASPECT * min(width, height):
                raise RequestError(
                    f"the image is {width}x{height} pixels: one side is more than {MAX_ASPECT} times the other",
                    field=field,
                )  # fmt: skip
            image.load()
            pixels = processor(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(
            f"the image claims more than server.max_image_pixels ({max_pixels}) pixels", field=field
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:  # not an image, an unknown format, truncated
        raise RequestError(f"the image cannot be read: {exc}", field=field) from None
    return PromptImage(pixels, hashlib.sha256(raw).hexdigest())
