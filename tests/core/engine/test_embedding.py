"""Embeddings: pooling, the engine job that computes them, and model names and aliases."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.embedding import embed_tokens, pool
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.jobs import EngineJob
from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import ConfigError, EngineStopped, MlxrError, ModelNotFound, RequestError
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

# -- pooling ---------------------------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def test_mean_pooling_ignores_padding_and_normalizes():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 5, 4)).astype(np.float32)
    lengths = [5, 2, 1]
    pooled = np.array(pool(mx.array(hidden), mx.array(lengths), "mean"))
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(pooled[row], _unit(hidden[row, :n].mean(axis=0)), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-6)


def test_last_pooling_takes_each_rows_last_real_position():
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((3, 6, 8)).astype(np.float32)
    lengths = [6, 3, 1]
    pooled = np.array(pool(mx.array(hidden), mx.array(lengths), "last"))
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(pooled[row], _unit(hidden[row, n - 1]), atol=1e-6)


def test_pooling_an_all_zero_row_stays_finite_and_unknown_pooling_is_refused():
    pooled = np.array(pool(mx.zeros((1, 3, 4)), mx.array([3])))
    assert np.isfinite(pooled).all() and not pooled.any()
    with pytest.raises(RequestError, match="unknown pooling 'max'"):
        pool(mx.zeros((1, 3, 4)), mx.array([3]), "max")


# -- on a tiny model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def loaded(tiny_path):
    """A copy of the model in this thread, for expected values."""
    return load_model(ModelConfig(path=str(tiny_path), dtype="float32"), load_plugins().registries)


INPUTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34], [40]]


def expected(loaded, ids: list[int], pooling: str = "mean") -> np.ndarray:
    """One row alone, in one pass, pooled with numpy."""
    states = np.array(loaded.arch.hidden_states(loaded.model, mx.array([ids]))[0])
    return _unit(states[-1] if pooling == "last" else states.mean(axis=0))


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("chunk", [3, 8, 512])
def test_batched_and_chunked_embeddings_equal_each_row_alone(loaded, pooling, chunk):
    """chunk=3: every input but one longer than a chunk; 8: batches of short rows plus one long."""
    vectors = embed_tokens(loaded, INPUTS, chunk=chunk, pooling=pooling)
    assert len(vectors) == len(INPUTS)
    for ids, vector in zip(INPUTS, vectors, strict=True):
        np.testing.assert_allclose(vector, expected(loaded, ids, pooling), atol=1e-5)


def make_engine(tiny_path, models=None, **engine):
    models = models or [ModelConfig(path=str(tiny_path), name="tiny", aliases=["small"], context_length=32)]
    eng = Engine(Config(models=models, engine=EngineConfig(**engine)), load_plugins())
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = make_engine(tiny_path, prefill_chunk=4)
    yield eng
    eng.stop()


def test_engine_embeds_on_its_thread_in_chunks(engine, loaded):
    result = engine.embed("tiny", INPUTS, timeout=60)
    assert result.model == "tiny" and result.prompt_tokens == sum(map(len, INPUTS))
    for ids, vector in zip(INPUTS, result.vectors, strict=True):
        np.testing.assert_allclose(vector, expected(loaded, ids), atol=1e-5)
    last = engine.embed("small", INPUTS[:1], pooling="last", timeout=60)
    assert last.model == "tiny"
    np.testing.assert_allclose(last.vectors[0], expected(loaded, INPUTS[0], "last"), atol=1e-5)


def test_engine_embeds_asynchronously_while_generating(engine, loaded):
    async def both():
        loop = asyncio.get_running_loop()
        handle = engine.submit(
            GenerationRequest("small", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0)), loop=loop
        )
        vectors = await engine.embed_async("small", [[5, 6, 7]])
        events = [event async for event in handle.events()]
        return handle, vectors, events

    handle, result, events = asyncio.run(both())
    assert handle.request.model == "tiny"  # the alias resolved to the served name
    assert isinstance(events[-1], Finished)
    np.testing.assert_allclose(result.vectors[0], expected(loaded, [5, 6, 7]), atol=1e-5)


@pytest.mark.parametrize(
    ("model", "inputs", "error", "match"),
    [
        ("nope", [[1]], ModelNotFound, "'nope' does not exist"),
        ("tiny", [], RequestError, "at least one"),
        ("tiny", [[1], []], RequestError, r"input\[1\] is empty"),
        ("tiny", [[1, 10**6]], RequestError, "token ids must be in"),
        ("tiny", [list(range(1, 40))], RequestError, "more than this model's context length"),
    ],
)
def test_bad_embedding_inputs_are_refused_before_queueing(engine, model, inputs, error, match):
    with pytest.raises(error, match=match):
        engine.embed(model, inputs)


def test_a_failing_job_reaches_its_caller_and_the_engine_goes_on(engine):
    def broken(models):
        raise ValueError("boom")

    job = EngineJob(broken, what="a broken job")
    engine._jobs.put(job)
    with pytest.raises(MlxrError, match="a broken job failed: ValueError: boom"):
        job.future.result(timeout=30)
    assert len(engine.embed("tiny", [[1, 2]], timeout=30).vectors) == 1


def test_names_and_aliases_resolve_to_the_served_model(engine):
    assert engine.resolve("tiny") == engine.resolve("small") == "tiny"
    assert engine.model("small").aliases == ("small",)
    with pytest.raises(ModelNotFound, match="served: tiny"):
        engine.resolve("smol")


def test_two_models_from_one_process_each_by_name_and_alias(tiny_path):
    models = [
        ModelConfig(path=str(tiny_path), name="first", aliases=["one", "uno"], context_length=32),
        ModelConfig(path=str(tiny_path), name="second", aliases=["two"], context_length=32),
    ]
    eng = make_engine(tiny_path, models)
    try:
        assert sorted(eng.models) == ["first", "second"]
        assert eng.names == {"first": "first", "one": "first", "uno": "first", "second": "second", "two": "second"}
        a = eng.embed("uno", [[3, 4, 5]], timeout=60)
        b = eng.embed("two", [[3, 4, 5]], timeout=60)
        assert (a.model, b.model) == ("first", "second")
        np.testing.assert_allclose(a.vectors, b.vectors, atol=1e-6)  # the same weights
        params = SamplingParams(max_tokens=3, temperature=0.0, extra={"ignore_eos": True})
        for name in ("one", "two"):
            events = list(eng.submit(GenerationRequest(name, [5, 6], params)))
            assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == 3
    finally:
        eng.stop()


def test_a_default_name_clashing_with_an_alias_fails_the_load_naming_the_key(tiny_path):
    models = [
        ModelConfig(path=str(tiny_path), name="first", aliases=[tiny_path.stem]),
        ModelConfig(path=str(tiny_path)),  # named after its file: tiny
    ]
    eng = Engine(Config(models=models), load_plugins())
    with pytest.raises(ConfigError, match=r"models\[1\]\.name: 'tiny' already names the model 'first'"):
        eng.start()
    eng.stop()


def test_embedding_after_stop_is_refused(tiny_path):
    eng = make_engine(tiny_path)
    eng.stop()
    with pytest.raises(EngineStopped):
        eng.embed("tiny", [[1, 2]])


@pytest.fixture(scope="module")
def long_engine(tiny_path):
    """The tiny model with a long context, a forward pass at most 8 tokens."""
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=4096)],
        engine=EngineConfig(prefill_chunk=8),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    yield engine
    engine.stop()


def test_a_long_embedding_is_interleaved_with_generation_and_stops_when_abandoned(long_engine):
    """4,000 tokens are 500 forward passes: a 2-token reply asked meanwhile finishes first, and a
    caller that stops waiting stops the job at its next pass."""

    async def scenario() -> tuple[bool, bool]:
        embedding = asyncio.ensure_future(long_engine.embed_async("tiny", [[5] * 4000]))
        await asyncio.sleep(0.05)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        handle = long_engine.submit(GenerationRequest(model="tiny", prompt_ids=[1, 2], params=params))
        events = await asyncio.to_thread(list, handle)
        reply_first = isinstance(events[-1], Finished) and not embedding.done()
        embedding.cancel()
        deadline = asyncio.get_running_loop().time() + 5
        while long_engine.scheduler.running_jobs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return reply_first, not long_engine.scheduler.running_jobs

    reply_first, job_ended = asyncio.run(scenario())
    assert reply_first and job_ended
    assert len(long_engine.embed("tiny", [[5] * 40], timeout=30).vectors) == 1  # the engine goes on
