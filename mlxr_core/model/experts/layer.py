"""The stacked experts of one MoE layer when they are streamed: :class:`StreamedExperts` takes
:class:`~mlxr_core.model.layers.moe.SwitchGLU`'s place and computes as it does, over only the
experts the step's tokens route to (the union of the batch's rows, each read once)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import MlxrError
from mlxr_core.model.experts.cache import Entry
from mlxr_core.model.experts.store import ExpertStore
from mlxr_core.model.layers.moe import Projection, gated_experts

#: Projections of a gated expert.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class StreamedExperts(nn.Module):
    """``(x [..., hidden], indices [..., k]) -> [..., k, hidden]`` as :class:`SwitchGLU`, the
    experts fetched from ``store`` (layer ``layer`` there). Holds no parameters (``parameters``
    counts those its experts have in the files). ``ahead``, set by
    the wiring, gives the experts the next layer will likely need given this layer's input
    (``prefetch: router``); None reads ahead its previous choices (``previous``) or nothing."""

    def __init__(
        self,
        store: ExpertStore,
        layer: int,
        experts: int,
        top_k: int | None,
        activation: Callable[[mx.array, mx.array], mx.array],
        gather_matmul: Callable[..., mx.array],
        parameters: int = 0,
    ) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        #: The parameters of all its experts, as the resident layer would hold them (``mlxr info``).
        self.expert_parameters = parameters
        self._store, self._layer = store, layer
        self._activation, self._gather_matmul = activation, gather_matmul
        self.ahead: Callable[[mx.array], mx.array] | None = None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store = self._store
        # The next layer's guess (prefetch: router) is evaluated with this layer's choice: one sync.
        guess = self.ahead(x) if store.settings.prefetch == "router" and self.ahead is not None else None
        mx.eval(indices, *([guess] if guess is not None else []))
        chosen = np.array(indices)  # the experts must be known before they are read
        needed = np.unique(chosen)
        if self._layer == 0:
            store.count_tokens(int(np.prod(chosen.shape[:-1])))
        got, errors = store.fetch(self._layer, needed.tolist(), self._ahead(guess, len(needed)))
        if errors:
            self._lose_rows(chosen, got, errors)
        stacked = {param: mx.stack([got[int(e)][param] for e in needed]) for param in got[int(needed[0])]}
        local = mx.array(np.searchsorted(needed, chosen).astype(np.uint32))
        gate, up, down = (self._projection(name, stacked) for name in PROJECTIONS)
        return gated_experts(x, local, gate, up, down, self._activation)

    def _ahead(self, guess: mx.array | None, count: int) -> list[int] | None:
        """The next layer's experts to read now, at most ``count`` (this step's number): the
        router's ``guess``, or the next layer's previous choice."""
        setting = self._store.settings.prefetch
        if guess is not None:
            return np.unique(np.array(guess)).tolist()[:count]
        if setting == "previous":
            return self._store.last.get(self._layer + 1, [])[:count]
        return None

    def _lose_rows(self, chosen: np.ndarray, got: dict[int, Entry], errors: Mapping[int, MlxrError]) -> None:
        """Rows (the batch's first axis) that routed to an unreadable expert are recorded as
        failed and the expert's place filled with zeros, when the store collects row failures
        and some rows remain; else the first error is raised."""
        bad = np.isin(chosen, list(errors)).reshape(chosen.shape[0], -1).any(axis=1)
        rows = np.flatnonzero(bad).tolist()
        error = next(iter(errors.values()))
        if not got or len(rows) == chosen.shape[0] or not self._store.lose_rows(rows, error):
            raise error
        model = next(iter(got.values()))
        for expert in errors:
            got[expert] = {param: mx.zeros_like(array) for param, array in model.items()}

    def _projection(self, name: str, stacked: Entry) -> Projection:
        weight, scales, biases, bias = (stacked.get(f"{name}.{part}") for part in ("weight", "scales", "biases", "bias"))
        packing = self._store.layers[self._layer].packing.get(name)

        def project(rows: mx.array, picks: mx.array, sort: bool) -> mx.array:
            if scales is None or packing is None:
                out = self._gather_matmul(rows, weight, None, None, indices=picks, transpose=True, sorted_indices=sort)
            else:
                out = self._gather_matmul(
                    rows, weight, scales, biases, indices=picks, transpose=True, group_size=packing.group_size,
                    bits=packing.bits, mode=packing.mode, sorted_indices=sort,
                )
            if bias is not None:
                out = out + mx.expand_dims(bias[picks], -2)
            return out

        return project
