"""The engine in a process of its own (``engine.core: process``; ``thread`` is the default).

In one process, the engine thread that builds each step's MLX graph and the event loop that turns
each token into an HTTP chunk take turns on one GIL: at 32 streams on a GPU, where a decode step is
bound by the host, the engine thread waited ~3.7 ms a step for the loop (``bench/README.md``).
Here the engine runs in a child process (:func:`core_main`: the same :class:`Engine`, loading its
own plugins and the models) and the server process keeps the rest: tokenizing and chat templates
(a model's :class:`ModelInfo`, tokenizer included, crosses once, when it loads), validating
requests, detokenizing, encoding responses and writing them. Stop strings are still matched by
the engine, which must stop decoding at one.

:class:`RemoteEngine` is the server process's engine: an
:class:`~mlxr_core.engine.client.EngineClient` like :class:`Engine`, whose caller-thread half
(:class:`~mlxr_core.engine.client.EngineCaller`, admission included) it shares, over one duplex
pipe (``multiprocessing.Pipe``) carrying the typed messages below, pickled:

- server -> core: :class:`Submit` (with the requests the server has received and not yet
  submitted, :class:`~mlxr_core.engine.request.Arrivals`), :class:`ArrivalsEmptied`,
  :class:`Cancel`, :class:`Post` (load, unload, keep-alive), :class:`Job` (embeddings, scores),
  :class:`CancelJob`, :class:`Stop`; the core answers each kind through one dispatch table;
- core -> server: :class:`Events`, one message per engine step holding every event the step emitted
  (new tokens as ids: the server's handle detokenizes them), :class:`Snapshot` (state, models,
  slots and counters, every :data:`SNAPSHOT_INTERVAL_S` and before each reply), :class:`Reply`.

A core that dies (killed, out of memory) closes the pipe: every request still running ends with an
:class:`EngineStopped` error event, the engine's state becomes ``failed`` and the server stops and
exits non-zero (:attr:`RemoteEngine.on_lost`). A server that dies closes it too: the core stops.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.client import EngineCaller, EngineClient
from mlxr_core.engine.detokenizer import StreamingDetokenizer
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.jobs import EngineJob
from mlxr_core.engine.lifecycle import ModelSlot
from mlxr_core.engine.request import (
    ARRIVING,
    Delta,
    Failed,
    GenerationRequest,
    Outbox,
    RequestHandle,
    TokenLogprob,
    Tokens,
    handed_over,
)
from mlxr_core.errors import EngineStopped, MlxrError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from mlxr_core.config.schema import Config
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)

#: Seconds between the core's snapshots of its state and counters (/health, /metrics, /api/ps).
SNAPSHOT_INTERVAL_S = 0.25
#: Seconds a stopping core may take beyond the drain's timeout before it is killed.
STOP_GRACE_S = 15.0


def uses_own_process(config: Config) -> bool:
    """Whether ``engine.core`` puts the engine in a process of its own: ``process``, except under
    ``distributed:`` (each rank's engine is already its process's one MLX user)."""
    distributed = config.distributed
    if distributed.tensor_parallel * distributed.pipeline_parallel > 1:
        return False
    return config.engine.core == "process"


def make_engine(config: Config, host: PluginHost, world: Any = None) -> EngineClient:
    """The server's engine: a :class:`RemoteEngine` where :func:`uses_own_process`, else the
    engine thread."""
    if world is None and uses_own_process(config):
        return RemoteEngine(config, host)
    if config.engine.core == "process":
        log.warning("engine.core: process does not apply under distributed:; each rank runs its engine in a thread")
    return Engine(config, host, world=world)


# -- what crosses the pipe -------------------------------------------------------------------


@attrs.frozen
class Submit:
    """A request to run; ``arriving``: the requests the server has received behind it."""

    rid: int
    request: GenerationRequest
    arriving: int


@attrs.frozen
class ArrivalsEmptied:
    """The server's count of arriving requests emptied without a submit."""


@attrs.frozen
class Cancel:
    rid: int


@attrs.frozen
class Post:
    """A lifecycle command (``load``, ``unload``, ``keep_alive``) for a model; answered by a Reply."""

    call: int
    command: str
    name: str
    value: Any = None


@attrs.frozen
class Job:
    """Embedding or scoring work (a picklable value); answered by a Reply."""

    call: int
    work: Any
    what: str
    model: str | None


@attrs.frozen
class CancelJob:
    call: int


@attrs.frozen
class Stop:
    """Stop, letting running requests finish for up to ``timeout`` seconds."""

    timeout: float


@attrs.frozen
class Events:
    """One engine step's events, as plain tuples (:func:`_encode_event`)."""

    items: list[tuple[Any, ...]]


@attrs.frozen
class Reply:
    call: int
    result: Any
    error: tuple[str, str, tuple[Any, ...], dict[str, Any]] | None


@attrs.define
class Snapshot:
    """The core engine's state as the server reads it."""

    state: str
    error: tuple[str, str, tuple[Any, ...], dict[str, Any]] | None
    #: Models loaded since the previous snapshot (a :class:`ModelInfo` crosses once per load).
    models: dict[str, ModelInfo]
    names: dict[str, str]
    adapters: dict[str, tuple[str, str]]
    slots: dict[str, ModelSlot]
    lifecycle: dict[str, Any]
    stats: dict[str, Any]
    memory: dict[str, int]
    kv_bytes_per_token: dict[str, int]
    state_bytes: dict[str, int]


def encode_error(error: BaseException) -> tuple[str, str, tuple[Any, ...], dict[str, Any]]:
    """An exception as plain values (its class by name, args and attributes): MlxrError subclasses
    whose ``__init__`` takes other arguments than their message do not unpickle."""
    if not isinstance(error, MlxrError):
        error = MlxrError(f"{type(error).__name__}: {error}")
    cls = type(error)
    return cls.__module__, cls.__qualname__, tuple(error.args), dict(vars(error))


def decode_error(encoded: tuple[str, str, tuple[Any, ...], dict[str, Any]]) -> MlxrError:
    module, name, args, state = encoded
    try:
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, MlxrError)):
            raise TypeError(name)
    except (ImportError, AttributeError, TypeError):
        cls = MlxrError
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    vars(error).update(state)
    return error  # type: ignore[no-any-return]


def _encode_event(rid: int, event: Any) -> tuple[Any, ...]:
    if isinstance(event, Tokens):  # plain tuples: pickled in a third of the time attrs objects take
        logprobs = tuple((lp.token, lp.logprob, lp.top) for lp in event.logprobs)
        return (rid, "t", event.token_ids, logprobs, event.flush)
    if isinstance(event, Failed):
        return (rid, "x", encode_error(event.error))
    return (rid, "e", event)


# -- the core (child process) ------------------------------------------------------------------


def core_main(conn: Connection, config: Config, log_level: str) -> None:
    """The engine process: load the plugins and the models, then run the server's requests until
    it says stop or goes away. Signals are the server's to handle: a Ctrl-C reaching the whole
    process group must drain, not kill the engine under running requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from mlxr_core.logs import setup_logging
    from mlxr_core.plugins import load_plugins

    setup_logging(log_level)
    host = load_plugins(
        disable=config.plugins.disable,
        strict=True if config.plugins.strict else None,
        require=config.plugins.require,
    )
    engine = Engine(config, host)
    core = Core(engine, conn)
    engine.start(wait=False)
    core.serve()


class _CoreHandle(RequestHandle):
    """A request in the core: its events go to the server (:meth:`Core.call_soon_threadsafe`
    stands in for the consumer's event loop, so a step's events leave as one message)."""

    def __init__(self, request: GenerationRequest, rid: int, core: Core):
        super().__init__(request)
        self.rid = rid
        self._loop = core  # type: ignore[assignment]


class Core:
    """The core's side of the pipe: requests in, a message per step out."""

    def __init__(self, engine: Engine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self._handles: dict[int, _CoreHandle] = {}
        self._jobs: dict[int, EngineJob] = {}
        #: The ModelInfo objects already sent, by model name.
        self._sent: dict[str, ModelInfo] = {}
        self._closed = threading.Event()
        #: What the core does with each kind of message from the server (:class:`Stop` ends it).
        self._handlers: dict[type, Callable[[Any], None]] = {
            Submit: self._submit,
            ArrivalsEmptied: self._arrivals_emptied,
            Cancel: self._cancel,
            Post: self._post,
            Job: self._job,
            CancelJob: self._cancel_job,
        }

    def send(self, message: Any) -> None:
        if self._closed.is_set():
            return
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the server is gone: its requests have no one to go to
            self._closed.set()
            for handle in list(self._handles.values()):
                handle.cancel()

    def call_soon_threadsafe(self, callback: Any, items: list[tuple[RequestHandle, Any]]) -> None:
        """Where the engine thread's :class:`~mlxr_core.engine.request.Outbox` hands a step's events."""
        out = []
        for handle, event in items:
            rid = handle.rid  # type: ignore[attr-defined]
            out.append(_encode_event(rid, event))
            if not isinstance(event, (Tokens, Delta)):
                self._handles.pop(rid, None)
        self.send(Events(out))

    def snapshot(self) -> None:
        engine = self.engine
        new = {name: info for name, info in list(engine.models.items()) if self._sent.get(name) is not info}
        self._sent.update(new)
        lifecycle = engine.lifecycle
        slots = {}
        if lifecycle is not None:
            for name, slot in list(lifecycle.slots.items()):
                slots[name] = attrs.evolve(slot, waiters=[], unload_waiters=[])
        stats = engine.stats()
        memory = engine.memory() if engine.state == "ready" else {}
        self.send(Snapshot(
            state=engine.state,
            error=encode_error(engine.error) if engine.error is not None else None,
            models=new,
            names=dict(engine.names),
            adapters=dict(engine.adapters),
            slots=slots,
            lifecycle=lifecycle.stats() if lifecycle is not None else {},
            stats=stats,
            memory=memory,
            kv_bytes_per_token=dict(engine.kv_bytes_per_token),
            state_bytes=dict(engine.state_bytes),
        ))  # fmt: skip

    def serve(self) -> None:
        """Answer the server until it says stop (then stop the engine, draining as told) or the
        pipe closes (then stop at once)."""
        threading.Thread(target=self._report, name="mlxr-core-report", daemon=True).start()
        timeout = 0.0
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.warning("the server process is gone; stopping the engine")
                self._closed.set()
                break
            if isinstance(message, Stop):
                timeout = message.timeout
                break
            self.handle(message)
        self.engine.stop(timeout)
        self.snapshot()
        self._closed.set()
        self.conn.close()

    def handle(self, message: Any) -> None:
        """Do what ``message`` from the server asks, through the dispatch table; a message that
        fails is logged and the engine goes on."""
        handler = self._handlers.get(type(message))
        if handler is None:
            log.error("engine process: unknown message %r", type(message).__name__)
            return
        try:
            handler(message)
        except Exception:  # a bad message must not end the engine
            log.exception("engine process: message %s failed", type(message).__name__)

    def _submit(self, message: Submit) -> None:
        rid = message.rid
        handle = _CoreHandle(message.request, rid, self)
        self._handles[rid] = handle
        # This request counts as arriving until it is queued: an idle engine that takes it in
        # sees the server's count of those behind it, one that is gathering waits for it.
        self.engine.arrivals.set(message.arriving + 1)
        try:
            self.engine.enqueue(handle)
        except MlxrError as exc:
            self._handles.pop(rid, None)
            self.send(Events([(rid, "x", encode_error(exc))]))
        self.engine.arrivals.set(message.arriving)

    def _arrivals_emptied(self, message: ArrivalsEmptied) -> None:
        self.engine.arrivals.set(0)

    def _cancel(self, message: Cancel) -> None:
        cancelled = self._handles.get(message.rid)
        if cancelled is not None:
            cancelled.cancel()

    def _post(self, message: Post) -> None:
        call = message.call
        lifecycle = self.engine.lifecycle
        if lifecycle is None:
            self.send(Reply(call, None, encode_error(EngineStopped("the engine is not running"))))
            return
        future = lifecycle.post(message.command, message.name, message.value)
        future.add_done_callback(lambda future: self._reply(call, future))

    def _job(self, message: Job) -> None:
        call = message.call
        job = EngineJob(message.work, what=message.what, model=message.model)
        self._jobs[call] = job
        job.future.add_done_callback(lambda future: self._reply(call, future))
        try:
            self.engine.queue_job(job)
        except MlxrError as exc:
            job.refuse(exc)

    def _cancel_job(self, message: CancelJob) -> None:
        unwanted = self._jobs.get(message.call)
        if unwanted is not None:
            unwanted.cancel()

    def _reply(self, call: int, future: Future[Any]) -> None:
        self._jobs.pop(call, None)
        if future.cancelled():
            error: BaseException | None = MlxrError("cancelled")
        else:
            error = future.exception()
        self.snapshot()  # a load's reply must find its model in the server's view
        result = None if error is not None else future.result()
        self.send(Reply(call, result, encode_error(error) if error is not None else None))

    def _report(self) -> None:
        while not self._closed.is_set():
            self.snapshot()
            self._closed.wait(SNAPSHOT_INTERVAL_S)


# -- the server's side -------------------------------------------------------------------------


class _LifecycleView:
    """The core's :class:`~mlxr_core.engine.lifecycle.ModelLifecycle` as of its last snapshot;
    commands go to the core."""

    def __init__(self, engine: RemoteEngine):
        self._engine = engine
        self.slots: dict[str, ModelSlot] = {}
        self._stats: dict[str, Any] = {}

    def post(self, command: str, name: str, value: Any = None) -> Future[None]:
        future: Future[None] = Future()
        self._engine._call(future, lambda call: Post(call, command, name, value))
        return future

    def loaded(self) -> list[ModelSlot]:
        return [slot for slot in list(self.slots.values()) if slot.state == "loaded"]

    def stats(self) -> dict[str, Any]:
        return self._stats


class RemoteHandle(RequestHandle):
    """A request whose engine is in the other process: detokenized here; cancelling tells the core."""

    def __init__(self, request: GenerationRequest, engine: RemoteEngine, info: ModelInfo,
                 loop: asyncio.AbstractEventLoop | None):  # fmt: skip
        super().__init__(request, loop=loop)
        self.rid = engine._new_id()
        self.detokenizer = StreamingDetokenizer(info.tokenizer, request.keep_special)
        self._engine = engine

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            super().cancel()
            self._engine._send(Cancel(self.rid))


class RemoteEngine(EngineCaller):
    """The server's engine when it runs in a process of its own (see the module)."""

    def __init__(self, config: Config, host: PluginHost):
        super().__init__(config, host)
        self.lifecycle: _LifecycleView = _LifecycleView(self)
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._ids = 0
        self._ids_lock = threading.Lock()
        self._handles: dict[int, RemoteHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._snapshot: Snapshot | None = None
        self._stopping = False
        #: The reader thread's: each message's events reach each loop in one hand-over.
        self._outbox = Outbox()
        #: Called (from the pipe's reader thread) when the core process dies: ``mlxr serve``
        #: stops the server, which then exits non-zero with :attr:`error`.
        self.on_lost: Callable[[], None] | None = None
        # The core knows the count only from each submit: it is told when the count empties
        # without one (a request answered without being submitted, a client that left).
        self.arrivals.on_empty = self._arrivals_emptied
        self._core_arrivals = 0  # the count the core was last given

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, *, wait: bool = True, timeout: float | None = None) -> None:
        from mlxr_core.logs import level_name

        self.state = "loading"
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=core_main, args=(child, self.config, level_name()), name="mlxr-engine", daemon=True
        )
        self._process.start()
        child.close()
        atexit.register(self._kill)
        threading.Thread(target=self._read, name="mlxr-engine-pipe", daemon=True).start()
        log.info("engine process %d started", self._process.pid)
        if wait:
            self.wait_ready(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._process is not None:
            self._process.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the core to stop as :meth:`Engine.stop` does (running requests get ``timeout``
        seconds); kill it if it has not ended :data:`STOP_GRACE_S` after that."""
        if self.state in ("stopping", "stopped") or self._process is None:
            self.state = "stopped" if self._process is None else self.state
            return
        lost = self.state == "failed" and not self._process.is_alive()
        self.state = "stopping"
        self._stopping = True
        if not lost:
            self.host.notify("mlxr_engine_stopping", engine=self)
            self._send(Stop(timeout))
        self._process.join(timeout + STOP_GRACE_S)
        self._kill()
        self._end_all(EngineStopped("the server is shutting down"))
        self.state = "stopped" if self.error is None else "failed"

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.is_alive():
            log.warning("engine process %d did not stop; killing it", process.pid)
            process.kill()
            process.join(5.0)

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Check ``request`` here, as :meth:`Engine.submit` does, and send it to the core."""
        info = self.admit(request)
        handle = RemoteHandle(request, self, info, loop)
        self._handles[handle.rid] = handle
        arrival = ARRIVING.get()
        counted = arrival is not None and arrival.counted
        others = max(0, self.arrivals.pending - counted)  # the count the core gets excludes this request
        self._core_arrivals = others
        sent = self._send(Submit(handle.rid, request, others))
        handed_over()  # after the submit: a core told the count emptied has it queued
        if not sent:
            self._handles.pop(handle.rid, None)
            raise EngineStopped("the engine process is gone")
        return handle

    def _arrivals_emptied(self) -> None:
        if self._core_arrivals:  # the core waits for requests that will not come
            self._core_arrivals = 0
            self._send(ArrivalsEmptied())

    def queue_job(self, job: EngineJob) -> EngineJob:
        """Run ``job`` in the core: its ``work`` (a picklable value: :class:`EmbeddingWork`,
        :class:`ScoringWork`) crosses; the result comes back into ``job.future``, and a cancelled
        ``job.future`` cancels the core's job."""
        if self.state != "ready":
            raise EngineStopped(f"the engine is {self.state}; not accepting requests")
        call = self._call(job.future, lambda call: Job(call, job.work, job.what, job.model))
        handed_over()

        def cancelled(done: Future[Any]) -> None:
            if done.cancelled():
                self._send(CancelJob(call))

        job.future.add_done_callback(cancelled)
        return job

    def _call(self, future: Future[Any], message: Callable[[int], Any]) -> int:
        """Send ``message(call)``; the core's :class:`Reply` settles ``future``. Returns ``call``."""
        call = self._new_id()
        self._calls[call] = future
        if not self._send(message(call)):
            self._calls.pop(call, None)
            _settle(future, error=EngineStopped("the engine process is gone"))
        return call

    def _new_id(self) -> int:
        with self._ids_lock:
            self._ids += 1
            return self._ids

    def _send(self, message: Any) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(message)
        except (OSError, ValueError):
            return False
        return True

    # -- what the core last reported ---------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        snapshot = self._snapshot
        return int(snapshot.stats.get("queued", 0)) if snapshot is not None else 0

    @property
    def running(self) -> int:
        snapshot = self._snapshot
        return int(snapshot.stats.get("running", 0)) if snapshot is not None else 0

    def stats(self) -> dict[str, Any]:
        snapshot = self._snapshot
        if snapshot is None:
            return {"running": 0, "queued": 0, "kv_bytes": 0, "prefix_cache": {}}
        return snapshot.stats

    def memory(self) -> dict[str, int]:
        snapshot = self._snapshot
        return dict(snapshot.memory) if snapshot is not None else {}

    # -- the pipe's reader thread ------------------------------------------------------------

    def _read(self) -> None:
        with self._outbox.installed():
            self._read_messages()

    def _read_messages(self) -> None:
        assert self._conn is not None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Events):
                self._deliver(message.items)
            elif isinstance(message, Snapshot):
                self._apply(message)
            elif isinstance(message, Reply):
                future = self._calls.pop(message.call, None)
                if future is not None:
                    error = decode_error(message.error) if message.error is not None else None
                    _settle(future, message.result, error)
        self._conn.close()
        if not self._stopping:
            self._lose()

    def _deliver(self, items: list[tuple[Any, ...]]) -> None:
        with self._outbox.together():
            for rid, kind, *payload in items:
                handle = self._handles.get(rid)
                if handle is None:
                    continue
                event: Any
                if kind == "t":
                    ids, logprobs, flush = payload
                    logprobs = tuple(TokenLogprob(*lp) for lp in logprobs)
                    event = Tokens(ids, logprobs, handle.detokenizer, flush=flush)
                elif kind == "x":
                    event = Failed(decode_error(payload[0]))
                else:
                    event = payload[0]
                if not isinstance(event, (Tokens, Delta)):
                    del self._handles[rid]
                handle._emit(event)

    def _apply(self, snapshot: Snapshot) -> None:
        self.models.update(snapshot.models)
        self.names = snapshot.names
        self.adapters = snapshot.adapters
        self.lifecycle.slots = snapshot.slots
        self.lifecycle._stats = snapshot.lifecycle
        self.kv_bytes_per_token = snapshot.kv_bytes_per_token
        self.state_bytes = snapshot.state_bytes
        snapshot.models = {}
        self._snapshot = snapshot
        if snapshot.error is not None and self.error is None:
            self.error = decode_error(snapshot.error)
        if not self._stopping:
            self.state = snapshot.state
        if snapshot.state in ("ready", "failed", "stopped"):
            self._ready.set()

    def _lose(self) -> None:
        """The core died: end everything waiting on it and report why."""
        process = self._process
        if process is not None:
            process.join(5.0)
        code = process.exitcode if process is not None else None
        why = f"exit code {code}" if code is None or code >= 0 else f"signal {signal.Signals(-code).name}"
        self.error = EngineStopped(f"the engine process ended unexpectedly ({why}); the server stops")
        log.error("%s", self.error)
        self.state = "failed"
        self._end_all(self.error)
        self._ready.set()
        if self.on_lost is not None:
            self.on_lost()

    def _end_all(self, error: MlxrError) -> None:
        handles, self._handles = self._handles, {}
        outbox = Outbox()  # on whichever thread ends them: the reader's, or the one stopping
        with outbox.installed(), outbox.together():
            for handle in handles.values():
                handle._emit(Failed(error))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            _settle(future, error=error)


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Give ``future`` its result or error, unless it is done already (its waiter cancelled it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
