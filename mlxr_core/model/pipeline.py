"""Pipeline parallelism: each rank keeps a contiguous share of the decoder layers.

Rank ``r`` of ``P`` keeps layers ``[r * n / P, (r + 1) * n / P)`` of a
:class:`~mlxr_core.model.layers.model.DecoderModel` (and their caches only); the embeddings, the
final norm and the LM head stay on every rank. A forward pass on rank ``r > 0`` starts from the
hidden states rank ``r - 1`` sends (``mx.distributed.recv_like``), runs its layers and sends the
result on (``send``): its first and last layers are wrapped to do so (:class:`StageLayer`). Then
one ``all_gather`` hands every rank the last stage's hidden states, so
every rank computes the same logits and samples the same tokens, as the engine's lockstep needs
(:mod:`mlxr_core.engine.lockstep`). The stages run one after another for a batch (no
micro-batching): pipelining spreads the weights' memory over the ranks; it does not add speed.

Layers must divide evenly: each rank's caches then hold the same bytes, so the KV budget and the
prefix cache decide alike on every rank. MLX's NCCL backend has no send/recv: refused at startup
(:func:`mlxr_core.distributed.join_world`). The compiled decode step is not used across stages.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.model import DecoderModel

log = logging.getLogger(__name__)

KEY = "distributed.pipeline_parallel"


class PipelineStage:
    """Where a rank's layers sit in the pipeline: what it receives first and passes on last."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def receive(self, h: mx.array) -> mx.array:
        """The previous stage's output (shaped as ``h``, the embeddings), or ``h`` on the first."""
        if self.rank == 0:
            return h
        return mx.distributed.recv_like(h, self.rank - 1, group=self.group)

    def pass_on(self, h: mx.array) -> mx.array:
        """Send ``h`` to the next stage; return the last stage's output, on every rank."""
        if self.rank < self.size - 1:
            h = mx.distributed.send(h, self.rank + 1, group=self.group)
        B = h.shape[0]
        gathered: mx.array = mx.distributed.all_gather(h, group=self.group)
        return gathered[(self.size - 1) * B :]


class StageLayer(nn.Module):
    """The first and the last of a stage's layers: ``layer``, after receiving the previous
    stage's output (``first``) and before passing its own on (``last``)."""

    def __init__(self, layer: nn.Module, stage: PipelineStage, *, first: bool, last: bool):
        super().__init__()
        self.layer = layer
        self._stage, self._first, self._last = stage, first, last

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self._first:
            h = self._stage.receive(h)
        out: mx.array = self.layer(h, *args, **kwargs)
        if not self._last:
            return out
        out = self._stage.pass_on(out)
        # Evaluated now: a prefill chunk is evaluated through its caches only, which on every
        # stage but the last do not depend on the send, so the next stage would wait forever.
        mx.eval(out)
        return out


def split_layers(model: nn.Module, arch: Any, group: Any, *, name: str) -> int:
    """Keep this rank's share of ``model``'s decoder layers (in place) and join its stage to the
    pipeline; returns the number of layers kept.

    :raises ModelLoadError: naming the model and ``distributed.pipeline_parallel`` when the module
        is not a decoder stack mlxr can split, the layers do not divide evenly, or the
        architecture's caches are not one per layer.
    """
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel):
        raise _refuse(name, f"its module ({type(model).__name__}) is not a decoder stack mlxr splits by layers")
    rank, size = group.rank(), group.size()
    total = len(decoder.layers)
    if total % size:
        raise _refuse(name, f"its {total} layers do not divide evenly across {size} ranks")
    share = total // size
    kept = decoder.layers[rank * share : (rank + 1) * share]
    stage = PipelineStage(group)
    kept[0] = StageLayer(kept[0], stage, first=True, last=share == 1)
    if share > 1:
        kept[-1] = StageLayer(kept[-1], stage, first=False, last=True)
    decoder.layers = kept
    caches = arch.make_cache(model)
    if len(caches) != share:
        raise _refuse(name, f"its architecture makes {len(caches)} caches for {share} layers, not one per layer")
    log.info("%s: rank %d of %d holds layers %d to %d of %d", name, rank, size, rank * share,
             (rank + 1) * share - 1, total)  # fmt: skip
    return share


def _refuse(name: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"model {name} cannot be split into pipeline stages: {why}", key=KEY)
