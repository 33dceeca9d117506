"""Every rank's engine deciding the same steps: rank 0 decides, one collective tells the others.

Under ``mx.distributed`` (:mod:`mlxr_core.distributed`) each rank runs the same scheduler over its
share of the weights, and every forward pass holds collectives all ranks must enter with the same
shapes: the ranks must run the same batches, step for step. The scheduler's decisions follow from
its inputs and the tokens sampled, so rank 0 sends the others each loop's inputs (the requests
submitted since the last loop, with their token ids, sampling parameters and seeds; the requests
cancelled since; whether to stop), and every rank applies them at the same point of the loop,
:meth:`Lockstep.exchange`. Rank 0 applies them there too: its scheduler sees a submitted request,
a cancellation or a shutdown only when the others do (:class:`MirroredHandle`), never in the
middle of a step. A request without a seed gets one from rank 0, so sampling draws the same tokens
everywhere; the logits are the same on every rank, since every all-reduce gives every rank the
same sum.

The inputs travel as a fixed-size frame through ``mx.distributed.all_sum`` (rank 0 adds its bytes,
the others zeros); inputs past one frame (long prompts, images) follow in a second all_sum of the
size the first announces. No socket of mlxr's own: the backend's connections carry everything.

A rank that exits closes its connections, and the next collective on the others raises; one that
hangs leaves them waiting in a collective, which :class:`Lockstep`'s watchdog bounds
(``distributed.step_timeout_s``). Either way the group cannot go on: rank 0 ends its requests with
:class:`~mlxr_core.errors.RankLost` (a 503 in each API's error shape), and the process exits with
status :data:`EXIT_RANK_LOST` after a grace period for those errors to reach the clients.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from mlxr_core.engine.jobs import EngineJob, refuse_jobs
from mlxr_core.engine.request import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Outbox,
    RequestHandle,
    Tokens,
)
from mlxr_core.errors import MlxrError, RankLost

if TYPE_CHECKING:
    from mlxr_core.distributed import World

log = logging.getLogger(__name__)

#: Bytes of the frame every loop exchanges (an idle loop's inputs are a few dozen).
FRAME_BYTES = 4096
#: The frame's header: a tag, the payload's length and its CRC-32.
HEADER = struct.Struct("<4sQI")
TAG = b"mlxr"
#: Seconds rank 0 waits for a request while every rank is idle (a request ends the wait at
#: once): idle ranks exchange a few times a second, as a heartbeat.
IDLE_WAIT_S = 0.25
#: Seconds an exchange between idle ranks may take (it holds rank 0's wait for requests).
IDLE_EXCHANGE_S = 5.0
#: Exit status of a rank whose group lost a member.
EXIT_RANK_LOST = 3
#: Seconds between the requests' errors and the exit, for the errors to be written to clients.
EXIT_GRACE_S = 2.0
#: Seconds between two gatherings of every rank's counters (:meth:`Lockstep.rank_stats`).
RANK_STATS_PERIOD_S = 1.0
#: One rank's counters as :meth:`Lockstep._gather` sends them: MLX's active, peak and cache
#: bytes, exchanges run and the seconds their collectives took.
RANK_STATS = struct.Struct("<QQQQd")


@attrs.frozen
class StepInputs:
    """What rank 0's scheduler takes in at one loop, as every rank applies it."""

    #: Requests submitted since the last loop, by their id across the ranks.
    requests: tuple[tuple[int, GenerationRequest], ...] = ()
    #: Ids of running or waiting requests whose client cancelled them.
    cancelled: tuple[int, ...] = ()
    stop: bool = False
    abort: bool = False
    #: Every rank sends its counters to every other at this exchange (:meth:`Lockstep.rank_stats`).
    gather: bool = False
    #: Jobs (embeddings, scoring) queued since the last loop: id, work, description, model.
    jobs: tuple[tuple[int, Callable[..., Any], str, str | None], ...] = ()
    #: Ids of jobs whose caller cancelled them.
    cancelled_jobs: tuple[int, ...] = ()


class MirroredHandle(RequestHandle):
    """The handle a scheduler under lockstep holds: on rank 0 it forwards events to the caller's
    handle; on the other ranks it drops them. It is cancelled only at an exchange."""

    def __init__(self, request: GenerationRequest, caller: RequestHandle | None, on_end: Callable[[], None]):
        super().__init__(request)
        self.caller = caller
        self._on_end = on_end

    def _emit(self, event: Event | Tokens) -> None:
        if self.caller is not None:
            self.caller._emit(event)
        if isinstance(event, (Finished, Failed)):
            self._on_end()


class Lockstep:
    """One rank's side of the exchange (see the module). The scheduler reads :attr:`requests`,
    :attr:`stop` and :attr:`abort` instead of the engine's, and calls :meth:`exchange` once per
    loop, on the engine thread."""

    def __init__(
        self,
        world: World,
        submitted: queue.Queue[RequestHandle | None],
        stop: threading.Event,
        abort: threading.Event,
        *,
        jobs: queue.Queue[EngineJob] | None = None,
        exit_on_loss: bool = True,
    ):
        self.world = world
        #: The engine thread's events; the scheduler gives it its own (:attr:`Scheduler.outbox`).
        self.outbox = Outbox()
        #: The jobs every rank runs, as the scheduler reads them (:attr:`Scheduler.jobs`).
        self.jobs: queue.Queue[EngineJob] = queue.Queue()
        self._submitted_jobs: queue.Queue[EngineJob] = jobs if jobs is not None else queue.Queue()
        #: Job id -> (the job every rank runs, the caller's job on rank 0 or None).
        self._live_jobs: dict[int, tuple[EngineJob, EngineJob | None]] = {}
        self.requests: queue.Queue[RequestHandle | None] = queue.Queue()
        self.stop = threading.Event()
        self.abort = threading.Event()
        self._submitted, self._engine_stop, self._engine_abort = submitted, stop, abort
        self._live: dict[int, MirroredHandle] = {}
        self._live_lock = threading.Lock()
        self._next_id = 0
        self._exit_on_loss = exit_on_loss
        self._lost = threading.Event()
        self._closed = threading.Event()
        #: ``time.monotonic()`` of the last exchange that completed (the watchdog's clock).
        self.progress = time.monotonic()
        #: Seconds the period from :attr:`progress` may last: a step's, or an idle exchange's.
        self._limit = (world.step_timeout_s, "an engine step")
        #: Seconds the collectives of the exchanges took, and how many ran (the bench reads them).
        self.exchange_seconds = 0.0
        self.exchanges = 0
        #: Each rank's counters as last gathered (see :meth:`rank_stats`), and when.
        self._rank_stats: list[dict[str, float]] = []
        self._gathered_at = 0.0
        self._watchdog = threading.Thread(target=self._watch, name="mlxr-lockstep-watchdog", daemon=True)

    # -- the exchange (engine thread) ------------------------------------------------------

    def exchange(self, *, block: bool) -> None:
        """Rank 0: take the inputs that arrived (waiting up to :data:`IDLE_WAIT_S` for one with ``block``) and
        send them; every rank: apply them. Raises nothing on a lost peer: it ends the process."""
        payload = pickle.dumps(self._collect(block)) if self.world.leader else b""
        if block:  # every rank is idle: the exchange takes rank 0's wait for requests, not a step
            idle = min(IDLE_EXCHANGE_S, self.world.step_timeout_s)
            self.progress, self._limit = time.monotonic(), (idle, "an exchange between idle ranks")
        started = time.perf_counter()
        try:
            received = self._broadcast(payload)
            # Rank 0's own bytes, as the others read them: pickle between ranks of one deployment,
            # which run the same code and trust each other as their backend does.
            inputs: StepInputs = pickle.loads(received)
            if inputs.gather:
                self._gather()
        except RuntimeError as exc:  # the backend's word for a peer that closed its connections
            self.lose(f"a collective with the other ranks failed: {exc}")
            return
        self.exchange_seconds += time.perf_counter() - started
        self.exchanges += 1
        self.progress, self._limit = time.monotonic(), (self.world.step_timeout_s, "an engine step")
        if not self._watchdog.is_alive() and not self._closed.is_set():
            # From the first exchange on: ranks finish loading seconds apart, and the first one
            # waits for the others here.
            self._watchdog.start()
        self._apply(inputs)

    def _collect(self, block: bool) -> StepInputs:
        handles: list[RequestHandle] = []
        try:
            while True:
                handle = self._submitted.get(block=block, timeout=IDLE_WAIT_S)
                block = False
                if handle is not None:
                    handles.append(handle)
        except queue.Empty:
            pass
        requests = []
        for handle in handles:
            request = handle.request
            if request.params.seed is None:  # the same draws on every rank
                seed = int.from_bytes(os.urandom(4), "little")
                request = attrs.evolve(request, params=attrs.evolve(request.params, seed=seed))
            rid = self._next_id
            self._next_id += 1
            self._track(rid, request, handle)
            requests.append((rid, request))
        jobs = []
        while True:
            try:
                job = self._submitted_jobs.get_nowait()
            except queue.Empty:
                break
            try:
                pickle.dumps(job.work)
            except Exception as exc:  # a closure, say: a plugin's job the other ranks cannot run
                job.refuse(MlxrError(f"{job.what} cannot be sent to the other ranks ({type(exc).__name__}: {exc})"))
                continue
            jid = self._next_id
            self._next_id += 1
            self._track_job(jid, job.work, job.what, job.model, job)
            jobs.append((jid, job.work, job.what, job.model))
        with self._live_lock:
            cancelled = tuple(
                rid for rid, mirror in self._live.items()
                if mirror.caller is not None and mirror.caller.cancelled and not mirror.cancelled
            )  # fmt: skip
            cancelled_jobs = tuple(
                jid for jid, (mirror, caller) in self._live_jobs.items()
                if caller is not None and caller.cancelled and not mirror.cancelled
            )  # fmt: skip
        gather = time.monotonic() - self._gathered_at >= RANK_STATS_PERIOD_S
        if gather:
            self._gathered_at = time.monotonic()
        return StepInputs(
            tuple(requests), cancelled, self._engine_stop.is_set(), self._engine_abort.is_set(), gather,
            tuple(jobs), cancelled_jobs,
        )  # fmt: skip

    def _apply(self, inputs: StepInputs) -> None:
        for rid, request in inputs.requests:
            with self._live_lock:
                mirror = self._live.get(rid)
            self.requests.put(mirror if mirror is not None else self._track(rid, request, None))
        for jid, work, what, model in inputs.jobs:
            with self._live_lock:
                tracked = self._live_jobs.get(jid)
            self.jobs.put(tracked[0] if tracked is not None else self._track_job(jid, work, what, model, None))
        with self._live_lock:
            for rid in inputs.cancelled:
                if rid in self._live:
                    self._live[rid].cancel()
            for jid in inputs.cancelled_jobs:
                if jid in self._live_jobs:
                    self._live_jobs[jid][0].cancel()
        if inputs.stop:
            self.stop.set()
        if inputs.abort:
            self.abort.set()

    def _track(self, rid: int, request: GenerationRequest, caller: RequestHandle | None) -> MirroredHandle:
        def forget() -> None:
            with self._live_lock:
                self._live.pop(rid, None)

        mirror = MirroredHandle(request, caller, forget)
        with self._live_lock:
            self._live[rid] = mirror
        return mirror

    def _track_job(
        self, jid: int, work: Callable[..., Any], what: str, model: str | None, caller: EngineJob | None
    ) -> EngineJob:
        """The job every rank runs alike (cancelled only at an exchange); on rank 0 its outcome
        goes to the caller's job."""
        mirror = EngineJob(work, what=what, model=model)

        def ended(future: Future[Any]) -> None:
            with self._live_lock:
                self._live_jobs.pop(jid, None)
            if caller is None or caller.future.done():
                return
            if future.cancelled():
                caller.future.set_exception(MlxrError(f"{what} was cancelled"))
            elif future.exception() is not None:
                caller.future.set_exception(future.exception())  # type: ignore[arg-type]
            else:
                caller.future.set_result(future.result())

        with self._live_lock:
            self._live_jobs[jid] = (mirror, caller)
        mirror.future.add_done_callback(ended)
        return mirror

    def _broadcast(self, payload: bytes) -> bytes:
        """Rank 0's ``payload`` on every rank: a frame holding a header (a tag, the length and the
        CRC-32 of the payload) and the payload's start, then the rest if any. A peer that is gone
        may leave zeros instead of an error in the sum: the header tells (RuntimeError)."""
        message = HEADER.pack(TAG, len(payload), zlib.crc32(payload)) + payload
        first = self._all_sum(message[:FRAME_BYTES], FRAME_BYTES)
        tag, length, crc = HEADER.unpack_from(first)
        rest = HEADER.size + length - FRAME_BYTES
        received = first[HEADER.size : HEADER.size + length]
        if tag == TAG and rest > 0:
            padded = -(-rest // FRAME_BYTES) * FRAME_BYTES
            received += self._all_sum(message[FRAME_BYTES:], padded)[:rest]
        if tag != TAG or zlib.crc32(received) != crc:
            raise RuntimeError("the step's inputs from rank 0 arrived damaged (a peer left mid-collective)")
        return received

    def _all_sum(self, data: bytes, size: int) -> bytes:
        import mlx.core as mx

        frame = np.zeros(size, dtype=np.uint8)
        if self.world.leader:
            frame[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        summed = mx.distributed.all_sum(mx.array(frame), group=self.world.group)
        return bytes(np.array(summed))

    def _gather(self) -> None:
        """Every rank's counters on every rank: one ``all_gather`` of a few bytes each, at the
        exchanges rank 0 marks (every :data:`RANK_STATS_PERIOD_S`), so /metrics on rank 0 shows
        every rank's memory and time in collectives without a connection of its own to them."""
        import mlx.core as mx

        mine = RANK_STATS.pack(
            int(mx.get_active_memory()), int(mx.get_peak_memory()), int(mx.get_cache_memory()),
            self.exchanges, self.exchange_seconds,
        )  # fmt: skip
        frame = mx.array(np.frombuffer(mine, dtype=np.uint8))
        gathered = bytes(np.array(mx.distributed.all_gather(frame, group=self.world.group)))
        stats = []
        for rank in range(self.world.size):
            active, peak, cache, exchanges, seconds = RANK_STATS.unpack_from(gathered, rank * RANK_STATS.size)
            stats.append({"active_bytes": active, "peak_bytes": peak, "cache_bytes": cache,
                          "exchanges": exchanges, "exchange_seconds": seconds})  # fmt: skip
        self._rank_stats = stats

    def rank_stats(self) -> list[dict[str, float]]:
        """Each rank's MLX memory (``active_bytes``, ``peak_bytes``, ``cache_bytes``), and the
        ``exchanges`` it ran and the ``exchange_seconds`` their collectives took, as last gathered
        (at most :data:`RANK_STATS_PERIOD_S` old while the ranks run; empty before the first)."""
        return self._rank_stats

    def probe(self, failure: BaseException) -> None:
        """After a step failed with ``failure``: one small collective tells a lost peer (it fails
        or hangs: :meth:`lose`) from an error every rank met alike (it returns)."""
        import mlx.core as mx

        try:
            mx.eval(mx.distributed.all_sum(mx.zeros(1), group=self.world.group))
        except RuntimeError as exc:
            self.lose(f"a step failed ({type(failure).__name__}: {failure}) and the ranks no longer answer: {exc}")

    def close(self) -> None:
        """The loop has ended (on every rank at the same exchange): the watchdog stops."""
        self._closed.set()

    # -- a lost peer (engine thread or watchdog) ---------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(min(0.5, self.world.step_timeout_s / 4)):
            (limit, what), stalled = self._limit, time.monotonic() - self.progress
            if stalled > limit:
                self.lose(f"{what} did not complete in {limit:g} s (distributed.step_timeout_s "
                          f"{self.world.step_timeout_s:g}): a rank hangs or is unreachable")  # fmt: skip
                return

    def lose(self, why: str) -> None:
        """The group cannot go on: end every request of this rank with :class:`RankLost`, then
        (unless built with ``exit_on_loss=False``) exit the process after :data:`EXIT_GRACE_S`."""
        if self._lost.is_set():
            return
        self._lost.set()
        self._closed.set()
        error = RankLost(
            f"rank {self.world.rank} of {self.world.size} lost its peers ({why}); this server is going "
            "down: retry once it is back"
        )
        log.error("%s", error)
        with self._live_lock:
            mirrors = list(self._live.values())
            self._live.clear()
        for mirror in mirrors:
            if mirror.caller is not None:
                mirror.caller._emit(Failed(error))
        while True:  # requests submitted and not yet sent to the others
            try:
                handle = self._submitted.get_nowait()
            except queue.Empty:
                break
            if handle is not None:
                handle._emit(Failed(error))
        with self._live_lock:
            jobs = list(self._live_jobs.values())
            self._live_jobs.clear()
        for _, caller in jobs:
            if caller is not None and not caller.future.done():
                caller.future.set_exception(error)
        refuse_jobs(self._submitted_jobs, error)
        self.outbox.release()  # on the engine thread, the errors it held reach their clients first
        if self._exit_on_loss:
            time.sleep(EXIT_GRACE_S)
            logging.shutdown()
            os._exit(EXIT_RANK_LOST)
        self.abort.set()
