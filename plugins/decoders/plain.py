"""Plain autoregressive decoding: chunked prefill, then one token per forward pass.

The decode loop is double-buffered with ``mx.async_eval``: the graph for token n+1 is built and
queued before token n is handed to the caller, so Python overhead overlaps the computation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlxr_core.engine.decoding import Sampler
from mlxr_core.model.loader import LoadedModel


def cache_state(cache: list[Any]) -> list[mx.array]:
    """The arrays a prefill chunk wrote, to evaluate without computing the chunk's logits."""
    arrays: list[mx.array] = []
    for layer in cache:
        arrays.extend(a for a in layer.state if a is not None)
    return arrays


def prefill(model: LoadedModel, cache: list[Any], prompt_ids: list[int], prefill_chunk: int) -> mx.array:
    """Run all but the last prompt token through the model in chunks; return the last token."""
    prompt = mx.array(prompt_ids, dtype=mx.int32)
    while prompt.size > 1:
        chunk = min(prefill_chunk, prompt.size - 1)
        model.model(prompt[None, :chunk], cache=cache)
        mx.eval(cache_state(cache))
        prompt = prompt[chunk:]
    return prompt


class PlainDecoder:
    """One token per step; see :class:`mlxr_core.engine.decoding.Decoder`."""

    #: The engine's batch runner implements this strategy for batched requests;
    #: :meth:`generate` serves a request alone.
    batched = True

    def generate(
        self,
        model: LoadedModel,
        cache: list[Any],
        prompt_ids: list[int],
        sampler: Sampler,
        *,
        prefill_chunk: int,
    ) -> Iterator[int]:
        def step(token: mx.array) -> mx.array:
            return sampler(model.decode(token, cache))

        token = step(prefill(model, cache, prompt_ids, prefill_chunk))
        mx.async_eval(token)
        while True:
            following = step(token)
            mx.async_eval(following)
            yield int(token.item())  # type: ignore[arg-type]
            token = following
