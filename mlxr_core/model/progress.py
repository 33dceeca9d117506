"""Progress of a long load: a bar on a terminal, a few plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("mlxr_core.model.loader")

#: Loads shorter than this many items are not worth a bar or log lines.
MIN_ITEMS = 32


def track(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """Yield ``items``, showing progress: a rich bar when stderr is a terminal, else an INFO line
    at each quarter (log files and CI output stay readable)."""
    if total < MIN_ITEMS:
        yield from items
        return
    if sys.stderr.isatty():
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task(description, total=total)
            for item in items:
                yield item
                progress.advance(task)
        return
    marks = {total * quarter // 4: quarter * 25 for quarter in (1, 2, 3)}
    for done, item in enumerate(items, start=1):
        yield item
        if done in marks:
            log.info("%s: %d%% (%d/%d)", description, marks[done], done, total)
