"""A request's work before the engine sees it (templating, tokenizing) off the event loop, on daemon
threads that a shutdown abandons rather than awaits.

``anyio.to_thread.run_sync`` waits for its thread however long the work takes, and its threads are
not daemons, so the interpreter waits for them at exit too: one chat template rendering for minutes
held a stopping server for minutes, and the requests still waiting on it were cut by uvicorn with a
500. :func:`offload` runs the work on a daemon thread instead and lets the waiting request go as
soon as the server starts to stop (:func:`~mlxr_core.model.template_budget.interrupt_renders`,
which the drain calls): it ends with :class:`~mlxr_core.errors.EngineStopped`, a 503 in its API's
shape, while the thread finishes on its own (a render stops at its next operation).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from mlxr_core.errors import EngineStopped
from mlxr_core.model.template_budget import on_interrupt

T = TypeVar("T")

#: The requests waiting on a thread now, each by its future (on its own event loop).
_waiting: set[asyncio.Future[Any]] = set()


async def offload(work: Callable[[], T], *, limiter: anyio.CapacityLimiter | None = None) -> T:
    """``work()``, run on a daemon thread, with a token of ``limiter`` (anyio's default thread
    limiter when None) held until it returns, so offloaded work queues as ``to_thread`` work does.

    Returns what ``work`` returns and raises what it raises; raises :class:`EngineStopped` at once
    when the server starts to stop, leaving the thread to end on its own. A caller that is cancelled
    (its client left) likewise stops waiting without waiting for the thread.
    """
    limiter = limiter if limiter is not None else anyio.to_thread.current_default_thread_limiter()
    loop = asyncio.get_running_loop()
    borrower = object()
    await limiter.acquire_on_behalf_of(borrower)
    done: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = context.run(work)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_finish, limiter, borrower, done, result, error)

    try:
        threading.Thread(target=run, name="mlxr-offload", daemon=True).start()
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise
    _waiting.add(done)
    try:
        return await done
    finally:
        _waiting.discard(done)


def _finish(
    limiter: anyio.CapacityLimiter, borrower: object, done: asyncio.Future[Any], result: Any,
    error: BaseException | None,
) -> None:  # fmt: skip
    limiter.release_on_behalf_of(borrower)
    if done.done():  # abandoned at a shutdown, or its caller was cancelled
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _abandon_all() -> None:
    """Let every request waiting on a thread go with :class:`EngineStopped`."""
    for done in list(_waiting):
        with contextlib.suppress(RuntimeError):  # that request's event loop has closed
            done.get_loop().call_soon_threadsafe(_stop, done)


def _stop(done: asyncio.Future[Any]) -> None:
    if not done.done():
        done.set_exception(EngineStopped("the request was cancelled: the server is shutting down"))


on_interrupt(_abandon_all)
