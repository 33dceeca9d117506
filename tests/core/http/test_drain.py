"""Graceful shutdown with an engine that no longer answers (a step stuck in a collective with a
rank that died): the drain still ends every request with a final error event."""

from __future__ import annotations

import asyncio
import types

from mlxr_core.engine.request import Delta, Failed, GenerationRequest, RequestHandle
from mlxr_core.errors import EngineStopped
from mlxr_core.http import server
from mlxr_core.http.context import InflightRequests


def test_a_drain_ends_requests_the_engine_never_ends(monkeypatch) -> None:
    monkeypatch.setattr(server, "CANCEL_GRACE_S", 0.2)

    async def run() -> tuple[list[object], list[object], bool]:
        loop = asyncio.get_running_loop()
        inflight = InflightRequests()
        handles = [RequestHandle(GenerationRequest(model="m", prompt_ids=[1, 2]), loop) for _ in range(2)]
        for handle in handles:
            inflight.add(handle)
        ended: list[list[object]] = [[], []]

        async def consume(i: int) -> None:
            async for event in handles[i].events():
                ended[i].append(event)
            inflight.discard(handles[i])

        consumers = [asyncio.create_task(consume(i)) for i in range(2)]
        handles[0]._emit(Delta(text="x", token_ids=(5,)))  # one token out before the engine hangs
        ctx = types.SimpleNamespace(inflight=inflight)
        await server.drain(ctx, 0.1)  # type: ignore[arg-type]
        await asyncio.gather(*consumers)
        return ended[0], ended[1], all(handle.cancelled for handle in handles)

    first, second, cancelled = asyncio.run(run())
    assert cancelled  # the engine was asked first
    assert isinstance(first[0], Delta) and len(first) == 2
    for events in (first, second):
        assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineStopped)
        assert "shutting down" in str(events[-1].error)
