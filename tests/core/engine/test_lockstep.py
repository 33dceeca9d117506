"""The ranks' lockstep (:mod:`mlxr_core.engine.lockstep`) in one process, on MLX's one-rank group.

An all_sum over one rank returns its input, so the exchange's framing, the mirrored handles, the
seeds, the latched cancellations and shutdown, the watchdog and a failing collective are all
exercised here without a second process; ``test_distributed_serving.py`` runs two.
"""

from __future__ import annotations

import queue
import threading
import time

import mlx.core as mx
import pytest

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.distributed import World
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.lockstep import FRAME_BYTES, Lockstep, MirroredHandle
from mlxr_core.engine.request import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    Usage,
)
from mlxr_core.errors import MlxrError, RankLost
from mlxr_core.plugins import load_plugins


def one_rank(step_timeout_s: float = 60.0) -> World:
    group = mx.distributed.init()
    assert group.size() == 1
    return World(group, 0, 1, "ring", 1, 1, step_timeout_s)


def make_lockstep(step_timeout_s: float = 60.0) -> tuple[Lockstep, queue.Queue[RequestHandle | None], threading.Event]:
    submitted: queue.Queue[RequestHandle | None] = queue.Queue()
    stop = threading.Event()
    lockstep = Lockstep(one_rank(step_timeout_s), submitted, stop, threading.Event(), exit_on_loss=False)
    return lockstep, submitted, stop


def taken(lockstep: Lockstep) -> list[MirroredHandle]:
    out = []
    while not lockstep.requests.empty():
        handle = lockstep.requests.get_nowait()
        assert isinstance(handle, MirroredHandle)
        out.append(handle)
    return out


def test_requests_cross_in_one_or_two_collectives_with_a_seed_each() -> None:
    lockstep, submitted, _ = make_lockstep()
    long_prompt = list(range(5000))  # several frames' worth of pickled ids
    seeded = RequestHandle(GenerationRequest("m", long_prompt, SamplingParams(seed=7, temperature=0.5)))
    unseeded = RequestHandle(GenerationRequest("m", [1, 2], SamplingParams(temperature=0.9)))
    submitted.put(seeded)
    submitted.put(None)  # a wake-up, not a request
    submitted.put(unseeded)
    lockstep.exchange(block=False)
    first, second = taken(lockstep)
    assert first.request.prompt_ids == long_prompt and first.request.params.seed == 7
    assert len(long_prompt) * 2 > FRAME_BYTES
    assert second.request.params.seed is not None and unseeded.request.params.seed is None
    assert first.caller is seeded and lockstep.exchanges == 1
    lockstep.exchange(block=False)
    assert taken(lockstep) == []
    lockstep.close()


def test_events_reach_the_caller_and_cancellation_lands_only_at_an_exchange() -> None:
    lockstep, submitted, stop = make_lockstep()
    caller = RequestHandle(GenerationRequest("m", [1, 2, 3]))
    submitted.put(caller)
    lockstep.exchange(block=False)
    (mirror,) = taken(lockstep)
    mirror._emit(Delta("hi", (4,)))
    caller.cancel()
    assert not mirror.cancelled  # the scheduler sees it when every rank does
    lockstep.exchange(block=False)
    assert mirror.cancelled
    mirror._emit(Finished("cancelled", usage=Usage(3, 1)))
    events = []
    while not caller._sync_queue.empty():
        events.append(caller._sync_queue.get_nowait())
    assert [type(event) for event in events] == [Delta, Finished]
    stop.set()
    assert not lockstep.stop.is_set()
    lockstep.exchange(block=False)
    assert lockstep.stop.is_set() and not lockstep.abort.is_set()
    lockstep.close()


def test_a_failed_collective_ends_every_request_with_rank_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    lockstep, submitted, _ = make_lockstep()
    running = RequestHandle(GenerationRequest("m", [1]))
    submitted.put(running)
    lockstep.exchange(block=False)
    queued = RequestHandle(GenerationRequest("m", [2]))
    submitted.put(queued)

    def lost(data: bytes, size: int) -> bytes:
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(lockstep, "_all_sum", lost)
    lockstep.exchange(block=False)
    for handle in (running, queued):
        (event,) = list(handle)
        assert isinstance(event, Failed) and isinstance(event.error, RankLost)
        assert event.error.status == 503 and "connection to a peer was lost" in str(event.error)
    assert lockstep.abort.is_set()


def test_a_lost_rank_hands_over_the_events_its_engine_thread_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread holds a decode step's tokens until the next step; a collective failing at
    the exchange in between ends the process after a grace period: the held tokens and the
    RankLost error reach the client's loop before it."""
    received: list[str] = []

    class Loop:
        def call_soon_threadsafe(self, callback: object, items: list[tuple[object, object]]) -> None:
            received.extend(type(event).__name__ for _, event in items)

    lockstep, submitted, _ = make_lockstep()
    caller = RequestHandle(GenerationRequest("m", [1, 2]), loop=Loop())  # type: ignore[arg-type]
    submitted.put(caller)
    lockstep.exchange(block=False)
    (mirror,) = taken(lockstep)

    def lost(data: bytes, size: int) -> bytes:
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(lockstep, "_all_sum", lost)
    with lockstep.outbox.installed():
        lockstep.outbox.hold()  # as the engine thread after a decode step
        try:
            mirror._emit(Delta("x", (7,)))
            lockstep.exchange(block=False)
            assert received == ["Delta", "Failed"]
        finally:
            lockstep.outbox.release()


def test_the_watchdog_ends_requests_when_no_step_completes_in_time() -> None:
    lockstep, submitted, _ = make_lockstep(step_timeout_s=0.3)
    caller = RequestHandle(GenerationRequest("m", [1]))
    submitted.put(caller)
    lockstep.exchange(block=False)
    started = time.monotonic()
    (event,) = list(caller)  # no further exchange: a peer that hangs
    assert isinstance(event, Failed) and isinstance(event.error, RankLost)
    assert "distributed.step_timeout_s" in str(event.error)
    assert time.monotonic() - started < 3.0


def test_an_engine_in_lockstep_generates_what_a_plain_one_does(tmp_path) -> None:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    config = Config(models=[ModelConfig(path=str(path), name="tiny", context_length=128)])
    outputs, vectors = [], []
    for world in (None, one_rank()):
        engine = Engine(config, load_plugins(), world=world)
        engine.start()
        try:
            handles = [
                engine.submit(GenerationRequest("tiny", [5, 6, 7, 8], SamplingParams(max_tokens=6, **params)))
                for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3})
            ]
            outputs.append([[t for e in handle for t in getattr(e, "token_ids", ())] for handle in handles])
            # jobs cross the exchange too: every rank runs them alike
            vectors.append(engine.embed("tiny", [[1, 2, 3], [4, 5]], timeout=60).vectors)
        finally:
            engine.stop()
    assert outputs[0] == outputs[1] and all(len(tokens) == 6 for tokens in outputs[0])
    assert vectors[0] == vectors[1] and len(vectors[0]) == 2


def parts(models):
    """A job's work in three parts; module-level, so it can be pickled to the other ranks."""
    for _ in range(3):
        yield
    return sorted(models)


def test_jobs_cross_the_exchange_and_a_cancellation_waits_for_the_next_one() -> None:
    from mlxr_core.engine.jobs import EngineJob, run_jobs

    submitted_jobs: queue.Queue[EngineJob] = queue.Queue()
    lockstep = Lockstep(one_rank(), queue.Queue(), threading.Event(), threading.Event(), jobs=submitted_jobs,
                        exit_on_loss=False)  # fmt: skip

    def unsent(models):  # a closure: it cannot travel to the other ranks
        return 1

    done, cancelled, refused = EngineJob(parts, what="a job"), EngineJob(parts, what="another"), EngineJob(unsent)
    for job in (done, cancelled, refused):
        submitted_jobs.put(job)
    lockstep.exchange(block=False)
    with pytest.raises(MlxrError, match="cannot be sent to the other ranks"):
        refused.future.result(1)
    running: list[EngineJob] = []
    run_jobs(lockstep.jobs, {"m": None}, running)  # the copies every rank runs, one part each
    assert len(running) == 2 and running[0] is not done
    cancelled.cancel()  # the caller leaves: the copy runs on until the next exchange
    run_jobs(lockstep.jobs, {"m": None}, running)
    assert not running[1].cancelled
    lockstep.exchange(block=False)
    assert running[1].cancelled
    while running:
        run_jobs(lockstep.jobs, {"m": None}, running)
    assert done.future.result(1) == ["m"]


def test_a_probe_after_a_failed_step_tells_a_lost_peer_from_a_shared_error(monkeypatch: pytest.MonkeyPatch) -> None:
    lockstep, submitted, _ = make_lockstep()
    caller = RequestHandle(GenerationRequest("m", [1]))
    submitted.put(caller)
    lockstep.exchange(block=False)
    lockstep.probe(ValueError("a bug every rank met"))  # the group answers: nothing ends
    assert not lockstep.abort.is_set()

    def lost(*args: object, **kwargs: object) -> mx.array:
        raise RuntimeError("[ring] connection to a peer was lost")

    monkeypatch.setattr(mx.distributed, "all_sum", lost)
    lockstep.probe(ValueError("step"))
    (event,) = list(caller)
    assert isinstance(event, Failed) and isinstance(event.error, RankLost)
    assert "no longer answer" in str(event.error)


def test_the_first_exchange_and_one_a_second_gather_every_ranks_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    lockstep, _, _ = make_lockstep()
    assert lockstep.rank_stats() == []
    keep = mx.ones((1000,))  # 4,000 bytes this rank holds
    mx.eval(keep)
    lockstep.exchange(block=False)
    (first,) = lockstep.rank_stats()
    assert first["active_bytes"] >= keep.nbytes and first["peak_bytes"] >= first["active_bytes"]
    assert first["exchanges"] == 0  # counted after this exchange's collectives
    lockstep.exchange(block=False)  # within the period: not gathered again
    assert lockstep.rank_stats()[0]["exchanges"] == 0
    monkeypatch.setattr("mlxr_core.engine.lockstep.RANK_STATS_PERIOD_S", 0.0)
    lockstep.exchange(block=False)
    (latest,) = lockstep.rank_stats()
    assert latest["exchanges"] == 2 and latest["exchange_seconds"] > 0
