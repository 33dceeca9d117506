"""Where a request's images sit in its prompt, for the engine thread's prefill.

Image ``k`` of a request takes the ``k``-th run of image-token positions of its prompt, as many as
the image has tokens (:meth:`~mlxr_core.model.vision.ImageTokens.tokens_for`). Its embeddings are
merged in by one prefill pass that holds all of it, so a prefill chunk never ends inside an image
(:meth:`PromptImages.chunk_end`). The prefix cache sees each image's positions as a value derived
from the image's content hash (:meth:`PromptImages.cache_key`): a stored prefix is reused for the
same image at the same place, never for another image behind the same tokens. For a language
model with M-RoPE, the prompt's rotary positions follow from the images' grids
(:attr:`PromptImages.positions`), and every later token's position runs :attr:`PromptImages.shift`
from its cache position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlxr_core.engine.request import PromptImage
from mlxr_core.errors import RequestError
from mlxr_core.model.layers.mrope import mrope_positions
from mlxr_core.model.vision import ImageTokens


class PromptImages:
    """The images of one prompt and the span ``[start, end)`` of positions each one fills."""

    def __init__(self, prompt: Sequence[int], images: Sequence[PromptImage], tokens: ImageTokens):
        positions = np.flatnonzero(np.asarray(prompt) == tokens.image_token_id)
        counts = [tokens.tokens_for(image.pixels) for image in images]
        if len(positions) != sum(counts):
            each = (
                f"of {tokens.tokens_per_image} tokens each" if tokens.grid is None
                else f"of {', '.join(map(str, counts))} tokens"
            )  # fmt: skip
            raise RequestError(
                f"the prompt holds {len(positions)} image token positions for {len(images)} images "
                f"{each}; write each image once, as an image part of a message",
                field="messages",
            )
        if len(positions) and positions[-1] == len(prompt) - 1:
            raise RequestError("a prompt must not end with an image's tokens", field="messages")
        self.images = list(images)
        self.tokens = tokens
        ends = np.cumsum(counts, dtype=np.int64)
        self.spans = [(int(positions[end - count]), int(positions[end - 1]) + 1) for count, end in zip(counts, ends, strict=True)]
        #: M-RoPE's ``[3, len(prompt)]`` rotary positions, or None for ordinary ones.
        self.positions: np.ndarray | None = None
        #: What the rotary position of every token after the prompt adds to its cache position.
        self.shift = 0
        if tokens.grid is not None:
            if any(end - start != count for (start, end), count in zip(self.spans, counts, strict=True)):
                raise RequestError("each image's tokens must be one unbroken run", field="messages")
            grids = [tokens.grid(image.pixels) for image in images]
            self.positions = mrope_positions(len(prompt), self.spans, grids)
            self.shift = int(self.positions.max()) + 1 - len(prompt)

    def cache_key(self, prompt: Sequence[int]) -> np.ndarray:
        """``prompt`` as the prefix cache's key: each image's positions hold the negative of a
        number taken from its content hash (token ids are never negative)."""
        key = np.asarray(prompt, dtype=np.int64).copy()
        for image, (start, end) in zip(self.images, self.spans, strict=True):
            key[start:end] = -1 - int(image.digest[:15], 16)
        return key

    def inside(self, position: int) -> bool:
        """Whether a cut before ``position`` would split an image."""
        return any(start < position < end for start, end in self.spans)

    def chunk_end(self, start: int, stop: int) -> int:
        """``stop`` moved past the end of every image the chunk ``[start, stop)`` reaches into."""
        for span_start, span_end in self.spans:
            if span_start < stop and span_end > start:
                stop = max(stop, span_end)
        return stop

    def within(self, start: int, stop: int) -> list[np.ndarray]:
        """The pixels of the images whose spans lie in ``[start, stop)``, in order."""
        return [
            image.pixels
            for image, (span_start, span_end) in zip(self.images, self.spans, strict=True)
            if start <= span_start and span_end <= stop
        ]
