"""Penalties, logit_bias and logprobs through the engine on a tiny model, and their processors."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.decoding import SamplerContext, make_sampler
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.samplers import penalties

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def engine(tiny_path):
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=256)],
        engine=EngineConfig(max_batch_size=4, prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    eng = Engine(config, load_plugins())
    eng.start()
    yield eng
    eng.stop()


def run(engine, prompt=PROMPT, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 24)
    params.setdefault("extra", {"ignore_eos": True})
    request = GenerationRequest(model="tiny", prompt_ids=list(prompt), params=SamplingParams(**params))
    return engine.submit(request)


def events_of(handle):
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return [e for e in events if isinstance(e, Delta)]


def tokens_of(handle):
    return [t for e in events_of(handle) for t in e.token_ids]


# -- processors on their own -------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    params = SamplingParams(repetition_penalty=2.0)
    proc = penalties.penalties(params, SamplerContext(prompt_ids=[0, 1]))
    logits = mx.array([[4.0, -4.0, 4.0, -4.0]])
    assert proc(logits).tolist() == [[2.0, -8.0, 4.0, -4.0]]
    proc.accept(2)  # a generated token is penalised too
    assert proc(logits).tolist() == [[2.0, -8.0, 2.0, -4.0]]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    proc = penalties.penalties(params, SamplerContext(prompt_ids=[3]))
    logits = mx.zeros((1, 4))
    assert proc(logits).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    for token in (1, 1, 2):
        proc.accept(token)
    # token 1: 2 * 0.5 + 1; token 2: 1 * 0.5 + 1; token 3 (prompt only): untouched
    assert proc(logits).tolist() == [[0.0, -2.0, -1.5, 0.0]]


def test_no_penalty_no_processor():
    assert penalties.penalties(SamplingParams(), SamplerContext()) is None
    assert penalties.logit_bias(SamplingParams(), SamplerContext()) is None


def test_stateful_processors_make_a_stateful_sampler():
    samplers = load_plugins().registries.samplers
    assert make_sampler(SamplingParams(presence_penalty=1.0), samplers).stateful
    assert not make_sampler(SamplingParams(logit_bias={1: 5.0}), samplers).stateful
    assert make_sampler(SamplingParams(temperature=0.0), samplers).plain_greedy


# -- through the engine -------------------------------------------------------------------------


def test_logit_bias_forces_a_token(engine):
    assert set(tokens_of(run(engine, logit_bias={77: 100.0}))) == {77}
    # A strong negative bias on the greedy choice changes the first token.
    first = tokens_of(run(engine, max_tokens=1))[0]
    assert tokens_of(run(engine, max_tokens=1, logit_bias={first: -100.0}))[0] != first


def test_presence_penalty_stops_greedy_repetition(engine):
    plain = tokens_of(run(engine, max_tokens=40))
    assert len(set(plain)) < len(plain), "the tiny model's greedy output repeats without a penalty"
    penalised = tokens_of(run(engine, max_tokens=40, presence_penalty=2.0, logit_bias={}))
    # The penalty (2.0) is smaller than the tiny model's logit gaps, so count repeats rather than
    # demanding none: a penalty must reduce them.
    assert len(set(penalised)) > len(set(plain))


def test_penalised_request_in_a_batch_matches_its_solo_run(engine):
    solo = tokens_of(run(engine, frequency_penalty=1.5, repetition_penalty=1.3))
    handles = [
        run(engine, prompt=[40, 41, 42]),
        run(engine, frequency_penalty=1.5, repetition_penalty=1.3),
        run(engine, prompt=[9, 9], temperature=1.0, seed=3),
    ]
    results = [tokens_of(h) for h in handles]
    assert results[1] == solo


def test_seeded_sampling_with_penalties_is_reproducible(engine):
    def draw():
        return tokens_of(run(engine, temperature=1.0, seed=11, presence_penalty=0.5))

    assert draw() == draw()


def test_invalid_sampling_parameters_are_refused_at_submit(engine):
    with pytest.raises(RequestError, match="logit_bias") as info:
        run(engine, logit_bias={10**9: 1.0})
    assert info.value.field == "logit_bias"
    with pytest.raises(RequestError, match="between -100 and 100"):
        run(engine, logit_bias={3: 500.0})
    with pytest.raises(RequestError, match="repetition_penalty"):
        run(engine, repetition_penalty=0.0)


def check_logprobs(model, prompt, deltas, top):
    """Each token's logprob and its ``top`` alternatives against one forward pass over prompt +
    output, independent of the engine's cache and batch."""
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == len(tokens)
    logits = model.model(mx.array([list(prompt) + tokens[:-1]]))[0, len(prompt) - 1 :, :].astype(mx.float32)
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.token == token
        assert math.isclose(lp.logprob, expected[i, token].item(), abs_tol=2e-3)
        assert len(lp.top) == top
        if top:
            assert lp.top[0][0] == token  # greedy: the chosen token is the most likely
            best = mx.argsort(-expected[i])[:top].tolist()
            assert [t for t, _ in lp.top] == best
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
            for t, value in lp.top:
                assert math.isclose(value, expected[i, t].item(), abs_tol=2e-3)


@pytest.fixture(scope="module")
def reference_model(tiny_path):
    return load_model(ModelConfig(path=str(tiny_path), name="tiny"), load_plugins().registries)


def test_logprobs_match_a_full_forward_pass(engine, reference_model):
    deltas = events_of(run(engine, max_tokens=8, logprobs=3))
    assert sum(len(d.token_ids) for d in deltas) == 8
    check_logprobs(reference_model, PROMPT, deltas, 3)


def test_logprobs_of_rows_sharing_a_batch(tiny_path, reference_model):
    """One step's logprobs are computed for the whole batch at once: rows asking for different
    numbers of alternatives (or none), with prompts of different lengths, each get their own.
    (The engine waits for the burst, so the four start, and decode, together.)"""
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=256)],
        engine=EngineConfig(max_batch_size=4, burst_gap_ms=100.0, prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    together = Engine(config, load_plugins())
    together.start()
    asks = [(PROMPT, 3), (PROMPT[:4], 0), ([9, 3, 14, 15, 92, 6, 5, 35, 8], None), ([7, 7, 2], 1)]
    try:
        handles = [run(together, prompt=prompt, max_tokens=10, logprobs=top) for prompt, top in asks]
        check_rows(asks, handles, reference_model)
        assert together.stats()["prompts_prefilled_together"] == 4
    finally:
        together.stop()


def check_rows(asks, handles, reference_model):
    for (prompt, top), handle in zip(asks, handles, strict=True):
        deltas = events_of(handle)
        assert sum(len(d.token_ids) for d in deltas) == 10
        if top is None:
            assert all(d.logprobs == () for d in deltas)
        else:
            check_logprobs(reference_model, prompt, deltas, top)


def test_logprobs_zero_gives_the_chosen_token_only(engine):
    deltas = events_of(run(engine, max_tokens=3, logprobs=0, temperature=1.0, seed=2))
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == 3 and all(lp.top == () and lp.logprob <= 0 for lp in logprobs)


def test_no_logprobs_unless_asked(engine):
    assert all(d.logprobs == () for d in events_of(run(engine, max_tokens=3)))
