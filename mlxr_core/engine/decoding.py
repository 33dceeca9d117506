"""The decoder contract and the sampler chain built once per request."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

if TYPE_CHECKING:
    from mlxr_core.engine.request import SamplingParams
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.registry import Registry

#: ``[B, V]`` logits -> ``[B]`` token ids.
Sampler = Callable[[mx.array], mx.array]


class Decoder(Protocol):
    """A decoding strategy, registered through ``mlxr_register_decoders``."""

    def generate(
        self,
        model: LoadedModel,
        cache: list[Any],
        prompt_ids: list[int],
        sampler: Sampler,
        *,
        prefill_chunk: int,
    ) -> Iterator[int]:
        """Prefill ``prompt_ids`` into ``cache`` (in chunks of ``prefill_chunk``) and yield generated
        token ids one at a time, forever; the engine stops iterating (and closes the generator) on
        EOS, a stop string, ``max_tokens`` or cancellation. Runs on the engine thread."""
        ...


def make_sampler(params: SamplingParams, samplers: Registry) -> Sampler:
    """Compose the request's logits processors (registered by sampler plugins) and a final draw.

    Temperature 0 is greedy (argmax after the processors); otherwise a categorical draw with the
    request's own random key, so a seeded request is reproducible whatever else the engine runs.
    """
    entries = sorted(samplers, key=lambda entry: (entry.meta.get("order", 0), entry.name))
    processors = [proc for entry in entries if (proc := entry.load()(params)) is not None]
    greedy = params.temperature == 0.0
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    key = mx.random.key(seed)

    def sample(logits: mx.array) -> mx.array:
        nonlocal key
        logits = logits.astype(mx.float32)
        for proc in processors:
            logits = proc(logits)
        if greedy:
            return mx.argmax(logits, axis=-1)
        key, draw = mx.random.split(key)
        return mx.random.categorical(logits, key=draw)

    # The batch runner draws all-greedy batches with one argmax instead of per-row samplers.
    sample.plain_greedy = greedy and not processors  # type: ignore[attr-defined]
    return sample
