"""Continuous batching, chunked prefill, the prefix cache and the KV budget on a tiny model."""

from __future__ import annotations

import threading
import time

import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.plugins import load_plugins

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [40, 41, 42],
    [100, 17, 23, 99, 3, 8, 61, 62, 63, 64, 65, 66, 70],
    [7],
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def start(tiny_path, **engine):
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=256)],
        engine=EngineConfig(**engine),
    )
    eng = Engine(config, load_plugins())
    eng.start()
    return eng


def request(prompt, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("extra", {"ignore_eos": True})
    return GenerationRequest(model="tiny", prompt_ids=list(prompt), params=SamplingParams(**params))


def tokens_of(handle):
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


@pytest.fixture(scope="module")
def solo(tiny_path):
    """Each prompt's greedy continuation with no batching and no prefix cache."""
    eng = start(tiny_path, max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        return [tokens_of(eng.submit(request(p, max_tokens=10))) for p in PROMPTS]
    finally:
        eng.stop()


def test_concurrent_requests_decode_together_and_match_solo_runs(tiny_path, solo):
    eng = start(tiny_path, max_batch_size=4, prefill_chunk=4)
    try:
        handles = [eng.submit(request(p, max_tokens=10)) for p in PROMPTS]
        assert [tokens_of(h) for h in handles] == solo
    finally:
        eng.stop()


def test_requests_join_and_leave_a_running_batch(tiny_path, solo):
    eng = start(tiny_path, max_batch_size=4, prefill_chunk=4)
    try:
        long = eng.submit(request(PROMPTS[0], max_tokens=40))
        stream = iter(long)
        for _ in range(5):
            assert isinstance(next(stream), Delta)
        # Joins mid-stream with a different length; a short one leaves early.
        joined = [eng.submit(request(p, max_tokens=10)) for p in PROMPTS[1:]]
        assert [tokens_of(h) for h in joined] == solo[1:]
        rest = [t for e in stream if isinstance(e, Delta) for t in e.token_ids]
        assert rest[:5] == solo[0][5:]
    finally:
        eng.stop()


def test_seeded_sampling_ignores_batch_neighbours(tiny_path):
    eng = start(tiny_path, max_batch_size=4)
    try:
        params = dict(temperature=1.0, seed=42, max_tokens=12)
        alone = tokens_of(eng.submit(request(PROMPTS[2], **params)))
        crowd = [eng.submit(request(p, temperature=0.9, seed=i, max_tokens=12)) for i, p in enumerate(PROMPTS)]
        seeded = eng.submit(request(PROMPTS[2], **params))
        assert tokens_of(seeded) == alone
        for h in crowd:
            tokens_of(h)
    finally:
        eng.stop()


def test_a_long_prefill_does_not_freeze_running_streams(tiny_path):
    eng = start(tiny_path, max_batch_size=4, prefill_chunk=4)
    arrivals: list[str] = []
    try:
        running = eng.submit(request(PROMPTS[0], max_tokens=60))
        stream = iter(running)
        next(stream)

        def consume(name, events):
            for event in events:
                if isinstance(event, Delta):
                    arrivals.append(name)

        reader = threading.Thread(target=consume, args=("running", stream))
        reader.start()
        long_prompt = [(i * 7) % 250 + 3 for i in range(120)]  # 30 prefill chunks of 4
        long = eng.submit(request(long_prompt, max_tokens=2))
        consume("long", long)
        reader.join(30)
    finally:
        eng.stop()
    first_long = arrivals.index("long")
    assert arrivals[:first_long].count("running") >= 10, arrivals[:40]


def test_prefix_cache_reuses_a_shared_prompt_and_changes_nothing(tiny_path):
    system = [(i * 13) % 250 + 3 for i in range(64)]
    prompts = [[*system, 5, 6, 7], [*system, 9, 9, 9, 9]]
    cold = start(tiny_path, prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        expected = [tokens_of(cold.submit(request(p, max_tokens=8))) for p in prompts]
    finally:
        cold.stop()
    warm = start(tiny_path)
    try:
        events = [list(warm.submit(request(p, max_tokens=8))) for p in prompts]
        stats = warm.stats()["prefix_cache"]["tiny"]
    finally:
        warm.stop()
    assert [[t for e in ev if isinstance(e, Delta) for t in e.token_ids] for ev in events] == expected
    assert stats["hits"] == 1 and stats["reused_tokens"] == len(system)
    # each request's usage says how much of its prompt came from the cache
    assert [ev[-1].usage.cached_tokens for ev in events] == [0, len(system)]
    assert [ev[-1].usage.cache_written_tokens for ev in events] == [len(prompts[0]) - 1, len(prompts[1]) - 1 - len(system)]


def test_kv_budget_refuses_what_can_never_fit_and_queues_what_can(tiny_path):
    probe = start(tiny_path)
    per_token = probe.kv_bytes_per_token["tiny"]
    probe.stop()
    eng = start(tiny_path, max_kv_bytes=per_token * 40, max_batch_size=4)
    try:
        with pytest.raises(RequestError) as info:
            eng.submit(request(PROMPTS[0], max_tokens=60))
        assert info.value.field == "max_tokens"
        # Each needs 7 + 25 = 32 positions: only one fits at a time, both finish.
        first = eng.submit(request(PROMPTS[0], max_tokens=25))
        second = eng.submit(request(PROMPTS[0], max_tokens=25))
        time.sleep(0.05)
        assert eng.running <= 1
        assert tokens_of(first) == tokens_of(second)
    finally:
        eng.stop()


def test_cancelling_one_row_keeps_the_others(tiny_path, solo):
    eng = start(tiny_path, max_batch_size=4)
    try:
        doomed = eng.submit(request(PROMPTS[0], max_tokens=200))
        kept = eng.submit(request(PROMPTS[1], max_tokens=10))
        next(iter(doomed))
        doomed.cancel()
        assert list(doomed)[-1].reason == "cancelled"
        assert tokens_of(kept) == solo[1]
    finally:
        eng.stop()


# -- prompts prefilled together -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    from mlxr_core.model.loader import load_model

    return load_model(ModelConfig(path=str(tiny_path), name="tiny", context_length=256), load_plugins().registries)


def runner_for(model, prefix_cache=None, **engine):
    from mlxr_core.engine.batch import BatchRunner

    return BatchRunner(model, EngineConfig(**engine), load_plugins().registries.samplers, prefix_cache)


def greedy_reference(model, prompt, count):
    """``count`` greedy tokens after ``prompt``, each from one forward pass over everything before
    it: no cache, no batch."""
    import mlx.core as mx

    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(mx.argmax(model.model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt):]


def test_prompts_waiting_together_are_prefilled_in_one_pass(tiny_model):
    """Prompts of different lengths waiting at a step are prefilled in one forward pass
    (right-aligned, the shorter ones after padding) and decode on as the model computes each
    alone; a one-token prompt (nothing to prefill) ends the group and joins as before; groups
    are powers of two."""
    from mlxr_core.engine.request import RequestHandle

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9, 8, 7, 6], PROMPTS[3], [1, 2, 3], [4, 5, 6, 7], [8, 9]]
    runner = runner_for(tiny_model, max_batch_size=8)
    calls = []
    forward = tiny_model.model

    class Counting:
        def __call__(self, *args, **kwargs):
            calls.append(args[0].shape)
            return forward(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(forward, name)

    handles = [RequestHandle(request(p, max_tokens=6)) for p in prompts]
    for handle in handles:
        runner.add(handle)
    tiny_model.model = Counting()
    try:
        runner.step()
    finally:
        tiny_model.model = forward
    # One pass for the first four (12 positions: the longest prompt but its last token), then
    # PROMPTS[3] joins with nothing to prefill; of the last three, two go together, one alone.
    assert calls == [(4, 12), (2, 3), (1, 1)], calls
    assert runner.prompts_together == 6 and len(runner.running) == 8
    while runner.busy:
        runner.step()
    for prompt, handle in zip(prompts, handles, strict=True):
        assert tokens_of(handle) == greedy_reference(tiny_model, prompt, 6)


def run_all(runner, prompts, max_tokens=5):
    from mlxr_core.engine.request import RequestHandle

    handles = [RequestHandle(request(p, max_tokens=max_tokens)) for p in prompts]
    for handle in handles:
        runner.add(handle)
    while runner.busy:
        runner.step()
    return [list(handle) for handle in handles]


def tokens_in(events):
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def test_prompts_prefilled_together_are_stored_in_the_prefix_cache(tiny_model):
    """Each prompt of a group is stored in the prefix cache as its own (its padding left out):
    a later request sharing it reuses it and decodes the same."""
    from mlxr_core.engine.prefix_cache import PrefixCache

    prompts = [[(i * k) % 250 + 3 for i in range(n)] for k, n in ((13, 43), (7, 22), (11, 34))]
    runner = runner_for(tiny_model, PrefixCache(max_bytes=1 << 30), max_batch_size=4)
    first = run_all(runner, prompts)
    assert runner.prompts_together == 2  # a group of two, and one alone
    assert [tokens_in(e) for e in first] == [greedy_reference(tiny_model, p, 5) for p in prompts]
    later = [*prompts[1][:-1], 4, 4]
    (events,) = run_all(runner, [later])
    assert events[-1].usage.cached_tokens == len(prompts[1]) - 1
    assert tokens_in(events) == greedy_reference(tiny_model, later, 5)


def test_a_burst_sharing_a_system_prompt_reuses_it_instead(tiny_model):
    """Prompts that begin alike (a system prompt long enough to store) are not prefilled
    together: each later one is prefilled after the earlier is stored, and reuses the prefix."""
    from mlxr_core.engine.prefix_cache import PrefixCache

    system = [(i * 13) % 250 + 3 for i in range(40)]
    prompts = [[*system, 5, 6, 7], [*system[:20], 9, 9], [*system[:30], 1, 2, 3, 4]]
    runner = runner_for(tiny_model, PrefixCache(max_bytes=1 << 30), max_batch_size=4)
    events = run_all(runner, prompts)
    assert runner.prompts_together == 0
    assert [e[-1].usage.cached_tokens for e in events] == [0, 20, 30]
    assert [tokens_in(e) for e in events] == [greedy_reference(tiny_model, p, 5) for p in prompts]


def test_a_failed_pass_together_falls_back_to_one_by_one(tiny_model, monkeypatch):
    """Should the pass over the prompts together fail (memory for the padded batch, say), the
    requests are prefilled one by one and decode as they would have."""
    from mlxr_core.engine import batch

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory for the padded pass")

    monkeypatch.setattr(batch, "prefill_together", fails)
    runner = runner_for(tiny_model, max_batch_size=4)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    events = run_all(runner, prompts)
    assert runner.prompts_together == 0
    assert [tokens_in(e) for e in events] == [greedy_reference(tiny_model, p, 5) for p in prompts]


def test_a_prefix_cache_that_cannot_store_loses_no_request(tiny_model):
    """A failing prefix-cache store after prompts prefilled together costs only the reuse."""
    from mlxr_core.engine.prefix_cache import PrefixCache

    class Broken(PrefixCache):
        def store(self, tokens, caches):
            raise OSError("disk full")

    prompts = [[(i * k) % 250 + 3 for i in range(n)] for k, n in ((13, 43), (7, 22))]
    runner = runner_for(tiny_model, Broken(max_bytes=1 << 30), max_batch_size=4)
    events = run_all(runner, prompts)
    assert runner.prompts_together == 2
    assert [tokens_in(e) for e in events] == [greedy_reference(tiny_model, p, 5) for p in prompts]


def test_an_idle_engine_can_wait_for_the_rest_of_a_burst(tiny_path):
    """With ``engine.burst_gap_ms``, requests arriving a few milliseconds apart at an idle engine
    start in one step, their prompts prefilled together; without, the first starts at once (and
    the others join it in later steps)."""
    def submit_apart(eng, apart):
        handles = []
        for prompt in [*PROMPTS[:3], [9, 8, 7, 6]]:
            handles.append(eng.submit(request(prompt, max_tokens=4)))
            time.sleep(apart)
        for handle in handles:
            tokens_of(handle)
        return eng.stats()["prompts_prefilled_together"]

    eng = start(tiny_path, max_batch_size=4, burst_gap_ms=100.0)
    try:
        assert submit_apart(eng, 0.005) == 4  # 5 ms apart, within the 100 ms gap
    finally:
        eng.stop()
    eng = start(tiny_path, max_batch_size=4)
    try:
        assert submit_apart(eng, 0.3) < 4
    finally:
        eng.stop()


def test_an_idle_engine_takes_in_the_requests_still_arriving(tiny_path):
    """Requests the server has received and not yet submitted (``engine.arrivals``) keep an idle
    engine from starting, up to ``engine.arrivals_wait_ms``: four submitted 0.1 s apart while
    counted start in one step, their prompts prefilled together; with the wait off they do not.
    A count that never falls (a request that never submits) holds the first back only that long."""
    from mlxr_core.engine.request import ARRIVING

    def submit_counted(eng, apart):
        tickets = [eng.arrivals.arrive() for _ in range(4)]
        handles = []
        for prompt, ticket in zip([*PROMPTS[:3], [9, 8, 7, 6]], tickets, strict=True):
            token = ARRIVING.set(ticket)
            try:
                handles.append(eng.submit(request(prompt, max_tokens=4)))
            finally:
                ARRIVING.reset(token)
            time.sleep(apart)
        outputs = [tokens_of(handle) for handle in handles]
        assert eng.arrivals.pending == 0
        return eng.stats()["prompts_prefilled_together"], outputs

    eng = start(tiny_path, max_batch_size=4, arrivals_wait_ms=1000.0)
    try:
        together, outputs = submit_counted(eng, 0.1)
        assert together == 4
        stuck = eng.arrivals.arrive()  # never submitted: the wait ends at its bound
        assert len(tokens_of(eng.submit(request(PROMPTS[0], max_tokens=4)))) == 4
        stuck.leave()
        embedding = eng.arrivals.arrive()  # an embedding request counts out once its job is queued
        token = ARRIVING.set(embedding)
        try:
            assert len(eng.embed("tiny", [[5, 6, 7]]).vectors) == 1
        finally:
            ARRIVING.reset(token)
        assert eng.arrivals.pending == 0
    finally:
        eng.stop()
    eng = start(tiny_path, max_batch_size=4, arrivals_wait_ms=0.0)
    try:
        together, alone = submit_counted(eng, 0.1)
        assert together < 4
        assert alone == outputs
    finally:
        eng.stop()
