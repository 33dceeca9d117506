"""The engine: the one thread that runs MLX work, fed through a queue.

Callers (HTTP handlers, the CLI) tokenize in their own thread, then :meth:`Engine.submit` a
:class:`GenerationRequest` and read its events from the returned :class:`RequestHandle`. The engine
thread loads every model, then serves requests: prefill, decode, detokenize, stop checks, events.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.engine.request import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestHandle,
    Usage,
)
from mlxr_core.errors import (
    ContextLengthExceeded,
    EngineStopped,
    MlxrError,
    ModelNotFound,
    Overloaded,
    RequestError,
)

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.tokenizer import Tokenizer
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)


@attrs.frozen
class ModelInfo:
    """What other threads may know about a served model (the tokenizer is thread-safe)."""

    name: str
    context_length: int
    created: int
    tokenizer: Tokenizer
    format: str
    model_type: str


class Engine:
    """Owns MLX. States: ``created`` -> ``loading`` -> ``ready`` -> ``stopping`` -> ``stopped``
    (or ``failed`` when a model does not load)."""

    def __init__(self, config: Config, host: PluginHost):
        self.config = config
        self.host = host
        self.state = "created"
        self.error: BaseException | None = None
        self.models: dict[str, ModelInfo] = {}
        self.started_at = time.time()
        self._loaded: dict[str, LoadedModel] = {}
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.active: RequestHandle | None = None

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

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let the running one finish (up to ``timeout``), cancel the queued."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"
        self.host.notify("mlxr_engine_stopping", engine=self)
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self.active is not None:
                self.active.cancel()
                self._thread.join(5.0)
            _wait_for_os_thread_exit(self._thread)
        self.state = "stopped"

    # -- caller side (any thread) ------------------------------------------------------------

    def model(self, name: str) -> ModelInfo:
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(name, self.models) from None

    def encode(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.model(model).tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, model: str, messages: list[dict[str, Any]], **template_kwargs: Any
    ) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize the result."""
        tokenizer = self.model(model).tokenizer
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_kwargs
        )
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        # Most templates write BOS themselves; add it for a model that wants one when they don't.
        bos = tokenizer.bos_token_id
        if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def submit(
        self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Validate and queue a request; raises ModelNotFound, ContextLengthExceeded, Overloaded
        or EngineStopped before anything is queued."""
        if self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        info = self.model(request.model)
        prompt_tokens = len(request.prompt_ids)
        if prompt_tokens == 0:
            raise RequestError("the prompt is empty", param="prompt")
        params = request.params
        room = info.context_length - prompt_tokens
        if params.max_tokens is None:
            if room < 1:
                raise ContextLengthExceeded(prompt_tokens, 1, info.context_length)
            params.max_tokens = min(self.config.engine.default_max_tokens, room)
        elif params.max_tokens > room:
            raise ContextLengthExceeded(prompt_tokens, params.max_tokens, info.context_length)
        if self._queue.qsize() >= self.config.engine.max_queue:
            raise Overloaded(
                f"{self._queue.qsize()} requests are waiting (engine.max_queue); retry later"
            )
        handle = RequestHandle(request, loop=loop)
        self._queue.put(handle)
        return handle

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        import mlx.core as mx

        from mlxr_core.model.loader import load_model

        try:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                for model_config in self.config.models:
                    loaded = load_model(
                        model_config, self.host.registries, kernel_choices=self.config.kernels
                    )
                    if loaded.name in self._loaded:
                        raise MlxrError(f"two models are named {loaded.name!r}; set models[].name")
                    self._loaded[loaded.name] = loaded
                    self.host.notify("mlxr_model_loaded", name=loaded.name, model=loaded)
        except BaseException as exc:
            log.error("loading failed: %s", exc)
            self.error = exc
            self.state = "failed"
            self._ready.set()
            return
        self.models = {
            name: ModelInfo(
                name=name,
                context_length=m.context_length,
                created=m.created,
                tokenizer=m.tokenizer,
                format=m.format,
                model_type=str(m.config.get("model_type")),
            )
            for name, m in self._loaded.items()
        }
        if self._stop.is_set():  # stop() was called while the models loaded
            self._ready.set()
            return
        self.state = "ready"
        self._ready.set()
        self.host.notify("mlxr_engine_started", engine=self)
        with mx.stream(stream):
            self._serve()
        # Free the models here: MLX arrays must not outlive the thread (and stream) that made them.
        self._loaded.clear()
        gc.collect()
        mx.clear_cache()
        while True:  # refuse what is still queued
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            if handle is not None:
                handle._emit(Failed(EngineStopped("the server is shutting down")))

    def _serve(self) -> None:
        while not self._stop.is_set():
            handle = self._queue.get()
            if handle is None:
                continue
            if handle.cancelled:  # cancelled while queued: nothing ran, nothing to free
                usage = Usage(prompt_tokens=len(handle.request.prompt_ids), completion_tokens=0)
                handle._emit(Finished(reason="cancelled", usage=usage))
                continue
            self.active = handle
            try:
                self._generate(handle)
            except MlxrError as exc:
                handle._emit(Failed(exc))
            except Exception as exc:  # a bug or an MLX error: fail this request, keep serving
                log.exception("request %s failed", handle.id)
                handle._emit(Failed(MlxrError(f"generation failed: {type(exc).__name__}: {exc}")))
            finally:
                self.active = None

    def _generate(self, handle: RequestHandle) -> None:
        from mlxr_core.engine.decoding import make_sampler
        from mlxr_core.engine.detokenizer import StreamingDetokenizer
        from mlxr_core.engine.stops import StopMatcher

        request = handle.request
        loaded = self._loaded[request.model]
        params = request.params
        max_tokens = params.max_tokens or 0
        registries = self.host.registries
        decoder = registries.decoders.get(request.decoder or loaded.decoder)
        sampler = make_sampler(params, registries.samplers)
        detokenizer = StreamingDetokenizer(loaded.tokenizer)
        stops = StopMatcher(params.stop)
        # Benchmarks generate a fixed number of tokens whatever the model says.
        eos = frozenset() if params.extra.get("ignore_eos") else loaded.tokenizer.eos_token_ids
        cache = loaded.make_cache()
        started = time.perf_counter()
        first_token_at = 0.0
        reason = "length"
        generated = 0
        tokens = decoder.generate(
            loaded,
            cache,
            request.prompt_ids,
            sampler,
            prefill_chunk=self.config.engine.prefill_chunk,
        )
        hit = False
        try:
            while generated < max_tokens:
                if handle.cancelled:
                    reason = "cancelled"
                    break
                token = next(tokens)
                generated += 1
                if not first_token_at:
                    first_token_at = time.perf_counter()
                if token in eos:
                    reason = "stop"
                    break
                text, hit = stops.feed(detokenizer.add(token))
                handle._emit(Delta(text, (token,)))
                if hit:
                    reason = "stop"
                    break
            if not hit and reason != "cancelled":
                tail, hit = stops.feed(detokenizer.flush())
                if not hit:
                    tail += stops.flush()
                if tail:
                    handle._emit(Delta(tail))
        finally:
            tokens.close()
            del cache
        now = time.perf_counter()
        handle._emit(
            Finished(
                reason=reason,
                usage=Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=generated),
                ttft_s=(first_token_at or now) - started,
                total_s=now - started,
            )
        )


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
