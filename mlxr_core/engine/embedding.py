"""Embeddings: a model's final hidden states pooled into one L2-normalized vector per input.

Runs on the engine thread (see :meth:`mlxr_core.engine.engine.Engine.embed`). Short inputs are
batched by right-padding: attention is causal, so a row's real positions never see its padding,
and pooling masks the padding out. An input longer than ``chunk`` tokens runs alone, ``chunk``
tokens at a time through a KV cache, so no forward pass carries more than ``chunk`` tokens; the
engine runs them one forward pass at a time between its batch steps (:func:`embed_parts`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx

from mlxr_core.errors import MlxrError, RequestError

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

#: How a sequence's hidden states become one vector: their mean, or the last position's.
POOLINGS = ("mean", "last")
_EPS = 1e-12


@attrs.frozen
class Embeddings:
    """One vector per input (in input order), and the tokens read."""

    model: str
    vectors: list[list[float]]
    prompt_tokens: int


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise RequestError(
            f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}", field="pooling"
        )


def normalize(vectors: mx.array) -> mx.array:
    """Each row of ``[B, D]`` scaled to unit L2 norm (an all-zero row stays zero)."""
    norms = mx.sqrt(mx.sum(vectors * vectors, axis=-1, keepdims=True))
    return vectors / mx.maximum(norms, _EPS)


def pool(hidden: mx.array, lengths: mx.array, pooling: str = "mean") -> mx.array:
    """``[B, L, D]`` hidden states of right-padded rows -> ``[B, D]`` unit vectors.

    :param lengths: ``[B]`` real positions per row (the rest is padding, ignored).
    :param pooling: ``"mean"`` over the real positions, or ``"last"``: the last real one.
    """
    check_pooling(pooling)
    hidden = hidden.astype(mx.float32)
    lengths = lengths.astype(mx.int32)
    if pooling == "last":
        pooled = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    else:
        real = mx.arange(hidden.shape[1])[None, :] < lengths[:, None]
        pooled = mx.sum(hidden * real[..., None], axis=1) / lengths[:, None].astype(mx.float32)
    return normalize(pooled)


def embed_tokens(
    loaded: LoadedModel, inputs: list[list[int]], *, chunk: int, pooling: str = "mean"
) -> list[list[float]]:
    """The pooled embedding of each token list (engine thread only).

    :param chunk: the most tokens one forward pass carries (``engine.prefill_chunk``): a batch's
        rows times its longest row, or one chunk of an input longer than this.
    """
    parts = embed_parts(loaded, inputs, chunk=chunk, pooling=pooling)
    while True:
        try:
            next(parts)
        except StopIteration as done:
            vectors: list[list[float]] = done.value
            return vectors


@attrs.frozen
class EmbeddingWork:
    """An embedding job's work (:class:`~mlxr_core.engine.jobs.EngineJob`): a value, not a
    closure, so the ranks serving together can be sent it (:mod:`mlxr_core.engine.lockstep`)."""

    model: str
    inputs: list[list[int]]
    chunk: int
    pooling: str

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[None, None, Embeddings]:
        vectors = yield from embed_parts(models[self.model], self.inputs, chunk=self.chunk, pooling=self.pooling)
        return Embeddings(self.model, vectors, sum(len(ids) for ids in self.inputs))


def embed_parts(
    loaded: LoadedModel, inputs: list[list[int]], *, chunk: int, pooling: str = "mean"
) -> Generator[None, None, list[list[float]]]:
    """:func:`embed_tokens` a forward pass at a time: yields after each, returns the vectors."""
    check_pooling(pooling)
    hidden_states = getattr(loaded.arch, "hidden_states", None)
    if hidden_states is None:
        raise MlxrError(
            f"model {loaded.name!r}: its architecture plugin ({type(loaded.arch).__name__}) does not "
            "provide hidden states, so it cannot compute embeddings"
        )
    out: list[list[float] | None] = [None] * len(inputs)
    for part, batch in enumerate(plan_batches([len(ids) for ids in inputs], chunk)):
        if len(inputs[batch[0]]) > chunk:
            out[batch[0]] = yield from _embed_long(loaded, inputs[batch[0]], chunk, pooling)
            continue
        if part:
            yield
        _embed_batch(loaded, inputs, batch, pooling, out)
    return [vector for vector in out if vector is not None]


def plan_batches(lengths: list[int], chunk: int) -> list[list[int]]:
    """The forward passes for inputs of ``lengths``: batches of indices, shortest first, whose
    rows times their longest row stay within ``chunk`` tokens; an input longer than ``chunk``
    is a batch of its own (the caller runs it ``chunk`` tokens at a time)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if lengths[index] > chunk:
            batches.append([index])
            continue
        # Sorted by length, so the row just added is the longest of its batch.
        if batch and (len(batch) + 1) * lengths[index] > chunk:
            batches.append(batch)
            batch = []
        batch.append(index)
    if batch:
        batches.append(batch)
    return batches


def _embed_batch(
    loaded: LoadedModel,
    inputs: list[list[int]],
    batch: list[int],
    pooling: str,
    out: list[list[float] | None],
) -> None:
    width = max(len(inputs[i]) for i in batch)
    rows = [inputs[i] + [0] * (width - len(inputs[i])) for i in batch]
    lengths = mx.array([len(inputs[i]) for i in batch])
    hidden = loaded.arch.hidden_states(loaded.model, mx.array(rows, dtype=mx.int32))
    vectors: list[list[float]] = pool(hidden, lengths, pooling).tolist()  # type: ignore[assignment]
    for i, vector in zip(batch, vectors, strict=True):
        out[i] = vector


def _embed_long(
    loaded: LoadedModel, ids: list[int], chunk: int, pooling: str
) -> Generator[None, None, list[float]]:
    """One input longer than ``chunk``: chunked through a cache, summing as it goes, yielding
    after each chunk."""
    cache = loaded.make_cache()
    total: mx.array | None = None
    last: mx.array | None = None
    for start in range(0, len(ids), chunk):
        piece = mx.array([ids[start : start + chunk]], dtype=mx.int32)
        hidden = loaded.arch.hidden_states(loaded.model, piece, cache)[0].astype(mx.float32)
        part = mx.sum(hidden, axis=0)
        total = part if total is None else total + part
        last = hidden[-1]
        mx.eval(total, last)  # one chunk's graph at a time
        yield
    assert total is not None and last is not None
    pooled = last if pooling == "last" else total / len(ids)
    vector: list[float] = normalize(pooled[None])[0].tolist()  # type: ignore[assignment]
    return vector
