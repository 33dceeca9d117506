"""The option scoring job forks every prompt from the prefix cache's entry for their shared prefix:
that prefix is not run again, each prompt's rest is, and the scores equal one uncached forward
pass over each whole prompt."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.engine.jobs import EngineJob
from mlxr_core.engine.option_scoring import OptionScores, OptionScoringWork
from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

SHARED = [(i * 7) % 200 + 3 for i in range(24)]
PROMPTS = [[*SHARED, 40, 41, 42], [*SHARED, 50], [*SHARED, 60, 61]]
OPTIONS = [[5], [7], [11]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return load_model(ModelConfig(path=str(path), dtype="float32"), load_plugins().registries)


def run(work: OptionScoringWork, loaded) -> OptionScores:
    """The job run to its end as the engine thread runs it."""
    job = EngineJob(work, what="option scoring", model="tiny")
    job.run({"tiny": loaded})
    return job.future.result()  # type: ignore[no-any-return]


def whole_prompt(loaded, prompt: list[int]) -> list[float]:
    """log P(option) among the options after ``prompt``, one forward pass without a cache, in numpy."""
    logits = np.array(loaded.model(mx.array([prompt]))[0, -1].astype(mx.float32)).astype(np.float64)
    picked = logits[[ids[0] for ids in OPTIONS]]
    return list(picked - (picked.max() + np.log(np.exp(picked - picked.max()).sum())))


def test_prompts_fork_from_the_prefix_caches_entry_and_score_as_whole_prompts(loaded) -> None:
    work = OptionScoringWork("tiny", PROMPTS, [OPTIONS] * len(PROMPTS), [], chunk=8)
    tails = sum(len(prompt) - len(SHARED) for prompt in PROMPTS)
    loaded.prefix_cache = None
    cold = run(work, loaded)
    assert (cold.reused, cold.prefilled) == (0, len(SHARED) + tails)

    loaded.prefix_cache = PrefixCache(2**26)
    cache = loaded.make_cache()
    mx.eval(loaded.model(mx.array([SHARED]), cache=cache))
    assert loaded.prefix_cache.store(SHARED, cache)
    warm = run(work, loaded)
    assert (warm.reused, warm.prefilled, warm.branched) == (len(SHARED), tails, 0)

    for prompt, got_cold, got_warm in zip(PROMPTS, cold.scores, warm.scores, strict=True):
        want = whole_prompt(loaded, prompt)
        assert got_cold == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert got_warm == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("positions", [8192, 60], ids=["one-pass", "bounded"])
def test_rows_of_one_pass_fork_each_its_own_cache_where_options_share_tokens(
    loaded, positions: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options 5, 5 9 and 7 (5 and 5 9 told apart by the end against 9 after 5) for prompts whose
    rests run as rows of one pass (or two, under a bound on the positions the rows hold): as
    uncached passes over the prompt and over the prompt and 5."""
    import mlxr_core.engine.option_scoring as option_scoring

    monkeypatch.setattr(option_scoring, "MAX_ROW_POSITIONS", positions)
    options, end = [[5], [5, 9], [7]], [2]
    loaded.prefix_cache = None
    got = run(OptionScoringWork("tiny", PROMPTS, [options] * len(PROMPTS), end, chunk=64), loaded)
    assert got.branched == len(PROMPTS)  # one pass over 5 per prompt, from its own row's cache

    def logprobs(ids: list[int]) -> np.ndarray:
        logits = np.array(loaded.model(mx.array([ids]))[0, -1].astype(mx.float32)).astype(np.float64)
        return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))

    for prompt, scores in zip(PROMPTS, got.scores, strict=True):
        first, after = logprobs(prompt), logprobs([*prompt, 5])
        five = np.logaddexp(first[5], first[7])
        ends = np.logaddexp.reduce(after[end])
        stop, nine = ends - np.logaddexp(ends, after[9]), after[9] - np.logaddexp(ends, after[9])
        want = [first[5] - five + stop, first[5] - five + nine, first[7] - five]
        assert scores == pytest.approx(want, rel=1e-4, abs=1e-5)
