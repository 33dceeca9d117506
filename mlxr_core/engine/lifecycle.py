"""Which models are loaded: lazy loading, idle unloading, a memory budget, pins and keep-alive.

Every configured model has a :class:`ModelSlot`. A model with ``load: eager`` is loaded at startup,
a ``lazy`` one by its first request; once loaded it stays until it has been idle (no running
request or job) for its keep-alive (``models[].idle_unload_seconds``, or what an Ollama request's
``keep_alive`` set), until an explicit unload, or until another model needs its memory under
``engine.memory_budget_bytes``: then the least recently used idle models that are not pinned are
unloaded first. A model that cannot fit waits while busy models may still free room, and is
refused when only pinned models stand in its way.

A model counts for its weights' bytes (a vision model's tower and projector among them), the KV
cache its requests may reserve (``context_length`` x ``engine.max_batch_size`` positions, at most
``engine.max_kv_bytes`` when that is set) and its prefix cache's ``max_bytes``. Before its first
load only its files' size is known (a projector file's included); that estimate is replaced by
the measured figure once it has loaded.

:class:`ModelLifecycle` runs on the engine thread, called by the scheduler's loop
(:meth:`ModelLifecycle.tick`); other threads only post commands (:meth:`ModelLifecycle.post`) and
wait on the futures they get back. Loading and unloading themselves are the engine's
(:class:`Loader`): a load runs on the engine thread, so the other models' requests pause while it
does (one thread owns MLX).
"""

from __future__ import annotations

import logging
import math
import queue
import re
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mlxr_core.errors import ConfigError, MlxrError, ModelUnavailable

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig

log = logging.getLogger(__name__)

#: Files whose bytes estimate a model's weights before its first load.
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".npz", ".bin")


class Loader(Protocol):
    """What the lifecycle asks of the engine, on the engine thread."""

    def load(self, slot: ModelSlot) -> int:
        """Load the slot's model and start serving it; returns its footprint in bytes."""

    def unload(self, slot: ModelSlot) -> None:
        """Stop serving the slot's model and free its memory."""

    def busy(self, name: str) -> bool:
        """Whether the model has running requests or jobs (it cannot be unloaded now)."""

    def wanted(self, name: str) -> bool:
        """Whether requests or jobs for the model wait in line (it should not go idle)."""

    def load_failed(self, slot: ModelSlot, error: MlxrError) -> None:
        """End the requests waiting for the model with ``error``."""


@attrs.define(eq=False)
class ModelSlot:
    """One configured model and where it stands."""

    index: int
    config: ModelConfig
    name: str
    #: Where its weights are (the file or folder, as resolved when the engine started).
    path: Path = Path()
    #: ``unloaded``, ``loading`` (queued or under way) or ``loaded``.
    state: str = "unloaded"
    #: Bytes counted against the budget: an estimate until :attr:`measured`.
    footprint: int = 0
    measured: bool = False
    #: ``time.monotonic()`` of its last activity (a request, a load).
    last_used: float = 0.0
    #: Seconds idle before it unloads; None: never.
    keep_alive: float | None = None
    #: Unload once idle (an explicit unload of a busy model).
    unload_requested: bool = False
    loaded_at: float = 0.0
    waiters: list[Future[None]] = attrs.field(factory=list)
    unload_waiters: list[Future[None]] = attrs.field(factory=list)

    @property
    def pinned(self) -> bool:
        return self.config.pin

    def expires_at(self, now: float) -> float | None:
        """``time.time()`` at which it would unload if no request came; None: never."""
        if self.pinned or self.keep_alive is None:
            return None
        return time.time() + max(0.0, self.last_used + self.keep_alive - now)


def estimated_footprint(path: Path, mmproj: str | None = None, stream_cache: int | None = None) -> int:
    """The bytes of a model's weight files, with its projector file's (``models[].mmproj``, or
    the ``mmproj*.gguf`` beside a GGUF): its footprint before it has ever loaded. With
    ``stream_cache`` (its experts streamed into a cache of that many bytes), the files' tensors but
    the experts, and the cache."""
    from mlxr_core.model.paths import resolve_projector

    try:
        projector = resolve_projector(mmproj, path)
    except MlxrError:  # the load says what is wrong with it
        projector = None
    extra = projector.stat().st_size if projector is not None and projector.is_file() else 0
    if stream_cache is not None:
        from mlxr_core.model.experts.wiring import resident_file_bytes

        resident = resident_file_bytes(path)
        if resident is not None:
            return resident + stream_cache + extra
    if path.is_file():
        return path.stat().st_size + extra
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file()) + extra
    return extra


def _stream_cache(model: ModelConfig) -> int | None:
    """``models[].experts.cache_bytes`` of a model whose experts stream, else None."""
    return model.experts.cache_bytes if model.experts.residency == "stream" else None


def model_footprint(
    config: EngineConfig, weights: int, context_length: int, kv_per_token: int, state_bytes: int
) -> int:
    """Bytes a loaded model counts for: its weights, the KV cache of ``max_batch_size`` sequences
    of its whole context (at most ``engine.max_kv_bytes`` when set) and its prefix cache."""
    kv = config.max_batch_size * (context_length * kv_per_token + state_bytes)
    if config.max_kv_bytes:
        kv = min(kv, config.max_kv_bytes)
    prefix = config.prefix_cache.max_bytes if config.prefix_cache.enabled else 0
    return weights + kv + prefix


class ModelLifecycle:
    """The slots of every configured model and the decisions about them (engine thread only,
    but :meth:`post` and the read-only views, which any thread may call)."""

    def __init__(self, config: Config, names: list[str], paths: list[Path]):
        self.budget = config.engine.memory_budget_bytes
        self.slots = {
            name: ModelSlot(index, model, name, path, footprint=estimated_footprint(path, model.mmproj, _stream_cache(model)),
                            keep_alive=model.idle_unload_seconds)
            for index, (model, name, path) in enumerate(zip(config.models, names, paths, strict=True))
        }  # fmt: skip
        self._commands: queue.Queue[tuple[str, str, Any, Future[None] | None]] = queue.Queue()
        #: Slots waiting to load, first asked first.
        self._pending: list[ModelSlot] = []
        self.loads: Counter[str] = Counter()
        #: ``(model, reason)`` -> unloads; reasons: idle, budget, request.
        self.unloads: Counter[tuple[str, str]] = Counter()

    # -- any thread ------------------------------------------------------------------------

    def post(self, command: str, name: str, value: Any = None) -> Future[None]:
        """Queue ``load``, ``unload`` or ``keep_alive`` (``value``: seconds, None for never) for
        the model ``name``; the future is done once it took effect."""
        future: Future[None] = Future()
        self._commands.put((command, name, value, future))
        return future

    def loaded(self) -> list[ModelSlot]:
        return [slot for slot in list(self.slots.values()) if slot.state == "loaded"]

    def used_bytes(self) -> int:
        return sum(slot.footprint for slot in self.loaded())

    def stats(self) -> dict[str, Any]:
        """For /metrics: loaded models and their bytes, loads and unloads (by reason) per model."""
        return {
            "loaded": {slot.name: slot.footprint for slot in self.loaded()},
            "budget": self.budget,
            "loads": dict(self.loads),
            "unloads": dict(self.unloads),
        }

    # -- engine thread ---------------------------------------------------------------------

    def want(self, name: str) -> None:
        """A queued request needs ``name``: load it when it can."""
        slot = self.slots[name]
        if slot.state == "unloaded":
            slot.state = "loading"
            self._pending.append(slot)

    def load_now(self, slot: ModelSlot, engine: Loader) -> None:
        """Load ``slot`` at once (startup), making room as a request's load would; raises."""
        self._make_room(slot, engine, strict=True)
        self._load(slot, engine, strict=True)

    def has_work(self) -> bool:
        """A command posted or a load pending: :meth:`tick` has more to do than look."""
        return bool(self._pending) or not self._commands.empty()

    def tick(self, engine: Loader) -> None:
        """Apply posted commands, unload idle models whose keep-alive ran out, and start the
        first pending load that fits."""
        while True:
            try:
                command, name, value, future = self._commands.get_nowait()
            except queue.Empty:
                break
            self._apply(command, self.slots[name], value, future, engine)
        now = time.monotonic()
        for slot in self.loaded():
            if engine.busy(slot.name) or engine.wanted(slot.name):
                slot.last_used = now
            elif slot.unload_requested:
                self._unload(slot, engine, "request")
            elif not slot.pinned and slot.keep_alive is not None and now - slot.last_used >= slot.keep_alive:
                self._unload(slot, engine, "idle")
        if self._pending:
            slot = self._pending[0]
            try:
                if not self._make_room(slot, engine, strict=False):
                    return  # busy models may yet free room
            except MlxrError as exc:
                self._pending.pop(0)
                self._fail(slot, exc, engine)
                return
            self._pending.pop(0)
            try:
                self._load(slot, engine)
            except Exception as exc:
                log.error("model %s failed to load: %s", slot.name, exc)
                error = exc if isinstance(exc, ModelUnavailable) else ModelUnavailable(
                    f"model {slot.name!r} failed to load: {exc}"
                )
                self._fail(slot, error, engine)

    def _apply(self, command: str, slot: ModelSlot, value: Any, future: Future[None] | None,
               engine: Loader) -> None:  # fmt: skip
        if command == "keep_alive":
            slot.keep_alive = value
            slot.last_used = time.monotonic()
            _resolve(future)
        elif command == "load":
            slot.unload_requested = False
            if slot.state == "loaded":
                slot.last_used = time.monotonic()
                _resolve(future)
                return
            if future is not None:
                slot.waiters.append(future)
            self.want(slot.name)
        elif command == "unload":
            if slot.state != "loaded":
                _resolve(future)
            elif engine.busy(slot.name):
                slot.unload_requested = True  # once its requests end
                if future is not None:
                    slot.unload_waiters.append(future)
            else:
                self._unload(slot, engine, "request")
                _resolve(future)

    def _make_room(self, slot: ModelSlot, engine: Loader, *, strict: bool) -> bool:
        """Unload least recently used idle, unpinned models until ``slot`` fits the budget; False
        while busy models stand in the way. Raises when pinned models alone leave too little."""
        if self.budget is None:
            return True
        others = [s for s in self.loaded() if s is not slot]
        pinned = sum(s.footprint for s in others if s.pinned)
        if pinned + slot.footprint > self.budget:
            key = f"models[{slot.index}].pin" if slot.pinned else "engine.memory_budget_bytes"
            held = f"; pinned models hold {pinned}" if pinned else ""
            message = (f"{key}: model {slot.name!r} needs {slot.footprint} bytes, more than "
                       f"engine.memory_budget_bytes ({self.budget}) leaves{held}")  # fmt: skip
            if strict:
                raise ConfigError(message, field=key)
            raise ModelUnavailable(message)
        used = sum(s.footprint for s in others)
        for victim in sorted((s for s in others if not s.pinned), key=lambda s: s.last_used):
            if used + slot.footprint <= self.budget:
                break
            if not engine.busy(victim.name):
                self._unload(victim, engine, "budget")
                used -= victim.footprint
        return used + slot.footprint <= self.budget

    def _load(self, slot: ModelSlot, engine: Loader, *, strict: bool = False) -> None:
        slot.state = "loading"
        try:
            slot.footprint = engine.load(slot)
        except BaseException:
            slot.state = "unloaded"
            raise
        slot.measured = True
        slot.state = "loaded"
        slot.loaded_at = time.time()
        slot.last_used = time.monotonic()
        self.loads[slot.name] += 1
        if self.budget is not None and self.used_bytes() > self.budget:
            # The estimate (its files' size) was low: room is made now, and said so if none is
            # left; a model that cannot fit beside the pinned ones at all goes again.
            try:
                self._make_room(slot, engine, strict=strict)
            except MlxrError:
                self._unload(slot, engine, "budget")
                raise
            if self.used_bytes() > self.budget:
                log.warning("loaded models hold %d bytes, over engine.memory_budget_bytes (%d), "
                            "until busy models go idle", self.used_bytes(), self.budget)
        for future in slot.waiters:
            _resolve(future)
        slot.waiters.clear()

    def _unload(self, slot: ModelSlot, engine: Loader, reason: str) -> None:
        log.info("unloading model %s (%s)", slot.name, reason)
        engine.unload(slot)
        slot.state = "unloaded"
        slot.unload_requested = False
        slot.keep_alive = slot.config.idle_unload_seconds
        self.unloads[slot.name, reason] += 1
        for future in slot.unload_waiters:
            _resolve(future)
        slot.unload_waiters.clear()

    def _fail(self, slot: ModelSlot, error: MlxrError, engine: Loader) -> None:
        slot.state = "unloaded"
        for future in slot.waiters:
            if not future.done():
                future.set_exception(error)
        slot.waiters.clear()
        engine.load_failed(slot, error)

    def close(self, error: MlxrError) -> None:
        """At shutdown: end every wait."""
        for slot in self.slots.values():
            for future in [*slot.waiters, *slot.unload_waiters]:
                if not future.done():
                    future.set_exception(error)
        while True:
            try:
                *_, posted = self._commands.get_nowait()
            except queue.Empty:
                return
            if posted is not None and not posted.done():
                posted.set_exception(error)


def parse_keep_alive(value: float | str) -> float | None:
    """Ollama's ``keep_alive``: seconds (a number) or a Go duration (``"5m"``, ``"1h30m"``,
    ``"0"``); negative: forever (None). Raises ValueError for another string."""
    seconds = _go_duration(value.strip()) if isinstance(value, str) else float(value)
    if math.isnan(seconds):
        raise ValueError("not a duration")
    return None if seconds < 0 else seconds


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    parts = re.findall(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)", body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"{text!r} is not a duration (a number of seconds, or like '5m', '1h30m', '0')")
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)


def _resolve(future: Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
