"""The engine: the one thread that runs MLX work, fed through a queue.

Callers (HTTP handlers, the CLI) tokenize in their own thread, then :meth:`Engine.submit` a
:class:`GenerationRequest` and read its events from the returned :class:`RequestHandle`. The engine
thread loads every model, then serves requests: prefill, decode, stop checks, events. A step's
events reach an asyncio consumer in one hand-over per event loop; requests without stop strings are
detokenized on the consumer's side (:class:`~mlxr_core.engine.request.Tokens`), off this thread.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.client import EngineCaller
from mlxr_core.engine.jobs import EngineJob, refuse_jobs
from mlxr_core.engine.request import (
    GenerationRequest,
    RequestHandle,
    handed_over,
)
from mlxr_core.errors import ConfigError, EngineStopped, MlxrError

if TYPE_CHECKING:
    from mlxr_core.config.schema import AdapterConfig, Config
    from mlxr_core.distributed import World
    from mlxr_core.engine.lifecycle import ModelLifecycle, ModelSlot
    from mlxr_core.engine.lockstep import Lockstep
    from mlxr_core.engine.scheduler import Scheduler
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)


class Engine(EngineCaller):
    """Owns MLX. States: ``created`` -> ``loading`` -> ``ready`` -> ``stopping`` -> ``stopped``
    (or ``failed`` when a model does not load)."""

    def __init__(self, config: Config, host: PluginHost, world: World | None = None):
        super().__init__(config, host, distributed=world is not None)
        #: This process's rank among several serving together (``distributed:``), or None.
        self.world = world
        self._loaded: dict[str, LoadedModel] = {}
        #: Per model, the LoRA adapters created while serving (``/api/create``): name -> path;
        #: they are served again when the model is loaded again.
        self._created: dict[str, dict[str, str]] = {}
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._jobs: queue.Queue[EngineJob] = queue.Queue()
        self._jobs_lock = threading.Lock()
        self._jobs_open = True
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self.scheduler: Scheduler | None = None
        #: Which models are loaded; made when the engine thread starts.
        self.lifecycle: ModelLifecycle | None = None
        self._load_stream: Any = None
        self._decode_stream: Any = None
        #: Called when the engine is lost while serving (its process died:
        #: :mod:`mlxr_core.engine.remote`); ``mlxr serve`` stops the server then.
        self.on_lost: Callable[[], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Start the engine thread; with ``wait``, block until models are loaded (raising their error)."""
        # MLX registers its exit-time cleanup of compile caches for the thread that first imports
        # it; import it here so that is the caller's (long-lived) thread, not the engine thread.
        # Otherwise a caller that later compiles anything (mlx.nn activations) crashes at exit.
        import mlx.core  # noqa: F401

        self.state = "loading"
        self._thread = threading.Thread(target=self._run, name="mlxr-engine", daemon=True)
        self._thread.start()
        if wait:
            self.wait_ready(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end: on a rank other than 0 (``distributed:``), when rank
        0's engine stops."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests and queued ones; let running ones finish for up to ``timeout``
        seconds, then end them with an :class:`EngineStopped` error."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        self.host.notify("mlxr_engine_stopping", engine=self)
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._abort.set()
                self._thread.join(5.0)
            _wait_for_os_thread_exit(self._thread)
        self.state = "stopped"

    # -- caller side (any thread) ------------------------------------------------------------

    def submit(
        self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Validate and queue a request; raises ModelNotFound, ContextLengthExceeded, Overloaded
        or EngineStopped before anything is queued."""
        handle = self.enqueue(RequestHandle(request, loop=loop))
        handed_over()  # counted out once queued: a gathering engine finds it queued
        return handle

    def enqueue(self, handle: RequestHandle) -> RequestHandle:
        """:meth:`submit` for a handle made by the caller (the engine process's, which sends its
        events on: :mod:`mlxr_core.engine.remote`)."""
        self.admit(handle.request)
        self._queue.put(handle)
        return handle

    def queue_job(self, job: EngineJob) -> EngineJob:
        """Queue ``job`` for the engine thread, which runs it between batch steps (under
        ``distributed:``, every rank runs it: :mod:`mlxr_core.engine.lockstep` sends it on)."""
        with self._jobs_lock:
            if not self._jobs_open:
                raise EngineStopped("the server is shutting down")
            self._jobs.put(job)
        self._queue.put(None)  # wakes the scheduler if it waits for requests
        handed_over()  # an embedding request is no longer arriving either
        return job

    def _close_jobs(self) -> None:
        with self._jobs_lock:
            self._jobs_open = False
            refuse_jobs(self._jobs, EngineStopped("the server is shutting down"))

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet running."""
        waiting = len(self.scheduler.waiting) if self.scheduler is not None else 0
        return self._queue.qsize() + waiting

    @property
    def running(self) -> int:
        """Requests prefilling or decoding now."""
        return self.scheduler.running if self.scheduler is not None else 0

    def memory(self) -> dict[str, int]:
        """MLX's memory counters in the process that runs the models (/health, /metrics)."""
        return mlx_memory()

    def stats(self) -> dict[str, Any]:
        """Counters for /health and /metrics (read from another thread: approximate)."""
        scheduler = self.scheduler
        if scheduler is None:
            return {"running": 0, "queued": self.queue_depth, "kv_bytes": 0, "prefix_cache": {}}
        return {
            "running": scheduler.running,
            "queued": self.queue_depth,
            "kv_bytes": scheduler.kv_bytes,
            "kv_bytes_reserved": scheduler.reserved_kv_bytes,
            "steps": scheduler.steps,
            "step_seconds": scheduler.step_seconds,
            "between_steps_seconds": scheduler.between_steps_seconds,
            "prompts_prefilled_together": scheduler.prompts_prefilled_together,
            #: Draft tokens proposed and accepted, per model and drafting decoder.
            "decoders": scheduler.decoder_stats(),
            "lifecycle": self.lifecycle.stats() if self.lifecycle is not None else {},
            #: Streamed experts' cache and reads, per model (``models[].experts``).
            "experts": {name: m.experts.stats() for name, m in list(self._loaded.items()) if m.experts is not None},
            "ranks": scheduler.lockstep.rank_stats() if scheduler.lockstep is not None else [],
            "prefix_cache": {
                name: attrs.asdict(stats) for name, stats in scheduler.prefix_stats().items()
            },
        }

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        import mlx.core as mx

        from mlxr_core.engine.scheduler import Scheduler

        engine_config = self.config.engine
        if engine_config.mlx_cache_limit_bytes is not None:
            mx.set_cache_limit(engine_config.mlx_cache_limit_bytes)
        if engine_config.mlx_memory_limit_bytes is not None:
            mx.set_memory_limit(engine_config.mlx_memory_limit_bytes)
        self._load_stream = mx.new_stream(mx.default_device())
        self._decode_stream = mx.new_stream(mx.default_device())
        scheduler = Scheduler(
            engine_config,
            self._loaded,
            self.host.registries,
            self._queue,
            self._stop,
            self._abort,
            jobs=self._jobs,
            lockstep=self._lockstep(),
            arrivals=self.arrivals,
        )
        scheduler._plugin_config = self.config.plugins.config  # for decoders' setup as models load
        self.scheduler = scheduler
        try:
            self.lifecycle = lifecycle = self._plan_models()
            scheduler.lifecycle = (lifecycle, self)
            for slot in list(lifecycle.slots.values()):
                if slot.config.load == "eager":
                    lifecycle.load_now(slot, self)
        except BaseException as exc:
            # Raised to whoever waits for the engine (wait_ready), which reports it once.
            log.debug("loading failed: %s", exc, exc_info=True)
            scheduler.release_decoders()
            self.scheduler = None
            del scheduler
            self._loaded.clear()
            gc.collect()
            self.error = exc
            self.state = "failed"
            self._ready.set()
            return
        if not self._stop.is_set():  # stop() may have been called while the models loaded
            self.state = "ready"
            self._ready.set()
            self.host.notify("mlxr_engine_started", engine=self)
            # Decode on a stream other than the one the models were loaded on: on MLX's CUDA
            # backend a one-token step on the loading stream ran 340 tok/s against 485 on a stream
            # of its own (H100, Llama-3.2-1B shape, 4-bit, medians of seven rounds;
            # git show d8ae8e9:bench/results/engine_profile_llama-3.2-1b-q4-fresh-stream_h100.txt, engine_profile.py
            # as of 6a46018).
            # Arrays cross streams freely.
            with mx.stream(self._decode_stream):
                scheduler.run()
        self._ready.set()
        lifecycle.close(EngineStopped("the server is shutting down"))
        scheduler.refuse_waiting()
        self._close_jobs()
        # Free the models here: MLX arrays must not outlive the thread (and stream) that made them.
        scheduler.release_decoders()
        self.scheduler = None
        del scheduler
        for loaded in self._loaded.values():
            if loaded.experts is not None:
                loaded.experts.close()
        self._loaded.clear()
        gc.collect()
        mx.clear_cache()

    def _lockstep(self) -> Lockstep | None:
        """The ranks' lockstep (:mod:`mlxr_core.engine.lockstep`) when several serve together."""
        from mlxr_core.engine.lockstep import Lockstep

        if self.world is None:
            return None
        return Lockstep(self.world, self._queue, self._stop, self._abort, jobs=self._jobs)

    # -- which models are loaded (engine thread; see mlxr_core.engine.lifecycle) --------------

    def _plan_models(self) -> ModelLifecycle:
        """Every configured model's name (its default name from the path when unnamed) and slot."""
        from mlxr_core.engine.lifecycle import ModelLifecycle
        from mlxr_core.model.paths import default_model_name, resolve_model_path

        names, paths = [], []
        for index, model_config in enumerate(self.config.models):
            path = resolve_model_path(model_config.path, join=False)
            name = model_config.name or default_model_name(path)
            self._add_names(index, name, model_config.aliases)
            self._add_adapter_names(index, name, model_config.adapters)
            names.append(name)
            paths.append(path)
        return ModelLifecycle(self.config, names, paths)

    def load(self, slot: ModelSlot) -> int:
        """Load ``slot``'s model and serve it; returns its footprint (:func:`model_footprint`)."""
        import mlx.core as mx

        from mlxr_core.engine.batch import kv_bytes_per_token, sequence_bytes
        from mlxr_core.engine.lifecycle import model_footprint
        from mlxr_core.model.loader import load_model

        assert self.scheduler is not None
        self.scheduler.outbox.release()  # the running models' held tokens do not wait for the load

        with mx.stream(self._load_stream):
            loaded = load_model(
                slot.config, self.host.registries, kernel_choices=self.config.kernels,
                tensor_group=self.world.tensor_group if self.world is not None else None,
                pipeline_group=self.world.pipeline_group if self.world is not None else None,
            )  # fmt: skip
            name = loaded.name
            self.kv_bytes_per_token[name] = per_token = kv_bytes_per_token(loaded)
            self.state_bytes[name] = state = sequence_bytes(loaded, 0, 0)
            self._loaded[name] = loaded
            try:
                self.scheduler.add_model(loaded)
            except BaseException:
                self._loaded.pop(name, None)
                raise
            if loaded.adapters is not None:
                loaded.adapters.configured.update(self._created.get(name, {}))
                loaded.adapters.on_created = functools.partial(self._serve_created, name)
            self._load_adapters(loaded)
        self._warm_decode(loaded)
        self.models[name] = self._model_info(loaded, slot.index)
        if loaded.adapters is not None:  # adapters loaded or unloaded later change its count

            def count(delta: int, slot: ModelSlot = slot) -> None:
                slot.footprint += delta

            loaded.adapters.on_change = count
        self.host.notify("mlxr_model_loaded", name=name, model=loaded)
        return model_footprint(
            self.config.engine, loaded.memory_bytes, loaded.context_length, per_token, state
        )

    def _warm_decode(self, loaded: LoadedModel) -> None:
        """On a GPU, trace the compiled decode step for every batch size up to
        ``engine.max_batch_size`` now, on the stream it will run on (MLX keys its compile cache by
        shapes and stream, per thread), with rows of equal and of different lengths (a scalar and a
        per-row rotary offset): a burst of requests arriving one by one grows the batch a row at a
        time, and each new size traced in the middle of serving held every stream's next token.
        On a CPU a trace costs little next to a step, so none is made ahead."""
        import mlx.core as mx

        compiled = loaded.compiled_decode
        if compiled is None or mx.default_device() != mx.gpu:
            return
        started = time.perf_counter()
        sizes = range(1, self.config.engine.max_batch_size + 1)
        with mx.stream(self._decode_stream):
            compiled.warm(sizes, loaded.make_cache)
        log.info("%s: decode step traced for batch sizes 1 to %d in %.1f s", loaded.name, sizes[-1],
                 time.perf_counter() - started)  # fmt: skip

    def unload(self, slot: ModelSlot) -> None:
        """Stop serving ``slot``'s idle model and free its memory (its :class:`ModelInfo` stays)."""
        import mlx.core as mx

        assert self.scheduler is not None
        self.scheduler.outbox.release()  # nor for an unload (a prefix cache written to disk)

        loaded = self._loaded.get(slot.name)
        if loaded is not None and loaded.experts is not None:
            loaded.experts.close()
        self.scheduler.remove_model(slot.name)
        gc.collect()
        mx.clear_cache()

    def busy(self, name: str) -> bool:
        return self.scheduler is not None and self.scheduler.model_busy(name)

    def wanted(self, name: str) -> bool:
        return self.scheduler is not None and self.scheduler.model_wanted(name)

    def load_failed(self, slot: ModelSlot, error: MlxrError) -> None:
        if self.scheduler is not None:
            self.scheduler.fail_waiting(slot.name, error)

    def _model_info(self, m: LoadedModel, index: int) -> ModelInfo:
        from mlxr_core.model.quantize import parameter_count

        name = m.name
        model_config = self.config.models[index]
        registries = self.host.registries
        template = m.tokenizer.chat_template
        return ModelInfo(
            name=name,
            context_length=m.context_length,
            created=m.created,
            tokenizer=m.tokenizer,
            format=m.format,
            model_type=str(m.config.get("model_type")),
            path=str(m.path),
            nbytes=m.nbytes,
            dtype=m.dtype,
            metadata=dict(m.metadata),
            aliases=tuple(alias for alias, target in self.names.items() if target == name and alias != name),
            compiled_decode=m.compiled_decode is not None,
            longest_token_bytes=max(map(len, m.tokenizer.token_bytes().pieces), default=0),
            image_processor=m.vision.processor if m.vision else None,
            image_tokens=m.vision.tokens if m.vision else None,
            audio_front_end=m.speech.front_end if m.speech else None,
            config_index=index,
            tool_parser=registries.tool_parsers.choose(model_config.tool_parser, template),
            reasoning_parser=registries.reasoning_parsers.choose(model_config.reasoning_parser, template),
            parameters=parameter_count(m.model, *([m.vision.module] if m.vision else [])),
        )

    def _add_names(self, index: int, name: str, aliases: Sequence[str]) -> None:
        """Record model ``index``'s name (the configured one or its default name) and aliases; a name
        two models would answer to is a config error naming the key (explicit names and aliases
        are checked when the config loads; a default name only now)."""
        keys = [(f"models[{index}].name", name)]
        keys += [(f"models[{index}].aliases[{j}]", alias) for j, alias in enumerate(aliases)]
        for key, value in keys:
            owner = self.names.get(value)
            if owner is not None and not (owner == name and value == name):
                raise ConfigError(
                    f"{key}: {value!r} already names the model {owner!r}; names and aliases must be "
                    "unique across models (set models[].name)",
                    field=key,
                )
            self.names[value] = name


    def _add_adapter_names(self, index: int, name: str, adapters: Sequence[AdapterConfig]) -> None:
        """Serve model ``index``'s adapters as models of their own, ``<name>:<adapter>``."""
        for j, adapter in enumerate(adapters):
            served = f"{name}:{adapter.name}"
            if served in self.names:
                key = f"models[{index}].adapters[{j}].name"
                raise ConfigError(f"{key}: {served!r} already names the model {self.names[served]!r}", field=key)
            self.names[served] = name
            self.adapters[served] = (name, adapter.name)

    def _serve_created(self, model: str, adapter: str, path: str | None) -> None:
        """Serve ``model``'s adapter ``adapter``, created at ``path`` while serving, as a model of
        its own under its name (None: deleted, no longer served); on the engine thread."""
        created = self._created.setdefault(model, {})
        if path is None:
            created.pop(adapter, None)
            self.adapters.pop(adapter, None)
            self.names.pop(adapter, None)
            return
        created[adapter] = path
        self.names[adapter] = model
        self.adapters[adapter] = (model, adapter)

    def _load_adapters(self, loaded: LoadedModel) -> None:
        """Make the first ``models[].max_adapters`` configured adapters of ``loaded`` resident; one
        that is refused is logged and the model serves without it (its requests get the error)."""
        from mlxr_core.model.lora import load_adapter

        adapters = loaded.adapters
        if adapters is None:
            return
        for name, path in list(adapters.configured.items())[: adapters.capacity]:
            try:
                load_adapter(loaded, name, path, self.host.registries)
            except MlxrError as exc:
                log.error("model %s: adapter %s not loaded: %s", loaded.name, name, exc)


def _wait_for_os_thread_exit(thread: threading.Thread, timeout: float = 5.0) -> None:
    """Wait until the OS thread behind ``thread`` is gone, not only its Python state.

    ``join()`` returns before the thread runs its C++ thread-local destructors; MLX keeps per-thread
    state (the default random key) whose destructor needs the interpreter. If the process starts
    finalizing in that window it aborts ("terminate called without an active exception").
    """
    native_id = thread.native_id
    if native_id is None or thread.is_alive():
        return
    task = f"/proc/self/task/{native_id}"
    if not os.path.exists("/proc/self/task"):
        time.sleep(0.05)  # no procfs (macOS): a short grace period instead
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


def mlx_memory() -> dict[str, int]:
    """MLX allocator counters, in bytes.

    Safe from any thread once the engine has loaded: each call reads a counter of the allocator
    singleton (already built by the engine thread) and touches no stream, graph or device queue.
    """
    import mlx.core as mx

    return {
        "active_bytes": int(mx.get_active_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
    }
