"""Background responses (``background: true``): the response runs on after its request has been
answered, its stream events kept in memory so that ``GET /v1/responses/{id}`` can poll it, and
``GET /v1/responses/{id}?stream=true&starting_after=N`` replay the events after number ``N`` and
follow the rest; ``POST /v1/responses/{id}/cancel`` ends it (status ``cancelled``).

A run's events stay in memory while it runs and for the :data:`KEPT` most recent finished runs
(its response is in the store as well, whose ``GET`` answers it after that); a server restart
forgets runs (their stored ``in_progress`` state stays as it was).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import attrs

from mlxr_core.engine.request import RequestHandle
from mlxr_plugins.apis.openai import responses_schemas as r

#: Finished runs whose events stay in memory for a resumed stream: at most this many, and at most
#: :data:`KEPT_BYTES` of events together (the oldest finished runs go first; their responses stay
#: in the store).
KEPT = 256
KEPT_BYTES = 256 * 2**20


@attrs.define(eq=False)
class Run:
    """One background response: its (live) response, the numbered events told so far, and the
    engine request that produces them."""

    response: r.Response
    owner: str | None
    handle: RequestHandle
    events: list[tuple[int, bytes]] = attrs.field(factory=list)
    done: bool = False
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    #: Bytes of :attr:`events`.
    nbytes: int = 0

    def record(self, sequence: int, data: bytes) -> None:
        self.events.append((sequence, data))
        self.nbytes += len(data)
        self._notify()

    def _notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[bytes]:
        """The events numbered after ``starting_after``, those told so far and then the rest as
        they come, until the run ends (leaving early leaves the run alone)."""
        seen = 0
        while True:
            changed = self.changed
            while seen < len(self.events):
                sequence, data = self.events[seen]
                seen += 1
                if sequence > starting_after:
                    yield data
            if self.done:
                return
            await changed.wait()


class BackgroundRuns:
    """The server's background responses, by id."""

    def __init__(self) -> None:
        self._runs: OrderedDict[str, Run] = OrderedDict()

    def start(self, run: Run, events: AsyncIterator[Any]) -> None:
        """Drive ``events`` (the response's stream, recording into ``run`` as it goes) in a task
        of its own, so it runs on whatever its client does."""
        self._runs[run.response.id] = run
        run.task = asyncio.get_running_loop().create_task(self._drive(run, events))

    async def _drive(self, run: Run, events: AsyncIterator[Any]) -> None:
        try:
            async for _ in events:
                pass
        finally:
            run.done = True
            run._notify()
            finished = [key for key, kept in self._runs.items() if kept.done]
            held = sum(self._runs[key].nbytes for key in finished)
            for index, key in enumerate(finished):
                if len(finished) - index <= KEPT and held <= KEPT_BYTES:
                    break
                held -= self._runs.pop(key).nbytes

    def get(self, response_id: str, owner: str | None) -> Run | None:
        """The run of ``response_id`` for ``owner`` (another key's is not found)."""
        run = self._runs.get(response_id)
        return run if run is not None and run.owner == owner else None
