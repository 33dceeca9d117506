"""The engine: the one thread that runs MLX work, fed through a queue.

Callers (HTTP handlers, the CLI) tokenize in their own thread, then :meth:`Engine.submit` a
:class:`GenerationRequest` and read its events from the returned :class:`RequestHandle`. The engine
thread loads every model, then serves requests: prefill, decode, stop checks, events. A step's
events reach an asyncio consumer in one hand-over per event loop; requests without stop strings are
detokenized on the consumer's side (:class:`~mlxr_core.engine.request.Tokens`), off this thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import numbers
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.engine.embedding import Embeddings, check_pooling
from mlxr_core.engine.jobs import EngineJob, refuse_jobs
from mlxr_core.engine.request import (
    Arrivals,
    GenerationRequest,
    PromptImage,
    RequestHandle,
    handed_over,
)
from mlxr_core.engine.scoring import Scores
from mlxr_core.errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineStopped,
    KvBudgetExceeded,
    MlxrError,
    ModelNotFound,
    ModelUnavailable,
    Overloaded,
    RequestError,
    Unsupported,
)
from mlxr_core.model.tokenizer import encode_within

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.distributed import World
    from mlxr_core.engine.lifecycle import ModelLifecycle, ModelSlot
    from mlxr_core.engine.lockstep import Lockstep
    from mlxr_core.engine.scheduler import Scheduler
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.tokenizer import Tokenizer
    from mlxr_core.model.vision import ImageProcessor, ImageTokens
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
    #: The resolved model file or folder, the bytes of its resident weights, the activation dtype
    #: and the checkpoint's format-specific metadata (for the APIs' model listings).
    path: str = ""
    nbytes: int = 0
    dtype: str = ""
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: Other names clients may use for this model (``models[].aliases``).
    aliases: tuple[str, ...] = ()
    #: Whether decode steps run compiled (``models[].compile_decode``).
    compiled_decode: bool = False
    #: The most bytes one token stands for (0: unknown); bounds a prompt's text before tokenizing.
    longest_token_bytes: int = 0
    #: A vision model's image processor (Pillow and numpy: any thread) and the prompt's image
    #: tokens; None for a text-only model.
    image_processor: ImageProcessor | None = None
    image_tokens: ImageTokens | None = None

    def check_prompt_text(self, text: str, param: str | None = "messages") -> None:
        """Refuse, before tokenizing it, a text the context cannot hold whatever its tokens: no
        token stands for more than :attr:`longest_token_bytes` bytes, hence characters, so a text
        longer than ``context_length`` times that needs more tokens than the context has (and
        tokenizing megabytes for nothing can take gigabytes)."""
        limit = self.context_length * self.longest_token_bytes
        if limit and len(text) > limit:
            raise ContextLengthExceeded(
                f"the text has {len(text)} characters, more than this model's context length "
                f"({self.context_length} tokens of at most {self.longest_token_bytes} characters) "
                "can hold; shorten it",
                field=param,
            )

    def encode(self, text: str, *, add_special_tokens: bool = True, param: str | None = "messages") -> list[int]:
        """``text``'s ids; ContextLengthExceeded naming ``param`` for a text of more tokens than the
        context holds, found by tokenizing a head of it, never all of it (:func:`encode_within`)."""
        self.check_prompt_text(text, param=param)
        ids = encode_within(self.tokenizer, text, self.context_length, add_special_tokens=add_special_tokens)
        if len(ids) > self.context_length:
            raise ContextLengthExceeded(
                f"the text has more tokens than this model's context length ({self.context_length}); shorten it",
                field=param,
            )
        return ids


class Engine:
    """Owns MLX. States: ``created`` -> ``loading`` -> ``ready`` -> ``stopping`` -> ``stopped``
    (or ``failed`` when a model does not load)."""

    def __init__(self, config: Config, host: PluginHost, world: World | None = None):
        self.config = config
        #: This process's rank among several serving together (``distributed:``), or None.
        self.world = world
        self.host = host
        self.state = "created"
        self.error: BaseException | None = None
        self.models: dict[str, ModelInfo] = {}
        #: Every name and alias a client may ask for -> the served model's name.
        self.names: dict[str, str] = {}
        self.started_at = time.time()
        self._loaded: dict[str, LoadedModel] = {}
        self._kv_bytes_per_token: dict[str, int] = {}
        #: Per model, the fixed bytes of one sequence's recurrent layers (0 for attention only).
        self._state_bytes: dict[str, int] = {}
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        #: Requests the server has received and not yet submitted: see :class:`Arrivals`.
        self.arrivals = Arrivals()
        self._jobs: queue.Queue[EngineJob] = queue.Queue()
        self._jobs_lock = threading.Lock()
        self._jobs_open = True
        self._ready = threading.Event()
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

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self.error is not None:
            raise self.error

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

    def resolve(self, name: str) -> str:
        """The served model's name for ``name`` (a name or an alias); every API resolves a request's
        ``model`` here. Raises :class:`ModelNotFound` (404) listing the served models."""
        try:
            return self.names[name]
        except KeyError:
            raise ModelNotFound(name, self.models) from None

    def model(self, name: str) -> ModelInfo:
        """The served model ``name`` (a name or an alias) names; raises :class:`ModelNotFound`,
        and :class:`ModelUnavailable` for a model never loaded yet (:meth:`ensure_loaded` first)."""
        served = self.resolve(name)
        try:
            return self.models[served]
        except KeyError:
            raise ModelUnavailable(f"model {served!r} is not loaded yet; retry shortly") from None

    @property
    def served(self) -> list[str]:
        """Every configured model's name, loaded or not, once the engine has started."""
        lifecycle = self.lifecycle
        return list(lifecycle.slots) if lifecycle is not None else sorted(self.models)

    def ensure_loaded(self, name: str) -> Future[None]:
        """Ask for the model ``name`` (a name or an alias) to be loaded and count it as used now;
        the future is done once it is loaded, or holds why it could not be."""
        served = self.resolve(name)
        lifecycle = self.lifecycle
        if lifecycle is None:
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        slot = lifecycle.slots[served]
        if slot.state == "loaded" and served in self.models:
            slot.last_used = time.monotonic()
            done: Future[None] = Future()
            done.set_result(None)
            return done
        if self.state != "ready":
            raise ModelUnavailable(f"model {served!r} is not loaded: the engine is {self.state}")
        return lifecycle.post("load", served)

    def unload_model(self, name: str) -> Future[None]:
        """Ask for the model ``name`` to be unloaded (once its running requests end)."""
        return self._post("unload", name)

    def set_keep_alive(self, name: str, seconds: float | None) -> Future[None]:
        """Unload the model ``name`` after ``seconds`` idle from now on (None: never; 0: once idle)."""
        return self._post("keep_alive", name, seconds)

    def _post(self, command: str, name: str, value: Any = None) -> Future[None]:
        served = self.resolve(name)
        if self.lifecycle is None or self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        if self.world is not None:  # every rank keeps every model; rank 0 alone must not unload
            if command == "unload":
                raise Unsupported("unloading a model is not supported across processes (distributed:)")
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self.lifecycle.post(command, served, value)

    def loaded_models(self) -> list[tuple[ModelInfo, ModelSlot]]:
        """The models loaded now, with their slots (footprint, keep-alive), by name."""
        if self.lifecycle is None:
            return []
        slots = sorted(self.lifecycle.loaded(), key=lambda slot: slot.name)
        return [(self.models[slot.name], slot) for slot in slots if slot.name in self.models]

    def encode(
        self,
        model: str,
        text: str,
        *,
        add_special_tokens: bool = True,
        truncate: bool = False,
        param: str = "prompt",
    ) -> list[int]:
        """``text``'s token ids; ContextLengthExceeded naming ``param`` for a text the context cannot
        hold (:meth:`ModelInfo.encode`). With ``truncate`` (the caller keeps the first
        ``context_length`` ids) such a text's head is tokenized instead, and its first
        ``context_length`` + 1 ids returned."""
        info = self.model(model)
        if not truncate:
            return info.encode(text, add_special_tokens=add_special_tokens, param=param)
        if info.longest_token_bytes:
            text = text[: 2 * info.context_length * info.longest_token_bytes]
        return encode_within(info.tokenizer, text, info.context_length, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, model: str, messages: list[dict[str, Any]], *, images: Sequence[PromptImage] = (), **template_kwargs: Any
    ) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize the result; with
        ``images`` (the request's, loaded, in order), the image markers the template writes
        become those images' tokens."""
        info = self.model(model)
        tokenizer = info.tokenizer
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_kwargs
        )
        if images and info.image_tokens is not None:
            prompt = info.image_tokens.expand_for(prompt, [image.pixels for image in images])
        ids = info.encode(prompt, add_special_tokens=False)
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
        handle = self.enqueue(RequestHandle(request, loop=loop))
        handed_over()  # counted out once queued: a gathering engine finds it queued
        return handle

    def enqueue(self, handle: RequestHandle) -> RequestHandle:
        """:meth:`submit` for a handle made by the caller (a subclass that sends its events on:
        :mod:`mlxr_core.engine.remote`)."""
        self._validate(handle.request)
        self._queue.put(handle)
        return handle

    def _validate(self, request: GenerationRequest) -> ModelInfo:
        """Check ``request`` against its model and the queue (raising what :meth:`submit` names);
        sets its model to the served name and an unset ``max_tokens`` to what the context allows."""
        if self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        info = self.model(request.model)
        request.model = info.name  # an alias runs on the model it names
        prompt_tokens = len(request.prompt_ids)
        if prompt_tokens == 0:
            raise RequestError("the prompt is empty", field="prompt")
        width = info.tokenizer.vocab_size
        if isinstance(request.prompt_ids, (str, bytes)) or not all(
            isinstance(token, numbers.Integral) and not isinstance(token, bool) and 0 <= token < width
            for token in request.prompt_ids
        ):
            raise RequestError(f"prompt_ids must be token ids in [0, {width})", field="prompt")
        self._check_images(info, request)
        params = request.params
        room = info.context_length - prompt_tokens
        if params.max_tokens is None:
            if room < 1:
                raise ContextLengthExceeded.tokens(prompt_tokens, 1, info.context_length)
            params.max_tokens = min(self.config.engine.default_max_tokens, room)
        elif params.max_tokens > room:
            raise ContextLengthExceeded.tokens(prompt_tokens, params.max_tokens, info.context_length)
        budget = self.config.engine.max_kv_bytes
        needed = (prompt_tokens + params.max_tokens) * self._kv_bytes_per_token.get(request.model, 0)
        needed += self._state_bytes.get(request.model, 0)
        if budget and needed > budget:
            raise KvBudgetExceeded(
                f"this request needs {needed} bytes of KV cache (prompt + max_tokens), more than "
                f"engine.max_kv_bytes ({budget}); shorten the prompt or lower max_tokens",
                field="max_tokens",
            )
        from mlxr_core.engine.decoding import SamplerContext, validate_sampling

        context = SamplerContext(request.prompt_ids, info.tokenizer, info.tokenizer.vocab_size)
        validate_sampling(params, self.host.registries.samplers, context)
        if self.queue_depth >= self.config.engine.max_queue:
            raise Overloaded(
                f"{self.queue_depth} requests are waiting (engine.max_queue); retry later"
            )
        return info

    @staticmethod
    def _check_images(info: ModelInfo, request: GenerationRequest) -> None:
        """A request's images fit its model and prompt (one run of image tokens per image)."""
        from mlxr_core.engine.images import PromptImages

        if info.image_tokens is None:
            if request.images:
                raise RequestError(
                    f"the model {info.name!r} takes no images (it has no vision tower); send text only, "
                    "or the image to a vision model", field="messages",
                )  # fmt: skip
            return
        PromptImages(request.prompt_ids, request.images, info.image_tokens)

    def embed(
        self,
        model: str,
        inputs: Sequence[Sequence[int]],
        *,
        pooling: str = "mean",
        timeout: float | None = None,
    ) -> Embeddings:
        """The pooled, L2-normalized final hidden states of each token list (see
        :mod:`mlxr_core.engine.embedding`), computed on the engine thread between batch steps.

        :param model: a served model's name or alias.
        :param pooling: ``"mean"`` over the positions, or ``"last"``: the last position's state.
        :raises MlxrError: ModelNotFound, RequestError (empty input, ids outside the vocabulary),
            ContextLengthExceeded, EngineStopped, or what the computation raised.
        """
        return self._embedding_job(model, inputs, pooling).future.result(timeout)

    async def embed_async(
        self, model: str, inputs: Sequence[Sequence[int]], *, pooling: str = "mean"
    ) -> Embeddings:
        """:meth:`embed` for an event loop: waits without blocking it; cancelling the wait (a
        client that left) stops the job before its next forward pass."""
        return await _wait(self._embedding_job(model, inputs, pooling))  # type: ignore[no-any-return]

    def score(
        self, model: str, inputs: Sequence[Sequence[int]], *, timeout: float | None = None
    ) -> Scores:
        """How much the model prefers ``yes`` to ``no`` as the next token after each token list
        (see :mod:`mlxr_core.engine.scoring`), on the engine thread between batch steps.

        :raises MlxrError: as :meth:`embed` does, and RequestError for a vocabulary in which
            ``yes`` and ``no`` share their first token.
        """
        return self._scoring_job(model, inputs).future.result(timeout)  # type: ignore[no-any-return]

    async def score_async(self, model: str, inputs: Sequence[Sequence[int]]) -> Scores:
        """:meth:`score` for an event loop, cancelled with its wait as :meth:`embed_async` is."""
        return await _wait(self._scoring_job(model, inputs))  # type: ignore[no-any-return]

    def _embedding_job(self, model: str, inputs: Sequence[Sequence[int]], pooling: str) -> EngineJob:
        from mlxr_core.engine.embedding import EmbeddingWork

        check_pooling(pooling)
        info, token_lists = self._check_inputs(model, inputs)
        work = EmbeddingWork(info.name, token_lists, self.config.engine.prefill_chunk, pooling)
        return self._queue_job(EngineJob(work, what=f"embedding with model {info.name}", model=info.name))

    def _scoring_job(self, model: str, inputs: Sequence[Sequence[int]]) -> EngineJob:
        from mlxr_core.engine.scoring import ScoringWork, answer_ids

        info, token_lists = self._check_inputs(model, inputs)
        try:
            yes, no = answer_ids(info.tokenizer)
        except ValueError as exc:
            raise RequestError(f"model {info.name!r} cannot score relevance: {exc}", field="model") from None
        work = ScoringWork(info.name, token_lists, yes, no, self.config.engine.prefill_chunk)
        return self._queue_job(EngineJob(work, what=f"scoring with model {info.name}", model=info.name))

    def _check_inputs(
        self, model: str, inputs: Sequence[Sequence[int]]
    ) -> tuple[ModelInfo, list[list[int]]]:
        """Validate a job's token lists in the caller's thread."""
        if self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        info = self.model(model)
        if not inputs:
            raise RequestError("input must hold at least one item", field="input")
        vocab = info.tokenizer.vocab_size
        token_lists = [list(ids) for ids in inputs]
        for i, ids in enumerate(token_lists):
            if not ids:
                raise RequestError(f"input[{i}] is empty", field="input")
            if any(not 0 <= token < vocab for token in ids):
                raise RequestError(f"input[{i}]: token ids must be in [0, {vocab})", field="input")
            if len(ids) > info.context_length:
                raise ContextLengthExceeded(
                    f"input[{i}] has {len(ids)} tokens, more than this model's context length "
                    f"({info.context_length}); shorten it",
                    field="input",
                )
        return info, token_lists

    def _queue_job(self, job: EngineJob) -> EngineJob:
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
            log.error("loading failed: %s", exc)
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
            self._kv_bytes_per_token[name] = per_token = kv_bytes_per_token(loaded)
            self._state_bytes[name] = state = sequence_bytes(loaded, 0, 0)
            self._loaded[name] = loaded
            try:
                self.scheduler.add_model(loaded)
            except BaseException:
                self._loaded.pop(name, None)
                raise
        self._warm_decode(loaded)
        self.models[name] = self._model_info(loaded)
        self.host.notify("mlxr_model_loaded", name=name, model=loaded)
        return model_footprint(
            self.config.engine, loaded.nbytes, loaded.context_length, per_token, state
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

    def _model_info(self, m: LoadedModel) -> ModelInfo:
        name = m.name
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


async def _wait(job: EngineJob) -> Any:
    """``job``'s result, awaited; a cancelled wait (a client that left) cancels the job."""
    try:
        return await asyncio.wrap_future(job.future)
    except asyncio.CancelledError:
        job.cancel()
        raise


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
