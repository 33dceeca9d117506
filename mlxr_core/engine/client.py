"""The engine as its callers see it: :class:`EngineClient`, what HTTP and the CLI use, and
:class:`EngineCaller`, the caller-thread half both engines share.

Two engines implement the client: :class:`~mlxr_core.engine.engine.Engine`, the engine thread in
this process, and :class:`~mlxr_core.engine.remote.RemoteEngine`, the client of an engine in a
process of its own (``engine.core: process``). Each checks a request in the caller's thread
(:mod:`mlxr_core.engine.admission`) and hands it on: to its queue, or down its pipe.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from mlxr_core.engine.admission import ModelInfo, check_inputs, check_request
from mlxr_core.engine.embedding import Embeddings, check_pooling
from mlxr_core.engine.jobs import EngineJob
from mlxr_core.engine.request import Arrivals
from mlxr_core.engine.scoring import Scores
from mlxr_core.errors import (
    EngineStopped,
    ModelNotFound,
    ModelUnavailable,
    Overloaded,
    RequestError,
    Unsupported,
)
from mlxr_core.model.tokenizer import encode_within

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.engine.lifecycle import ModelSlot
    from mlxr_core.engine.option_scoring import OptionScores
    from mlxr_core.engine.request import GenerationRequest, RequestHandle
    from mlxr_core.model.audio import Transcript, TranscriptionOptions
    from mlxr_core.plugins import PluginHost


class LifecycleState(Protocol):
    """Which models are loaded, as a caller reads it: the engine's
    :class:`~mlxr_core.engine.lifecycle.ModelLifecycle`, or the engine process's last report."""

    slots: dict[str, ModelSlot]

    def post(self, command: str, name: str, value: Any = None) -> Future[None]: ...

    def loaded(self) -> list[ModelSlot]: ...

    def stats(self) -> dict[str, Any]: ...


class EngineClient(Protocol):
    """What the server and the CLI may ask of an engine, from any thread.

    States: ``created`` -> ``loading`` -> ``ready`` -> ``stopping`` -> ``stopped`` (or ``failed``).
    """

    config: Config
    host: PluginHost
    state: str
    error: BaseException | None
    #: Every served model loaded at least once, by its name.
    models: dict[str, ModelInfo]
    #: LoRA adapters served as models of their own -> (their model, the adapter).
    adapters: dict[str, tuple[str, str]]
    started_at: float
    #: Requests the server has received and not yet submitted (:class:`Arrivals`).
    arrivals: Arrivals
    #: Called when the engine is lost while serving (``mlxr serve`` stops the server then).
    on_lost: Callable[[], None] | None

    @property
    def lifecycle(self) -> LifecycleState | None: ...

    def start(self, *, wait: bool = True, timeout: float | None = None) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def resolve(self, name: str) -> str: ...

    def model(self, name: str) -> ModelInfo: ...

    @property
    def served(self) -> list[str]: ...

    def ensure_loaded(self, name: str) -> Future[None]: ...

    def unload_model(self, name: str) -> Future[None]: ...

    def administer_adapter(self, name: str, action: str) -> Future[bool]: ...

    def create_adapter(self, model: str, name: str, path: str | None) -> Future[bool]: ...

    def set_keep_alive(self, name: str, seconds: float | None) -> Future[None]: ...

    def loaded_models(self) -> list[tuple[ModelInfo, ModelSlot]]: ...

    def encode(
        self, model: str, text: str, *, add_special_tokens: bool = True, truncate: bool = False, param: str = "prompt"
    ) -> list[int]: ...

    def submit(self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle: ...

    def embed(
        self, model: str, inputs: Sequence[Sequence[int]], *, pooling: str = "mean", timeout: float | None = None
    ) -> Embeddings: ...

    async def embed_async(self, model: str, inputs: Sequence[Sequence[int]], *, pooling: str = "mean") -> Embeddings: ...

    async def transcribe_async(
        self, model: str, features: Any, duration: float, options: TranscriptionOptions
    ) -> Transcript: ...

    def score(self, model: str, inputs: Sequence[Sequence[int]], *, timeout: float | None = None) -> Scores: ...

    async def score_async(self, model: str, inputs: Sequence[Sequence[int]]) -> Scores: ...

    async def option_scores_async(
        self, model: str, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]]
    ) -> OptionScores: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def running(self) -> int: ...

    def memory(self) -> dict[str, int]: ...

    def stats(self) -> dict[str, Any]: ...


class EngineCaller:
    """The part of an :class:`EngineClient` that runs in the caller's thread, the same for both
    engines: names, tokenizing, admission of embedding and scoring work. An engine gives it its
    state (the attributes below) and :meth:`queue_job`, where checked work goes."""

    config: Config
    host: PluginHost
    state: str
    error: BaseException | None
    models: dict[str, ModelInfo]
    #: Every name and alias a client may ask for -> the served model's name.
    names: dict[str, str]
    #: Every LoRA adapter served as a model of its own (``<model>:<adapter>``) -> its model's name
    #: and the adapter's (``models[].adapters``); each is in :attr:`names` too, naming its model.
    adapters: dict[str, tuple[str, str]]
    #: Per model, the bytes of KV cache one token takes, and the fixed bytes of one sequence's
    #: recurrent layers (0 for attention only): a request's admission reads them.
    kv_bytes_per_token: dict[str, int]
    state_bytes: dict[str, int]
    #: Whether several processes serve together (``distributed:``): then models are never unloaded.
    distributed: bool
    _ready: threading.Event

    #: Which models are loaded (None before the engine thread starts).
    lifecycle: LifecycleState | None

    def __init__(self, config: Config, host: PluginHost, *, distributed: bool = False):
        self.config = config
        self.host = host
        self.distributed = distributed
        self.state = "created"
        self.error = None
        self.models = {}
        self.names = {}
        self.adapters = {}
        self.started_at = time.time()
        self.kv_bytes_per_token = {}
        self.state_bytes = {}
        self.arrivals = Arrivals()
        self._ready = threading.Event()

    def admit(self, request: GenerationRequest) -> ModelInfo:
        """Check ``request`` in the caller's thread (:func:`check_request`) before it is queued or
        sent on; its model's info."""
        self.check_ready()
        adapter = self.adapters.get(request.model)
        if adapter is not None:  # an adapter served as a model: its model, with the adapter
            request.adapter = adapter[1]
        if request.adapter_scale != 1.0 and (request.adapter is None or not math.isfinite(request.adapter_scale)):
            raise RequestError(
                f"an adapter scale ({request.adapter_scale}) needs a finite number and a model naming a LoRA adapter",
                field="lora_scale",
            )
        info = self.model(request.model)
        check_request(
            info, request, config=self.config.engine, samplers=self.host.registries.samplers,
            kv_bytes_per_token=self.kv_bytes_per_token.get(info.name, 0),
            state_bytes=self.state_bytes.get(info.name, 0), queue_depth=self.queue_depth,
        )  # fmt: skip
        return info

    @property
    def queue_depth(self) -> int:
        raise NotImplementedError

    def queue_job(self, job: EngineJob) -> EngineJob:
        """Hand a checked job to the engine thread; see the engines."""
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the models are loaded, raising their error."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self.error is not None:
            raise self.error

    def check_ready(self) -> None:
        if self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")

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

    def administer_adapter(self, name: str, action: str) -> Future[bool]:
        """``load`` or ``unload`` the LoRA adapter served as the model ``name``
        (:class:`~mlxr_core.engine.adapters.AdapterWork`); the future holds whether it is
        resident afterwards."""
        from mlxr_core.engine.adapters import AdapterWork

        model, adapter = self.adapters[name]
        work = AdapterWork(model, adapter, action)
        future: Future[bool] = self.queue_job(EngineJob(work, f"adapter {name} {action}", model=model)).future
        return future

    def create_adapter(self, model: str, name: str, path: str | None) -> Future[bool]:
        """Serve the LoRA adapter at ``path`` over the served model ``model`` as a model of its own
        named ``name`` (replacing one created earlier under it), or delete it (``path`` None)
        (:class:`~mlxr_core.engine.created_adapters.CreatedAdapter`); the future holds whether it
        is served afterwards, or the error that refused it."""
        from mlxr_core.engine.created_adapters import CreatedAdapter

        served = self.resolve(model)
        what = f"adapter {name} {'created' if path is not None else 'deleted'} over {served}"
        future: Future[bool] = self.queue_job(EngineJob(CreatedAdapter(served, name, path), what, model=served)).future
        return future

    def unload_model(self, name: str) -> Future[None]:
        """Ask for the model ``name`` to be unloaded (once its running requests end)."""
        return self._post("unload", name)

    def set_keep_alive(self, name: str, seconds: float | None) -> Future[None]:
        """Unload the model ``name`` after ``seconds`` idle from now on (None: never; 0: once idle)."""
        return self._post("keep_alive", name, seconds)

    def _post(self, command: str, name: str, value: Any = None) -> Future[None]:
        served = self.resolve(name)
        lifecycle = self.lifecycle
        if lifecycle is None or self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        if self.distributed:  # every rank keeps every model; rank 0 alone must not unload
            if command == "unload":
                raise Unsupported("unloading a model is not supported across processes (distributed:)")
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return lifecycle.post(command, served, value)

    def loaded_models(self) -> list[tuple[ModelInfo, ModelSlot]]:
        """The models loaded now, with their slots (footprint, keep-alive), by name."""
        lifecycle = self.lifecycle
        if lifecycle is None:
            return []
        slots = sorted(lifecycle.loaded(), key=lambda slot: slot.name)
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
        return self._embedding_job(model, inputs, pooling).future.result(timeout)  # type: ignore[no-any-return]

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

    async def transcribe_async(
        self, model: str, features: Any, duration: float, options: TranscriptionOptions
    ) -> Transcript:
        """The transcript of ``features`` (the model's front end's, of ``duration`` seconds of
        sound), computed on the engine thread a decoder step at a time between batch steps
        (:mod:`mlxr_core.engine.transcription`); cancelling the wait stops it at its next step.

        :raises MlxrError: ModelNotFound, RequestError (a model that does not transcribe, a
            language it does not know), EngineStopped, or what the computation raised.
        """
        from mlxr_core.engine.transcription import TranscriptionWork

        self.check_ready()
        info = self.model(model)
        if not info.transcribes:
            raise RequestError(f"the model {info.name!r} does not transcribe audio (it is no speech model)", field="model")
        if self.queue_depth >= self.config.engine.max_queue:  # as a generation request is refused
            raise Overloaded(f"{self.queue_depth} requests are waiting (engine.max_queue); retry later")
        work = TranscriptionWork(info.name, features, duration, options)
        job = self.queue_job(EngineJob(work, what=f"transcription with model {info.name}", model=info.name))
        return await _wait(job)  # type: ignore[no-any-return]

    async def option_scores_async(
        self, model: str, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]]
    ) -> OptionScores:
        """Per prompt, each of its options' log-probability as the answer after it, every token of
        the option counted as a choice-constrained decode reads it
        (:mod:`mlxr_core.engine.option_scoring`), with the positions the job ran; on the engine
        thread between batch steps (the prompts' shared prefix forked from the prefix cache where
        it holds it), cancelled with its wait.

        :raises MlxrError: ModelNotFound, RequestError (a prompt or an option without tokens, ids
            outside the vocabulary, a prompt past the context), EngineStopped.
        """
        from mlxr_core.engine.option_scoring import OptionScoringWork

        self.check_ready()
        adapter = self.adapters.get(model)  # an adapter served as a model: its model, with it
        info = self.model(model)
        token_lists = check_inputs(info, prompts)
        choices = [[list(ids) for ids in row] for row in options]
        width = info.tokenizer.vocab_size
        for i, row in enumerate(choices):
            if not row or any(not ids or min(ids) < 0 or max(ids) >= width for ids in row):
                raise RequestError(f"options must be token ids in [0, {width}), none empty", field=f"options[{i}]")
        end = sorted(info.tokenizer.eos_token_ids)
        work = OptionScoringWork(info.name, token_lists, choices, end, self.config.engine.prefill_chunk,
                                 adapter[1] if adapter is not None else None)  # fmt: skip
        return await _wait(self.queue_job(EngineJob(work, what=f"option scoring with model {info.name}", model=info.name)))  # type: ignore[no-any-return]

    def _refuse_adapter(self, model: str, what: str) -> None:
        """A LoRA adapter served as a model generates; its base's other work would leave it out."""
        if model in self.adapters:
            raise RequestError(f"{what} with a LoRA adapter are not served; ask its model "
                               f"{self.adapters[model][0]!r}", field="model")  # fmt: skip

    def _embedding_job(self, model: str, inputs: Sequence[Sequence[int]], pooling: str) -> EngineJob:
        from mlxr_core.engine.embedding import EmbeddingWork

        check_pooling(pooling)
        self.check_ready()
        self._refuse_adapter(model, "embeddings")
        info = self.model(model)
        token_lists = check_inputs(info, inputs)
        work = EmbeddingWork(info.name, token_lists, self.config.engine.prefill_chunk, pooling)
        return self.queue_job(EngineJob(work, what=f"embedding with model {info.name}", model=info.name))

    def _scoring_job(self, model: str, inputs: Sequence[Sequence[int]]) -> EngineJob:
        from mlxr_core.engine.scoring import ScoringWork, answer_ids

        self.check_ready()
        self._refuse_adapter(model, "scoring")
        info = self.model(model)
        token_lists = check_inputs(info, inputs)
        try:
            yes, no = answer_ids(info.tokenizer)
        except ValueError as exc:
            raise RequestError(f"model {info.name!r} cannot score relevance: {exc}", field="model") from None
        work = ScoringWork(info.name, token_lists, yes, no, self.config.engine.prefill_chunk)
        return self.queue_job(EngineJob(work, what=f"scoring with model {info.name}", model=info.name))


async def _wait(job: EngineJob) -> Any:
    """``job``'s result, awaited; a cancelled wait (a client that left) cancels the job."""
    try:
        return await asyncio.wrap_future(job.future)
    except asyncio.CancelledError:
        job.cancel()
        raise
