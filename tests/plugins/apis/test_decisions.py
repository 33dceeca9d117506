"""``POST /v1/decisions`` through the official ``openai`` client against a live server on a
tiny model: every kind of question answered among its options, probabilities that add up, the
input prefilled once and every question's row reading it from the prefix cache; bad questions
refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from scripted import live_server

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.request import TokenLogprob
from mlxr_plugins.apis.openai.decisions import option_probabilities

INPUT = (
    "The build failed on the CI machine because the test for the parser timed out after ten "
    "minutes; the same test passes locally in two seconds. The CI machine has two cores."
)


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[openai.OpenAI]:
    config = Config(models=[ModelConfig(path=str(tiny_model_path), name="tiny")], apis=["openai"])
    with live_server(config) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_option_probabilities_share_a_first_token_and_normalize() -> None:
    first = TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5), (7, -2.0)))
    probabilities = option_probabilities(first, [[5, 1], [5, 2], [6], [9]])
    assert probabilities[0] == probabilities[1] and probabilities[3] == 0.0
    assert sum(probabilities) == pytest.approx(1.0)
    assert probabilities[2] / probabilities[0] == pytest.approx(2 * 2.718281828 ** -1.0)


@pytest.mark.slow
def test_every_kind_of_question_in_one_request(client: openai.OpenAI) -> None:
    questions = [
        {"type": "predicate", "name": "flaky", "instructions": "The failure is caused by the slow machine."},
        {"type": "choice", "name": "area", "instructions": "Which part failed?",
         "choices": [{"value": "parser"}, {"value": "network"}, {"value": True, "description": "everything"}]},
        {"type": "score", "name": "urgency", "instructions": "How urgent is a fix?",
         "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}]},
    ] * 3  # fmt: skip
    decision = client.decisions.create(model="tiny", input=INPUT, questions=questions)
    assert all(a.type in (q["type"], "refusal") for a, q in zip(decision.answers, questions, strict=True))
    for got, asked in zip(decision.answers, questions, strict=True):
        assert got.name == asked["name"]
        if got.type == "predicate":
            assert 0.0 <= got.probability <= 1.0
        elif got.type == "choice":
            assert got.choice in ("parser", "network", True)
            assert sum(p.probability for p in got.probabilities) == pytest.approx(1.0)
            assert got.confidence == next(p.probability for p in got.probabilities if p.value == got.choice)
        elif got.type == "score":
            assert [p.label for p in got.probabilities] == ["low", "medium", "high"]
            assert got.score == pytest.approx(sum(p.value * p.probability for p in got.probabilities))
    # The same question over the same input answers the same (its rows are alike).
    assert decision.answers[0].model_dump() == decision.answers[3].model_dump() == decision.answers[6].model_dump()
    # The input was prefilled once: every row read it from the prefix cache.
    details = decision.usage.input_tokens_details
    assert details.cache_write_tokens >= 16 and details.cached_tokens >= len(questions) * details.cache_write_tokens


@pytest.mark.slow
def test_bad_questions_are_refused_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ([{"type": "choice", "instructions": "which?"}], "questions[0].choices"),
        ([{"type": "predicate", "instructions": "ok"},
          {"type": "score", "instructions": "how?", "levels": [{"label": "a"}, {"label": "a"}]}], "questions[1].levels"),
        ([{"type": "choice", "instructions": "which?", "choices": [{"value": "x"}, {"value": "x"}]}], "questions[0].choices"),
    ]
    for questions, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.decisions.create(model="tiny", input=INPUT, questions=questions)  # type: ignore[arg-type]
        assert error.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.decisions.create(model="tiny", input=INPUT, questions=[{"type": "predicate", "instructions": "x"}] * 401)  # type: ignore[list-item]


def test_an_input_past_the_context_or_the_token_bound_is_refused_before_every_question_is_rendered(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlxr_plugins.apis.openai.decisions as decisions

    long_input = "the build failed again " * 4000  # past the tiny model's context
    with pytest.raises(openai.BadRequestError) as error:
        client.decisions.create(model="tiny", input=long_input, questions=[{"type": "predicate", "instructions": "x"}] * 400)  # type: ignore[list-item]
    assert error.value.body["param"] == "input"  # type: ignore[index]
    monkeypatch.setattr(decisions, "MAX_DECISION_TOKENS", 200)  # the live server runs in this process
    with pytest.raises(openai.BadRequestError) as error:
        client.decisions.create(model="tiny", input=INPUT, questions=[{"type": "predicate", "instructions": "x"}] * 8)  # type: ignore[list-item]
    assert error.value.body["param"] == "questions"  # type: ignore[index]
