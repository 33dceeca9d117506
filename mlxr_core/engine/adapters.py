"""Loading and unloading a served model's LoRA adapters on request (``POST
/v1/models/<model>:<adapter>/load`` and ``/unload``): an engine job, run on the engine thread
between batch steps (:mod:`mlxr_core.engine.jobs`), picklable so that an engine in a process of
its own runs it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from mlxr_core.errors import MlxrError
from mlxr_core.model.lora import make_resident

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel


@attrs.frozen
class AdapterWork:
    """``action`` (``load`` or ``unload``) for ``model``'s adapter ``adapter``; the result is
    whether the adapter is resident afterwards. An unload leaves an adapter a request uses now;
    a load finds no slot while every one is in use by requests, and says so."""

    model: str
    adapter: str
    action: str

    def __call__(self, models: Mapping[str, LoadedModel]) -> bool:
        loaded = models[self.model]
        adapters = loaded.adapters
        if adapters is None:
            raise MlxrError(f"model {self.model} serves no adapters")
        if self.action == "unload":
            return not adapters.unload(self.adapter)
        return make_resident(loaded, self.adapter) is not None
