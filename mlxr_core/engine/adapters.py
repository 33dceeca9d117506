"""Which LoRA adapters of a served model are resident, on the engine thread.

An adapter a request or job names and no slot holds is read off the engine thread (a thread of
its own reads the file into host arrays: :func:`~mlxr_core.model.lora.read_for`), so running
streams go on stepping meanwhile; once read, it is swapped in between batch steps
(:func:`~mlxr_core.model.lora.swap_in`: the arrays made MLX arrays and stacked), in place of the
least recently used adapter no request or job uses when every slot is taken. Until then the
request waits first in line, or the job between its parts.

Loading and unloading on request (``POST /v1/models/<model>:<adapter>/load`` and ``/unload``) is
an engine job (:mod:`mlxr_core.engine.jobs`), picklable so that an engine in a process of its own
runs it too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

import attrs

from mlxr_core.engine.jobs import WAITING
from mlxr_core.errors import ConfigError, MlxrError, ModelLoadError
from mlxr_core.model.lora import AdapterCheckpoint, AdapterSet, read_for, served_adapters, swap_in
from mlxr_core.model.paths import resolve_model_path

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel


def make_resident(loaded: LoadedModel, name: str) -> int | None:
    """The slot of ``loaded``'s configured adapter ``name``; None while it is not resident yet:
    its file is being read (started here if it is not), or it is read and every slot is in use.
    Raises what reading or fitting it raised (ConfigError for an adapter not configured)."""
    adapters = served_adapters(loaded)
    resident = adapters.resident.get(name)
    if resident is None:
        if name not in adapters.configured:
            adapters.reading.pop(name, None)  # deleted while it was read
            raise ConfigError(f"model {loaded.name} has no adapter {name!r}", field="models[].adapters")
        read = adapters.reading.get(name) or start_read(loaded, name)
        if not read.done():
            if adapters.background:
                return None
            read.exception()  # wait for it
        checkpoint = _checkpoint(adapters, name, read)
        if not _read_from(checkpoint, adapters.configured[name]):
            del adapters.reading[name]  # the name was given another file while it was read
            return make_resident(loaded, name)
        if len(adapters.resident) >= adapters.capacity:
            in_use = adapters.in_use()
            idle = [r for r in adapters.resident.values() if r.slot not in in_use]
            if not idle:
                return None
            adapters.remove(min(idle, key=lambda r: r.last_used).name)
        del adapters.reading[name]
        swap_in(loaded, name, checkpoint)
        resident = adapters.resident[name]
    resident.last_used = time.monotonic()
    return resident.slot


def start_read(loaded: LoadedModel, name: str) -> Future[AdapterCheckpoint]:
    """Read adapter ``name``'s file on a thread of its own; the read, in ``adapters.reading``."""
    adapters = served_adapters(loaded)
    path = adapters.configured[name]
    read: Future[AdapterCheckpoint] = Future()
    adapters.reading[name] = read

    def run() -> None:
        try:
            read.set_result(read_for(loaded, path))
        except BaseException as exc:
            read.set_exception(exc)
        if adapters.on_read is not None:
            adapters.on_read()

    threading.Thread(target=run, name=f"mlxr-adapter-{name}", daemon=True).start()
    return read


def _checkpoint(adapters: AdapterSet, name: str, read: Future[AdapterCheckpoint]) -> AdapterCheckpoint:
    """A finished read's adapter; a failed one leaves ``reading`` (a later request reads again)
    and raises its error, as an MlxrError naming the file."""
    error = read.exception()
    if error is None:
        return read.result()
    del adapters.reading[name]
    if isinstance(error, MlxrError):
        raise error
    raise ModelLoadError(f"the adapter could not be read: {type(error).__name__}: {error}",
                         path=adapters.configured[name]) from error  # fmt: skip


def _read_from(checkpoint: AdapterCheckpoint, path: str) -> bool:
    """Whether ``checkpoint`` was read from the file ``path`` (as configured) names now."""
    try:
        return checkpoint.path == resolve_model_path(path)
    except MlxrError:  # gone: a read of it again says so
        return False


def hold_adapter(loaded: LoadedModel, name: str) -> Generator[str | None, None, int]:
    """For an engine job running under adapter ``name``: wait (yielding between the job's parts,
    :data:`~mlxr_core.engine.jobs.WAITING` while its file is read) until it is resident, then
    hold its slot, which no load replaces and no unload removes until :func:`release_adapter`;
    the slot."""
    while True:
        slot = make_resident(loaded, name)
        if slot is not None:
            served_adapters(loaded).held[slot] += 1
            return slot
        yield _waiting(loaded, name)


def _waiting(loaded: LoadedModel, name: str) -> str | None:
    """:data:`~mlxr_core.engine.jobs.WAITING` while adapter ``name``'s file is being read (its
    end wakes the engine); None while it waits for a slot requests may free at any step."""
    read = served_adapters(loaded).reading.get(name)
    return WAITING if read is not None and not read.done() else None


def release_adapter(loaded: LoadedModel, slot: int) -> None:
    """Let go of a slot :func:`hold_adapter` held."""
    held = served_adapters(loaded).held
    held[slot] -= 1
    if held[slot] <= 0:
        del held[slot]


@attrs.frozen
class AdapterWork:
    """``action`` (``load`` or ``unload``) for ``model``'s adapter ``adapter``; the result is
    whether the adapter is resident afterwards. An unload leaves an adapter a request or job uses
    now; a load waits (between batch steps) while its file is read, and finds no slot while every
    one is in use, and says so."""

    model: str
    adapter: str
    action: str

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[str | None, None, bool]:
        loaded = models[self.model]
        adapters = loaded.adapters
        if adapters is None:
            raise MlxrError(f"model {self.model} serves no adapters")
        if self.action == "unload":
            return not adapters.unload(self.adapter)
        while make_resident(loaded, self.adapter) is None:
            read = adapters.reading.get(self.adapter)
            if read is not None and read.done():  # read, and every slot is in use
                del adapters.reading[self.adapter]
                return False
            yield _waiting(loaded, self.adapter)
        return True
