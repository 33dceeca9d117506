"""The engine thread end to end on a tiny random model written by the test."""

from __future__ import annotations

import threading
import time

import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import (
    ContextLengthExceeded,
    EngineStopped,
    ModelNotFound,
    Overloaded,
    RequestError,
)
from mlxr_core.plugins import hookimpl, load_plugins


def collect(handle):
    events = list(handle)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    return text, events[-1], [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def request(prompt_ids, **params):
    params.setdefault("temperature", 0.0)
    return GenerationRequest(model="tiny", prompt_ids=list(prompt_ids), params=SamplingParams(**params))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def make_engine(tiny_path, extra=(), **engine):
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=128)],
        engine=EngineConfig(**engine),
    )
    host = load_plugins(extra=extra)
    eng = Engine(config, host)
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = make_engine(tiny_path, prefill_chunk=4)
    yield eng
    eng.stop()


PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_greedy_generation_is_deterministic_and_honours_max_tokens(engine):
    text_a, done_a, ids_a = collect(engine.submit(request(PROMPT, max_tokens=12, extra={"ignore_eos": True})))
    text_b, _, ids_b = collect(engine.submit(request(PROMPT, max_tokens=12, extra={"ignore_eos": True})))
    assert isinstance(done_a, Finished) and done_a.reason == "length"
    assert done_a.usage.prompt_tokens == len(PROMPT) and done_a.usage.completion_tokens == 12
    assert ids_a == ids_b and len(ids_a) == 12
    assert text_a == text_b


def test_chunked_prefill_matches_a_single_chunk(tiny_path, engine):
    whole = make_engine(tiny_path, prefill_chunk=512)
    try:
        _, _, chunked = collect(engine.submit(request(PROMPT * 3, max_tokens=8, extra={"ignore_eos": True})))
        _, _, single = collect(whole.submit(request(PROMPT * 3, max_tokens=8, extra={"ignore_eos": True})))
    finally:
        whole.stop()
    assert chunked == single


def test_greedy_tokens_follow_the_model_argmax(engine, tiny_path):
    import mlx.core as mx

    from mlxr_core.model.loader import load_model

    # A separate copy on this thread: MLX work never touches the engine thread's arrays.
    loaded = load_model(ModelConfig(path=str(tiny_path)), load_plugins().registries)
    ids = list(PROMPT)
    for _ in range(6):
        logits = loaded.model(mx.array([ids]), cache=None)
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    _, _, generated = collect(engine.submit(request(PROMPT, max_tokens=6, extra={"ignore_eos": True})))
    assert generated == ids[len(PROMPT) :]


def test_seeded_sampling_is_reproducible(engine):
    params = dict(temperature=1.0, seed=123, max_tokens=16, extra={"ignore_eos": True})
    _, _, first = collect(engine.submit(request(PROMPT, **params)))
    _, _, second = collect(engine.submit(request(PROMPT, **params)))
    assert first == second


def test_stop_string_is_never_emitted(engine):
    text, _, _ = collect(engine.submit(request(PROMPT, max_tokens=24, extra={"ignore_eos": True})))
    assert len(text) > 4, "the tiny model must produce some text for this test"
    stop = text[2:4]
    stopped, done, _ = collect(engine.submit(request(PROMPT, max_tokens=24, stop=[stop], extra={"ignore_eos": True})))
    assert done.reason == "stop"
    assert stop not in stopped
    assert text.startswith(stopped)
    assert stopped == text[: text.index(stop)]


def test_unknown_model_and_context_length_are_refused_before_queueing(engine):
    with pytest.raises(ModelNotFound):
        engine.submit(GenerationRequest(model="nope", prompt_ids=[1]))
    with pytest.raises(ContextLengthExceeded):
        engine.submit(request([5] * 200))
    with pytest.raises(ContextLengthExceeded):
        engine.submit(request([5] * 100, max_tokens=100))
    # With no max_tokens the request is clamped to the context left.
    _, done, _ = collect(engine.submit(request([5] * 120, extra={"ignore_eos": True})))
    assert done.usage.completion_tokens == 8


def test_cancellation_frees_the_engine_within_a_step(engine):
    handle = engine.submit(request(PROMPT, max_tokens=100_000 // 1000, extra={"ignore_eos": True}))
    first = next(iter(handle))
    assert isinstance(first, Delta)
    handle.cancel()
    rest = list(handle)
    assert isinstance(rest[-1], Finished) and rest[-1].reason == "cancelled"
    deadline = time.time() + 5
    while engine.running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.running == 0
    _, done, _ = collect(engine.submit(request(PROMPT, max_tokens=3)))
    assert isinstance(done, Finished)


class ExplodingDecoder:
    def generate(self, model, cache, prompt_ids, sampler, *, prefill_chunk):
        yield 5
        raise RuntimeError("injected failure")


class ExplodingPlugin:
    @staticmethod
    @hookimpl
    def mlxr_register_decoders(register):
        register("exploding", ExplodingDecoder)


def test_a_failing_request_fails_alone(tiny_path):
    eng = make_engine(tiny_path, extra=[("exploding", ExplodingPlugin)])
    try:
        bad = GenerationRequest(
            model="tiny", prompt_ids=PROMPT, params=SamplingParams(max_tokens=5), decoder="exploding"
        )
        _, failed, _ = collect(eng.submit(bad))
        assert isinstance(failed, Failed) and "injected failure" in failed.error.message
        _, done, _ = collect(eng.submit(request(PROMPT, max_tokens=3)))
        assert isinstance(done, Finished)
    finally:
        eng.stop()


def test_queue_limit_and_shutdown(tiny_path):
    eng = make_engine(tiny_path, max_queue=1, max_batch_size=1)
    try:
        long = eng.submit(request(PROMPT, max_tokens=100, extra={"ignore_eos": True}))
        next(iter(long))  # the first request is running, the queue is empty
        queued = eng.submit(request(PROMPT, max_tokens=2))
        with pytest.raises(Overloaded):
            eng.submit(request(PROMPT, max_tokens=2))
        long.cancel()
        assert isinstance(list(queued)[-1], Finished)
    finally:
        stopper = threading.Thread(target=eng.stop)
        stopper.start()
        stopper.join(10)
    assert eng.state == "stopped"
    with pytest.raises(EngineStopped):
        eng.submit(request(PROMPT, max_tokens=2))


@pytest.mark.parametrize("prompt", ["hello", [5, "x"], [5, -1], [5, 10**6], [True, 5]])
def test_prompt_ids_that_are_not_token_ids_are_refused_before_queueing(engine, prompt):
    bad = GenerationRequest(model="tiny", prompt_ids=prompt, params=SamplingParams(max_tokens=2))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"prompt_ids must be token ids in \[0, "):
        engine.submit(bad)
    _, done, _ = collect(engine.submit(request(PROMPT, max_tokens=2)))
    assert isinstance(done, Finished)


def test_the_loop_counts_its_time_between_steps_only_while_a_batch_runs(tiny_path):
    eng = make_engine(tiny_path)
    try:
        collect(eng.submit(request(PROMPT, max_tokens=8, extra={"ignore_eos": True})))
        stats = eng.stats()
        assert stats["steps"] >= 8 and stats["step_seconds"] > 0
        # Seven gaps at least between the request's steps, each a positive interval of the clock.
        between = stats["between_steps_seconds"]
        assert between > 0
        time.sleep(0.3)  # idle: the loop waits for requests, which is not time between steps
        assert eng.stats()["between_steps_seconds"] == between
        collect(eng.submit(request(PROMPT, max_tokens=4, extra={"ignore_eos": True})))
        assert eng.stats()["between_steps_seconds"] > between
    finally:
        eng.stop()


def test_a_models_parsers_are_chosen_once_when_it_loads(tiny_path):
    """The parsers a model's config names (or ``auto`` picks from its chat template) are resolved
    when it loads and carried by its ModelInfo, with the index of its ``models[]`` entry."""
    config = Config(
        models=[
            ModelConfig(path=str(tiny_path), name="other", context_length=64),
            ModelConfig(
                path=str(tiny_path), name="tiny", context_length=64, tool_parser="hermes", reasoning_parser="none"
            ),
        ]
    )
    eng = Engine(config, load_plugins())
    eng.start()
    try:
        info = eng.model("tiny")
        assert (info.config_index, info.tool_parser, info.reasoning_parser) == (1, "hermes", None)
        other = eng.model("other")
        registries = eng.host.registries
        template = other.tokenizer.chat_template
        assert other.config_index == 0
        assert other.tool_parser == registries.tool_parsers.choose("auto", template)
        assert other.reasoning_parser == registries.reasoning_parsers.choose("auto", template)
    finally:
        eng.stop()
