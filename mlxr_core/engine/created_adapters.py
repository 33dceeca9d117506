"""LoRA adapters created and deleted while serving (Ollama's ``POST /api/create`` with
``adapters``, ``DELETE /api/delete``): an engine job, run on the engine thread between batch steps
(:mod:`mlxr_core.engine.jobs`), picklable so that an engine in a process of its own runs it too.

A created adapter's file is read off the engine thread, as any adapter's
(:func:`~mlxr_core.engine.adapters.make_resident`: the running streams step on meanwhile), checked
against its model (a shape or target that does not fit is refused naming the tensor, and nothing
is served) and made resident, then served as a model of its own under its name (the engine's
``AdapterSet.on_created``), until it is deleted.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING

import attrs

from mlxr_core.engine.adapters import make_resident
from mlxr_core.engine.jobs import WAITING
from mlxr_core.errors import ConfigError, Overloaded

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

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[str | None, None, bool]:
        loaded = models[self.model]
        adapters = loaded.adapters
        if adapters is None:
            raise ConfigError(f"model {self.model} takes no adapters created while serving: set "
                              "models[].runtime_adapters: true", field="models[].runtime_adapters")  # fmt: skip
        if not adapters.unload(self.adapter):
            raise Overloaded(f"adapter {self.adapter} is in use by requests; retry")
        previous = adapters.configured.pop(self.adapter, None)
        if self.path is None:
            if adapters.on_created is not None:
                adapters.on_created(self.adapter, None)
            return False
        _free_a_slot(adapters, self.model)
        adapters.configured[self.adapter] = self.path
        try:
            while make_resident(loaded, self.adapter) is None:  # its file is read off this thread
                read = adapters.reading.get(self.adapter)
                if read is not None and read.done() and len(adapters.resident) >= adapters.capacity:
                    raise Overloaded(f"every adapter slot of {self.model} is in use by requests; retry")
                yield WAITING if read is not None and not read.done() else None
        except BaseException:  # refused (naming the tensor), or cancelled: the earlier file serves on
            adapters.reading.pop(self.adapter, None)
            if previous is None:
                adapters.configured.pop(self.adapter, None)
            else:
                adapters.configured[self.adapter] = previous
            raise
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
