"""The drafting decoders (``prompt_lookup``, ``speculative``) on tiny random models written by the
test: greedy output equal to plain decoding token for token, the speculative acceptance rule
keeping the target's distribution (chi-square), preconditions refused at engine start by name,
and acceptance counted."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import Config, ModelConfig, PluginsConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import ConfigError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.statistics import chi_square_p
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.decoders.drafting import speculative_sample
from mlxr_plugins.decoders.prompt_lookup import find_draft


def tokens_of(handle) -> tuple[list[int], Finished]:
    events = list(handle)
    done = events[-1]
    assert isinstance(done, Finished), done
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids], done


def request(prompt, decoder=None, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 40)
    params.setdefault("extra", {"ignore_eos": True})
    return GenerationRequest(
        model="tiny", prompt_ids=list(prompt), params=SamplingParams(**params), decoder=decoder
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafting")
    return {
        "target": write_tiny_llama_gguf(root / "target.gguf", seed=0),
        # The same model in 8-bit: a draft that mostly agrees with the target.
        "draft": write_tiny_llama_gguf(root / "draft.gguf", seed=0, quant="q8_0"),
        # Other weights, same vocabulary: a draft that mostly disagrees.
        "stranger": write_tiny_llama_gguf(root / "stranger.gguf", seed=7),
    }


def start(target, draft=None, decoder="plain", **speculative):
    plugins = {}
    if draft is not None:
        plugins = {"config": {"decoders": {"speculative": {"draft": str(draft), **speculative}}}}
    config = Config(
        models=[ModelConfig(path=str(target), name="tiny", context_length=256, decoder=decoder)],
        plugins=PluginsConfig(**plugins),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(paths):
    eng = start(paths["target"], paths["draft"], decoder="speculative")
    yield eng
    eng.stop()


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [40, 41, 42, 40, 41, 42, 40, 41],  # repeating: prompt lookup finds drafts
    list(range(20, 60)),
]


# --- prompt lookup's n-gram search -------------------------------------------------------------


def test_find_draft_takes_what_followed_the_longest_recent_match():
    #                 0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    # Suffix (1, 2) last occurred at 4..5, followed by 4, 5, 1, 2.
    assert find_draft(tokens, 3, max_ngram=2, min_ngram=1) == [4, 5, 1]
    # A longer suffix (9, 1, 2) never recurs; fall back to shorter ones.
    assert find_draft([7, 9, 1, 2, 8, 9, 1, 2], 2, max_ngram=3, min_ngram=1) == [8, 9]
    assert find_draft([1, 2, 3], 4, max_ngram=2, min_ngram=1) == []


def test_find_draft_continues_periodic_text_into_the_draft():
    assert find_draft([3, 1, 2, 1, 2], 5, max_ngram=2, min_ngram=1) == [1, 2, 1, 2, 1]


# --- the acceptance rule keeps the target's distribution ------------------------------------


def test_speculative_sampling_matches_the_targets_distribution():
    """A toy model whose next-token distribution depends only on the position: target ``p_0, p_1``,
    draft ``q_0, q_1`` (deliberately different). Drafting two tokens from ``q`` and verifying
    them against ``p`` must emit first tokens distributed as ``p_0``, and second tokens (where two
    come out) as ``p_1``, whatever ``q`` is."""
    V = 6
    rng = np.random.default_rng(0)
    p_logits = mx.array(rng.normal(size=(3, V)).astype(np.float32) * 1.5)
    q_logits = mx.array(rng.normal(size=(2, V)).astype(np.float32) * 1.5)
    p = np.array(mx.softmax(p_logits, axis=-1))
    key = mx.random.key(1)
    first = np.zeros(V)
    second = np.zeros(V)
    n = 4000
    for _ in range(n):
        key, draft_key, verify_key = mx.random.split(key, 3)
        draft = mx.random.categorical(q_logits, key=draft_key)
        accepted, replacement = speculative_sample(p_logits, draft, q_logits, verify_key)
        passed, replaced, drafted = accepted.tolist(), replacement.tolist(), draft.tolist()
        emitted = []
        for i in range(2):
            if passed[i]:
                emitted.append(drafted[i])
            else:
                emitted.append(replaced[i])
                break
        else:
            emitted.append(replaced[2])
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, p[0]) > 0.001, (first / n, p[0])
    assert chi_square_p(second, p[1]) > 0.001, (second / second.sum(), p[1])
    # The test has power: the draft's own distribution is rejected.
    q = np.array(mx.softmax(q_logits, axis=-1))
    assert chi_square_p(first, q[0]) < 1e-6


def test_a_copied_draft_is_a_point_mass():
    """Prompt lookup drafts without a distribution: the draft token is accepted with probability
    ``p(d)`` and otherwise replaced from ``p`` without ``d``, which again gives ``p``."""
    V = 5
    p_logits = mx.array([[0.5, 1.0, -0.3, 0.2, 0.0], [0.0] * V])
    p = np.array(mx.softmax(p_logits[0], axis=-1))
    counts = np.zeros(V)
    key = mx.random.key(3)
    for _ in range(3000):
        key, sub = mx.random.split(key)
        accepted, replacement = speculative_sample(p_logits, mx.array([1]), None, sub)
        counts[1 if accepted.item() else replacement.tolist()[0]] += 1
    assert chi_square_p(counts, p) > 0.001, (counts / counts.sum(), p)


# --- greedy output equals plain decoding -----------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_drafting_equals_plain_token_for_token(engine, prompt):
    plain, _ = tokens_of(engine.submit(request(prompt, decoder="plain")))
    looked_up, _ = tokens_of(engine.submit(request(prompt, decoder="prompt_lookup")))
    speculative, done = tokens_of(engine.submit(request(prompt, decoder="speculative")))
    assert looked_up == plain
    assert speculative == plain
    assert done.reason == "length" and done.usage.completion_tokens == 40


def test_acceptance_is_counted_per_model_and_decoder(engine):
    before = engine.stats()["decoders"]["tiny"]["speculative"]["drafted"]
    tokens_of(engine.submit(request(PROMPTS[0], decoder="speculative", max_tokens=20)))
    tokens_of(engine.submit(request(PROMPTS[1], decoder="prompt_lookup", max_tokens=20)))
    stats = engine.stats()["decoders"]["tiny"]
    speculative = stats["speculative"]
    assert speculative["drafted"] > before and speculative["steps"] > 0
    assert 0 < speculative["accepted"] <= speculative["drafted"]
    # An 8-bit copy of the target agrees with it most of the time.
    assert speculative["acceptance_rate"] > 0.5
    assert stats["prompt_lookup"]["drafted"] > 0


def test_sampled_drafting_is_reproducible_with_a_seed_and_stops_at_max_tokens(engine):
    def run(decoder):
        return tokens_of(engine.submit(request(PROMPTS[2], decoder=decoder, temperature=0.9, seed=11)))

    for decoder in ("speculative", "prompt_lookup"):
        a, done = run(decoder)
        b, _ = run(decoder)
        assert a == b and len(a) == 40 and done.usage.completion_tokens == 40


def test_a_draft_that_disagrees_still_gives_the_targets_greedy_output(paths):
    eng = start(paths["target"], paths["stranger"], decoder="speculative", num_draft_tokens=6)
    try:
        for prompt in PROMPTS[:2]:
            plain, _ = tokens_of(eng.submit(request(prompt, decoder="plain")))
            speculative, _ = tokens_of(eng.submit(request(prompt)))
            assert speculative == plain
    finally:
        eng.stop()


def test_requests_with_logprobs_fall_back_to_plain_decoding(engine, caplog):
    plain, _ = tokens_of(engine.submit(request(PROMPTS[0], decoder="plain", logprobs=2)))
    with caplog.at_level("INFO", logger="mlxr_core.engine.scheduler"):
        events = list(engine.submit(request(PROMPTS[0], decoder="speculative", logprobs=2)))
    ids = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    assert ids == plain
    assert all(e.logprobs for e in events if isinstance(e, Delta) and e.token_ids)


# --- preconditions, checked when the engine starts ----------------------------------------


def test_speculative_without_a_draft_model_names_the_key(paths):
    with pytest.raises(ConfigError, match=r"plugins\.config\.decoders\.speculative\.draft names no draft"):
        start(paths["target"], decoder="speculative")


def test_a_draft_with_another_vocabulary_is_refused_with_what_differs(paths):
    other = Path(__file__).parents[2] / "fixtures" / "tiny_hf" / "llama"  # 384 tokens, not 271
    with pytest.raises(ConfigError, match="does not share its vocabulary: vocabulary size 271 vs 384"):
        start(paths["target"], other, decoder="speculative")


def test_a_draft_that_does_not_load_is_a_config_error_naming_the_key(paths, tmp_path):
    with pytest.raises(ConfigError, match="the draft model did not load") as caught:
        start(paths["target"], tmp_path / "missing.gguf", decoder="speculative")
    assert caught.value.field == "plugins.config.decoders.speculative.draft"


def test_metrics_expose_draft_acceptance(engine):
    from litestar.testing import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.server import build_app

    tokens_of(engine.submit(request(PROMPTS[1], decoder="speculative", max_tokens=12)))
    ctx = ServerContext(config=engine.config, host=load_plugins(), engine=engine)
    with TestClient(build_app(ctx)) as client:
        text = client.get("/metrics").text
    samples = {
        (sample.name, sample.labels.get("decoder")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == "tiny"
    }
    stats = engine.stats()["decoders"]["tiny"]["speculative"]
    assert samples[("mlxr_draft_tokens_total", "speculative")] == stats["drafted"] > 0
    assert samples[("mlxr_draft_accepted_tokens_total", "speculative")] == stats["accepted"]
    assert samples[("mlxr_draft_verifications_total", "speculative")] == stats["steps"]
