"""LoRA adapters created and deleted while serving (Ollama's ``POST /api/create`` with
``adapters``, ``DELETE /api/delete``): an engine job, run on the engine thread between batch steps
(:mod:`mlxr_core.engine.jobs`), picklable so that an engine in a process of its own runs it too.

A created adapter is read, checked against its model (a shape or target that does not fit is
refused naming the tensor, and nothing changes) and made resident, then served as a model of its
own under its name (the engine's ``AdapterSet.on_created``), until it is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from mlxr_core.errors import ConfigError, Overloaded
from mlxr_core.model.lora import load_adapter

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.lora import AdapterSet


@attrs.frozen
class CreatedAdapter:
    """Serve ``path`` as ``model``'s adapter ``adapter`` (in place of one created earlier under
    that name), or delete it (``path`` None); the result is whether it is served afterwards.
    Overloaded (429) while requests use the adapter it replaces or deletes, or every slot."""

    model: str
    adapter: str
    path: str | None

    def __call__(self, models: Mapping[str, LoadedModel]) -> bool:
        loaded = models[self.model]
        adapters = loaded.adapters
        if adapters is None:
            raise ConfigError(f"model {self.model} takes no adapters created while serving: set "
                              "models[].runtime_adapters: true", field="models[].runtime_adapters")  # fmt: skip
        if not adapters.unload(self.adapter):
            raise Overloaded(f"adapter {self.adapter} is in use by requests; retry")
        if self.path is None:
            adapters.configured.pop(self.adapter, None)
            if adapters.on_created is not None:
                adapters.on_created(self.adapter, None)
            return False
        _free_a_slot(adapters, self.model)
        load_adapter(loaded, self.adapter, self.path)  # refused (naming the tensor): nothing served
        adapters.configured[self.adapter] = self.path
        if adapters.on_created is not None:
            adapters.on_created(self.adapter, self.path)
        return True


def _free_a_slot(adapters: AdapterSet, model: str) -> None:
    """Unload the least recently used adapter no request uses when every slot is taken."""
    if len(adapters.resident) < adapters.capacity:
        return
    for resident in sorted(adapters.resident.values(), key=lambda r: r.last_used):
        if adapters.unload(resident.name):
            return
    raise Overloaded(f"every adapter slot of {model} is in use by requests; retry")
