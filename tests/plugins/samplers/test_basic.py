import math

import mlx.core as mx
import pytest

from mlxr_core.engine.decoding import make_sampler
from mlxr_core.engine.request import SamplingParams
from mlxr_core.plugins import load_plugins
from mlxr_plugins.samplers import basic


def finite(logits: mx.array) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()[0]) if v != -math.inf]


LOGITS = mx.array([[1.0, 4.0, 3.0, 2.0, 0.0]])  # order of likelihood: 1, 2, 3, 0, 4


def test_top_k_keeps_the_k_largest():
    proc = basic.top_k(SamplingParams(top_k=2))
    assert finite(proc(LOGITS)) == [1, 2]


@pytest.mark.parametrize(("k", "kept"), [(1, [1]), (3, [1, 2, 3]), (4, [0, 1, 2, 3]), (5, [0, 1, 2, 3, 4])])
def test_top_k_keeps_the_k_largest_for_every_k(k: int, kept: list[int]) -> None:
    """k = 1 too (the threshold's slice was empty, and sampling failed with a broadcast error)."""
    assert finite(basic.top_k(SamplingParams(top_k=k))(LOGITS)) == kept


def test_top_k_off_and_greedy_do_not_build_a_processor():
    assert basic.top_k(SamplingParams(top_k=0)) is None
    assert basic.top_k(SamplingParams(top_k=3, temperature=0.0)) is None


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = mx.softmax(LOGITS, axis=-1).tolist()[0]
    # p just above the top token's mass needs the second token too.
    proc = basic.top_p(SamplingParams(top_p=probs[1] + 1e-3))
    assert finite(proc(LOGITS)) == [1, 2]
    # p below the top token's mass keeps only the top token.
    proc = basic.top_p(SamplingParams(top_p=probs[1] - 1e-3))
    assert finite(proc(LOGITS)) == [1]


def test_min_p_scales_with_the_top_probability():
    probs = mx.softmax(LOGITS, axis=-1).tolist()[0]
    ratio = probs[2] / probs[1]  # token 2 relative to the best
    assert finite(basic.min_p(SamplingParams(min_p=ratio - 1e-3))(LOGITS)) == [1, 2]
    assert finite(basic.min_p(SamplingParams(min_p=ratio + 1e-3))(LOGITS)) == [1]


def test_temperature_scales_logits():
    proc = basic.temperature(SamplingParams(temperature=0.5))
    assert proc(LOGITS).tolist() == (LOGITS * 2).tolist()
    assert basic.temperature(SamplingParams(temperature=1.0)) is None


@pytest.fixture(scope="module")
def samplers():
    return load_plugins(discover=True).registries.samplers


def test_greedy_sampler_is_argmax(samplers):
    sample = make_sampler(SamplingParams(temperature=0.0), samplers)
    assert sample(LOGITS).tolist() == [1]


def test_seed_makes_draws_reproducible(samplers):
    logits = mx.zeros((1, 1000))

    def draws(seed):
        sample = make_sampler(SamplingParams(temperature=1.0, seed=seed), samplers)
        return [sample(logits).item() for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_filtered_tokens_are_never_drawn(samplers):
    sample = make_sampler(SamplingParams(temperature=1.5, top_k=2, seed=0), samplers)
    assert {sample(LOGITS).item() for _ in range(200)} <= {1, 2}


def test_draw_frequencies_follow_the_distribution(samplers):
    sample = make_sampler(SamplingParams(temperature=1.0, seed=1), samplers)
    logits = mx.log(mx.array([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[sample(logits).item()] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05
    assert abs(counts[2] / 2000 - 0.1) < 0.03
