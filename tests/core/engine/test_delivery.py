"""How events cross from the engine thread to their consumers: a step's events handed to an event
loop in one call, and text worked out on the consumer's side for requests without stop strings."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    Outbox,
    RequestHandle,
    SamplingParams,
    Tokens,
    Usage,
)
from mlxr_core.plugins import load_plugins


class CountingLoop:
    """Stands for an event loop: records each ``call_soon_threadsafe`` and runs it at once."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.calls += 1
        callback(*args)


def test_a_steps_events_reach_a_loop_in_one_call_in_order() -> None:
    loop = CountingLoop()
    handles = [RequestHandle(GenerationRequest("m", [1]), loop=loop) for _ in range(3)]  # type: ignore[arg-type]
    outbox = Outbox()
    with outbox.installed():
        with outbox.together():
            for index, handle in enumerate(handles):
                handle._emit(Delta("a", (index,)))
                handle._emit(Delta("b", (index,)))
            with outbox.together():  # nested: delivered with the outer one
                handles[0]._emit(Finished("length", Usage(1, 2)))
            assert loop.calls == 0
        assert loop.calls == 1
    texts = []
    while not handles[0]._async_queue.empty():  # type: ignore[union-attr]
        texts.append(handles[0]._async_queue.get_nowait())  # type: ignore[union-attr]
    assert [type(e).__name__ for e in texts] == ["Delta", "Delta", "Finished"]
    assert [e.text for e in texts if isinstance(e, Delta)] == ["a", "b"]
    handles[1]._emit(Delta("c", (1,)))  # outside: at once
    assert loop.calls == 2


def test_held_events_wait_for_deliver_or_release_across_blocks() -> None:
    loop = CountingLoop()
    handle = RequestHandle(GenerationRequest("m", [1]), loop=loop)  # type: ignore[arg-type]
    outbox = Outbox()
    with outbox.installed():
        outbox.hold()
        try:
            with outbox.together():  # inside a hold, a block delivers nothing itself
                handle._emit(Delta("a", (1,)))
            handle._emit(Delta("b", (2,)))
            assert loop.calls == 0
            outbox.deliver()
            assert loop.calls == 1
            outbox.deliver()  # nothing held: no call
            assert loop.calls == 1
            handle._emit(Delta("c", (3,)))
            assert loop.calls == 1
        finally:
            outbox.release()
        assert loop.calls == 2
        handle._emit(Delta("d", (4,)))  # no longer held: at once
        assert loop.calls == 3
    texts = []
    while not handle._async_queue.empty():  # type: ignore[union-attr]
        texts.append(handle._async_queue.get_nowait().text)  # type: ignore[union-attr]
    assert texts == ["a", "b", "c", "d"]


def test_a_closed_loop_cancels_the_requests_it_held() -> None:
    class Closed:
        def call_soon_threadsafe(self, *args: Any) -> None:
            raise RuntimeError("Event loop is closed")

    handle = RequestHandle(GenerationRequest("m", [1]), loop=Closed())  # type: ignore[arg-type]
    outbox = Outbox()
    with outbox.installed(), outbox.together():
        handle._emit(Delta("a", (1,)))
    assert handle.cancelled


def test_tokens_become_deltas_on_the_consumer_and_a_failure_ends_the_request() -> None:
    class Broken:
        def add(self, token: int) -> str:
            raise ValueError("bad id")

    handle = RequestHandle(GenerationRequest("m", [1]))
    handle._emit(Tokens((5,), (), Broken()))
    (event,) = list(handle)
    assert isinstance(event, Failed) and "detokenizing failed" in str(event.error)
    assert handle.cancelled


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    engine = Engine(Config(models=[ModelConfig(name="tiny", path=str(path))], engine=EngineConfig()), load_plugins())
    engine.start()
    yield engine
    engine.stop()


def test_text_detokenized_on_the_consumer_equals_the_engines(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without stop strings the consumer's thread detokenizes; with one (that never matches) the
    engine does: the same tokens give the same text, and the detokenizer never ran on the engine
    thread for the first."""
    from mlxr_core.engine import detokenizer

    threads: set[str] = set()
    add = detokenizer.StreamingDetokenizer.add

    def spy(self: Any, token: int) -> str:
        threads.add(threading.current_thread().name)
        return add(self, token)

    def run(stop: list[str]) -> tuple[str, list[int]]:
        params = SamplingParams(max_tokens=24, temperature=0.0, stop=stop, extra={"ignore_eos": True})

        async def consume() -> tuple[str, list[int]]:
            handle = engine.submit(GenerationRequest("tiny", [1, 5, 9, 13], params), loop=asyncio.get_running_loop())
            text, ids = "", list[int]()
            async for event in handle.events():
                if isinstance(event, Delta):
                    text += event.text
                    ids.extend(event.token_ids)
                else:
                    assert isinstance(event, Finished)
            return text, ids

        return asyncio.run(consume())

    monkeypatch.setattr(detokenizer.StreamingDetokenizer, "add", spy)
    on_consumer = run([])
    consumer_threads = set(threads)
    on_engine = run(["\x00never"])
    assert on_consumer == on_engine
    assert len(on_consumer[1]) == 24
    assert consumer_threads == {threading.current_thread().name}


@pytest.mark.parametrize("stateful", [False, True])
def test_a_decode_steps_tokens_are_handed_over_once_the_next_step_is_queued(
    engine: Any, monkeypatch: pytest.MonkeyPatch, stateful: bool
) -> None:
    """The engine holds a step's tokens until the next step's graph is queued on the device, so the
    consumer's loop takes them while the engine waits for the device; the last ones when the batch
    ends. A penalty (a sampler that must see each token before the next step is built) reads the
    tokens back first: the held ones are handed over before that wait. Every token arrives, in
    order."""
    from mlxr_core.engine import batch

    order: list[str] = []
    async_eval = batch.mx.async_eval

    def queued(*arrays: Any) -> None:
        async_eval(*arrays)
        order.append("queued")

    done = threading.Event()
    received: list[int] = []

    class RecordingLoop:
        def call_soon_threadsafe(self, callback: Any, items: Any) -> None:
            order.append("handed")
            for _, event in items:
                if isinstance(event, Tokens | Delta):
                    received.extend(event.token_ids)
                else:
                    done.set()

    accept = batch.Sequence.accept

    def accepted(self: Any, *args: Any) -> Any:
        order.append("accepted")
        return accept(self, *args)

    monkeypatch.setattr(batch.mx, "async_eval", queued)
    monkeypatch.setattr(batch.Sequence, "accept", accepted)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, presence_penalty=0.5 if stateful else 0.0, extra={"ignore_eos": True}
    )
    engine.submit(GenerationRequest("tiny", [1, 5, 9, 13], params), loop=RecordingLoop())
    assert done.wait(60)
    assert len(received) == 12
    # Every hand-over of tokens but the last (the batch ended) comes right after a step is queued,
    # before that step's tokens are read back and accepted.
    handed = [i for i, what in enumerate(order) if what == "handed"]
    assert len(handed) >= 10
    if stateful:  # before the read-back, which comes before the step is built and queued
        assert all(order[i + 1] == "queued" for i in handed[:-1]), " ".join(order)
    else:
        assert all(order[i - 1] == "queued" for i in handed[:-1]), " ".join(order)
    # A consumer reading from the engine thread directly is never held back: the same tokens.
    alone = engine.submit(GenerationRequest("tiny", [1, 5, 9, 13], params))
    assert received == [token for event in alone if isinstance(event, Delta) for token in event.token_ids]
