"""Progress of long work: rich on a terminal, quiet (or a few log lines) everywhere else.

A command a person waits on (``mlxr generate``, ``bench``, ``info``, ``convert``) calls
:func:`enable` first. Then each :func:`step` shows a spinner, or a bar when it knows its total, on
stderr while it runs: every step in one live display, so steps nest and may run in the engine's
thread while the command's thread waits. Nothing is drawn when stderr is not a terminal,
``MLXR_PROGRESS=0`` is set, or nobody called :func:`enable` (``mlxr serve``, which logs, and
library use): piped output stays exactly what it was. :func:`track` logs its quarters instead
when no bar shows, so a long load still leaves a trace in a log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

log = logging.getLogger("mlxr_core.model.loader")

#: Loads shorter than this many items are not worth a bar or log lines.
MIN_ITEMS = 32

_lock = threading.Lock()


class Advance(Protocol):
    """Moves a step's bar on by ``n``."""

    def __call__(self, n: int = 1) -> None: ...


class _Display:
    """The one rich ``Progress`` of this process while any step runs; None when not shown."""

    console: Any = None  # a rich Console on a terminal, once enabled
    progress: Any = None
    running = 0


_display = _Display()


def enable(console: Any = None) -> bool:
    """Show progress from now on if stderr is a terminal (or on ``console``, a rich Console) and
    ``MLXR_PROGRESS`` is not ``0``; return whether it will be shown."""
    from rich.console import Console

    if os.environ.get("MLXR_PROGRESS", "").strip().lower() in ("0", "off", "false", "no"):
        return False
    console = console or Console(stderr=True)
    if not console.is_terminal or console.is_dumb_terminal:
        return False
    _display.console = console
    return True


def disable() -> None:
    """Stop showing progress (a running display ends with its last step)."""
    _display.console = None


def enabled() -> bool:
    """Whether :func:`step` draws anything."""
    return _display.console is not None


@contextlib.contextmanager
def step(description: str, total: int | None = None) -> Iterator[Advance]:
    """Show ``description`` while the block runs: a spinner, or a bar out of ``total``; yields
    ``advance(n=1)`` for the bar. A no-op unless :func:`enable` said progress is shown."""
    if _display.console is None:
        yield _no_advance
        return
    progress = _start()
    task = progress.add_task(description, total=total)
    progress.refresh()  # visible at once, not at the next tick

    def advance(n: int = 1) -> None:
        progress.advance(task, n)

    try:
        yield advance
    finally:
        progress.remove_task(task)
        _stop()


def _no_advance(n: int = 1) -> None:
    return None


def _bar_when_counted() -> Any:
    """A column with a bar and ``done/total`` for a step that has a total, nothing for a spinner."""
    from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, Task
    from rich.table import Table

    class BarWhenCounted(ProgressColumn):
        def __init__(self) -> None:
            super().__init__()
            self.bar, self.count = BarColumn(), MofNCompleteColumn()

        def render(self, task: Task) -> Any:
            grid = Table.grid(padding=(0, 1))
            if task.total is not None:
                grid.add_row(self.bar.render(task), self.count.render(task))
            return grid

    return BarWhenCounted()


def _start() -> Any:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with _lock:
        if _display.progress is None:
            _display.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                _bar_when_counted(),
                TimeElapsedColumn(),
                console=_display.console,
                transient=True,  # gone when done: the command's own output follows cleanly
                redirect_stdout=False,
                redirect_stderr=False,
            )
            _display.progress.start()
        _display.running += 1
        return _display.progress


def _stop() -> None:
    with _lock:
        _display.running -= 1
        if _display.running == 0 and _display.progress is not None:
            _display.progress.stop()
            _display.progress = None


def track(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """Yield ``items``, showing progress: a bar when progress is shown (:func:`enable`), else an
    INFO line at each quarter (log files and CI output stay readable)."""
    if total < MIN_ITEMS:
        yield from items
        return
    if enabled():
        with step(description, total) as advance:
            for item in items:
                yield item
                advance()
        return
    marks = {total * quarter // 4: quarter * 25 for quarter in (1, 2, 3)}
    for done, item in enumerate(items, start=1):
        yield item
        if done in marks:
            log.info("%s: %d%% (%d/%d)", description, marks[done], done, total)

