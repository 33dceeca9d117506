"""A chat template render's time: its deadline, and the server's way to stop every render at once.

A render runs inside :func:`render_budget`; the sandbox (:mod:`mlxr_core.model.template_sandbox`)
calls :func:`check_budget` on every loop step, call, filter, test and item a filter takes, which
raises :class:`RenderStopped` once the deadline has passed or :func:`interrupt_renders` was called
since the render began. Kept apart from the sandbox so a server can interrupt renders without
importing Jinja.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any


class RenderStopped(Exception):
    """Raised inside a render that ran out of time (``"deadline"``) or was interrupted."""


class Budget:
    """One render's deadline, and the :func:`interrupt_renders` count it started under."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.epoch = _interrupts
        #: Characters the render's ``{{ }}`` have written so far, its blocks' and macros' included.
        self.written = 0

    def check(self) -> None:
        if self.epoch != _interrupts:
            raise RenderStopped("interrupted")
        if time.monotonic() > self.deadline:
            raise RenderStopped("deadline")


_budget: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("mlxr_render", default=None)
_interrupts = 0
_listeners: list[Callable[[], None]] = []


@contextmanager
def render_budget(seconds: float) -> Iterator[None]:
    """Run the block (compiling and rendering one template) within ``seconds``."""
    token = _budget.set(Budget(seconds))
    try:
        yield
    finally:
        _budget.reset(token)


def interrupt_renders() -> None:
    """Stop every render in progress (each raises :class:`RenderStopped` at its next operation) and
    call the :func:`on_interrupt` listeners; renders begun later run."""
    global _interrupts
    _interrupts += 1
    for listener in list(_listeners):
        listener()


def on_interrupt(listener: Callable[[], None]) -> None:
    """Have :func:`interrupt_renders` call ``listener`` (on the interrupting thread)."""
    _listeners.append(listener)


def current_budget() -> Budget | None:
    """The budget of the render running on this thread, if any."""
    return _budget.get()


def check_budget() -> None:
    """Raise :class:`RenderStopped` when the current render is past its deadline or interrupted."""
    budget = _budget.get()
    if budget is not None:
        budget.check()


def checked_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every ``{% for %}`` iterates: ``iterable``, checking the render's budget each step."""
    for item in iterable:
        check_budget()
        yield item
