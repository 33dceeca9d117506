"""The zoo check (:mod:`mlxr_core.testing.zoo`): every causal-LM model type transformers 5.25
defines is either served by mlxr with transformers' greedy tokens, from a tiny model transformers
itself wrote, or refused with the reason.

A representative type of each kind (native dense, MoE, latent attention, sliding windows; bridged
dense, MoE, hybrids) runs by default; the whole zoo (about 4 minutes on 2 CPU cores) runs with
``MLXR_FULL_ZOO=1``, as ``python -m mlxr_core.testing.zoo`` that records the counts ``mlxr plugins``
prints.
A type the recorded run found failing is an expected failure here until it is fixed.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="the zoo is what transformers defines")
pytest.importorskip("torch", reason="the reference needs torch (CPU)")

from mlxr_core.testing import zoo

#: One of each kind, run by default.
REPRESENTATIVE = (
    "llama", "qwen3_moe", "deepseek_v3", "gemma3_text", "nemotron_h", "lfm2_moe",  # native
    "cohere", "olmoe", "falcon_mamba",  # through the mlx-lm bridge
)  # fmt: skip
RECORDED = zoo.recorded()
CLAIMED = sorted(name for name, result in RECORDED.items() if result.claim is not None)


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


#: The rest of the claimed types run with ``MLXR_FULL_ZOO=1`` (about 4 minutes of two cores, half
#: the suite's budget); ``python -m mlxr_core.testing.zoo`` re-records all of them, and
#: :func:`test_the_recorded_run_is_of_these_types_and_claims` holds the record to the claims.
FULL_ZOO = os.environ.get("MLXR_FULL_ZOO") == "1"
WHOLE_ZOO_ONLY = pytest.mark.skipif(
    not FULL_ZOO, reason="one of the whole zoo's types: MLXR_FULL_ZOO=1 runs them (python -m mlxr_core.testing.zoo records them)"
)


def _params(names):
    return [pytest.param(name, marks=() if name in REPRESENTATIVE else (pytest.mark.slow, WHOLE_ZOO_ONLY))
            for name in names]


@pytest.mark.parametrize("model_type", _params(CLAIMED))
def test_a_claimed_type_serves_transformers_tokens_or_says_why_not(model_type, registries, tmp_path):
    result = zoo.check_type(model_type, registries, tmp_path)
    if result.outcome == "unwritable":
        pytest.skip(result.detail)
    if result.outcome == "failing" and RECORDED[model_type].outcome == "failing":
        pytest.xfail(f"recorded failing: {result.detail}")
    assert result.outcome in ("native", "bridge", "refused"), result.detail
    assert result.outcome != "refused" or " " in result.detail  # a reason, not a bare name


def test_an_unclaimed_type_is_refused_with_the_reason(registries):
    claims = {name: zoo.claim(name, registries) for name in zoo.causal_lm_types()}
    unclaimed = {name: reason for name, (kind, reason) in claims.items() if kind is None}
    assert "bert" in unclaimed
    for name, reason in unclaimed.items():
        assert f"unknown architecture {name!r}" in reason and "mlx-lm" in reason, reason  # and the fallback's word


def test_the_recorded_run_is_of_these_types_and_claims(registries):
    """The counts ``mlxr plugins`` prints come from a run of the types transformers defines now,
    claimed as the registries claim them now (re-record: ``python -m mlxr_core.testing.zoo``)."""
    assert sorted(RECORDED) == zoo.causal_lm_types()
    stale = {name: (result.claim, zoo.claim(name, registries)[0]) for name, result in RECORDED.items()
             if result.claim != zoo.claim(name, registries)[0]}
    assert not stale, f"recorded claim, claim now: {stale}"
    found = zoo.counts(RECORDED.values())
    summary = zoo.recorded_summary()
    assert summary is not None and f"{found['native']} native" in summary


def test_shrinking_keeps_one_layer_of_each_kind():
    pattern = ["linear_attention"] * 4 + ["full_attention"] + ["linear_attention"] * 3
    keys = zoo.shrink({"num_hidden_layers": 8, "layer_types": pattern, "hidden_size": 4096, "unrelated": 3})
    assert keys == {"num_hidden_layers": 4, "hidden_size": 64,
                    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
