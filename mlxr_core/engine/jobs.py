"""Work other than generation that must run on the engine thread (embeddings ...).

A caller wraps a function of the loaded models in an :class:`EngineJob` and waits on its future
(``job.future.result()``, or ``asyncio.wrap_future(job.future)``); the scheduler runs queued jobs
between batch steps, so MLX only ever runs on the engine thread. A long job is a generator that
yields between its parts (an embedding's forward passes): the scheduler runs one part of each job
between batch steps, so generation goes on meanwhile, and a job whose caller has left
(:meth:`EngineJob.cancel`) stops at its next part. A part that yields :data:`WAITING` waits for
another thread (an adapter's file being read), which wakes the engine when it is done: while
every running job waits so and no request runs, the engine sleeps instead of running them again.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import MlxrError

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

log = logging.getLogger(__name__)

#: What a job's part yields when the job has nothing to do until another thread wakes the engine.
WAITING = "waiting"


class EngineJob:
    """``work(models)`` to run on the engine thread; its result or error lands in ``future``.
    ``work`` may return a generator, run a part (up to its next ``yield``) at a time; the
    generator's return value is the result."""

    def __init__(
        self, work: Callable[[Mapping[str, LoadedModel]], Any], what: str = "job", model: str | None = None
    ):
        self.work = work
        self.what = what
        #: The served model the job runs on; it is loaded first if it is not.
        self.model = model
        self.future: Future[Any] = Future()
        self.cancelled = False
        #: Its last part yielded :data:`WAITING`.
        self.waiting = False
        self._parts: Generator[Any, None, Any] | None = None

    def cancel(self) -> None:
        """From any thread: the caller no longer wants the result; the job stops before its
        next part (or is never started)."""
        self.cancelled = True
        self.future.cancel()

    def run(self, models: Mapping[str, LoadedModel]) -> None:
        """Run every part now."""
        while not self.step(models):
            pass

    def step(self, models: Mapping[str, LoadedModel]) -> bool:
        """Run the job's next part; True once it has ended. Errors reach the caller as MlxrError."""
        try:
            if self._parts is None:
                if not self.future.set_running_or_notify_cancel():
                    return True
                result = self.work(models)
                if not isinstance(result, Generator):
                    self.future.set_result(result)
                    return True
                self._parts = result
            if self.cancelled:
                self._parts.close()
                self.future.set_exception(MlxrError(f"{self.what} was cancelled"))
                return True
            self.waiting = next(self._parts) == WAITING
            return False
        except StopIteration as stop:
            self.future.set_result(stop.value)
        except MlxrError as exc:
            self.future.set_exception(exc)
        except Exception as exc:  # a bug or an MLX error: the caller gets it, the engine goes on
            log.exception("%s failed", self.what)
            self.future.set_exception(MlxrError(f"{self.what} failed: {type(exc).__name__}: {exc}"))
        return True

    def refuse(self, error: MlxrError) -> None:
        """End the job with ``error``, unrun or between its parts (shutdown)."""
        if self._parts is not None:
            self._parts.close()
            if not self.future.done():
                self.future.set_exception(error)
        elif self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


def run_jobs(
    jobs: queue.Queue[EngineJob], models: Mapping[str, LoadedModel], running: list[EngineJob]
) -> None:
    """Take every job queued now into ``running``, then run one part of each; the jobs that end
    leave ``running``."""
    while True:
        try:
            running.append(jobs.get_nowait())
        except queue.Empty:
            break
    running[:] = [job for job in running if not job.step(models)]


def refuse_jobs(jobs: queue.Queue[EngineJob], error: MlxrError) -> None:
    """End every queued job with ``error``."""
    while True:
        try:
            jobs.get_nowait().refuse(error)
        except queue.Empty:
            return
