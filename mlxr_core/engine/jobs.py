"""Work other than generation that must run on the engine thread (embeddings ...).

A caller wraps a function of the loaded models in an :class:`EngineJob` and waits on its future
(``job.future.result()``, or ``asyncio.wrap_future(job.future)``); the scheduler runs queued jobs
between batch steps, so MLX only ever runs on the engine thread.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import MlxrError

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

log = logging.getLogger(__name__)


class EngineJob:
    """``work(models)`` to run once on the engine thread; its result or error lands in ``future``."""

    def __init__(self, work: Callable[[Mapping[str, LoadedModel]], Any], what: str = "job"):
        self.work = work
        self.what = what
        self.future: Future[Any] = Future()

    def run(self, models: Mapping[str, LoadedModel]) -> None:
        """Run (unless the caller cancelled meanwhile); errors reach the caller as MlxrError."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.work(models)
        except MlxrError as exc:
            self.future.set_exception(exc)
        except Exception as exc:  # a bug or an MLX error: the caller gets it, the engine goes on
            log.exception("%s failed", self.what)
            self.future.set_exception(MlxrError(f"{self.what} failed: {type(exc).__name__}: {exc}"))
        else:
            self.future.set_result(result)

    def refuse(self, error: MlxrError) -> None:
        """End the job unrun (shutdown)."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


def run_jobs(jobs: queue.Queue[EngineJob], models: Mapping[str, LoadedModel]) -> int:
    """Run every job queued now; returns how many ran."""
    count = 0
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return count
        job.run(models)
        count += 1


def refuse_jobs(jobs: queue.Queue[EngineJob], error: MlxrError) -> None:
    """End every queued job with ``error``."""
    while True:
        try:
            jobs.get_nowait().refuse(error)
        except queue.Empty:
            return
