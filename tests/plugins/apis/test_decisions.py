"""``POST /v1/decisions`` through the official ``openai`` client against a live server on a
tiny model: every kind of question answered among its options, probabilities that add up, the
input prefilled once and every question's row reading it from the prefix cache; bad questions
refused naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from scripted import live_server

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.option_scoring import END, allowed_tokens, option_logprobs, probabilities

INPUT = (
    "The build failed on the CI machine because the test for the parser timed out after ten "
    "minutes; the same test passes locally in two seconds. The CI machine has two cores."
)


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[openai.OpenAI]:
    config = Config(models=[ModelConfig(path=str(tiny_model_path), name="tiny")], apis=["openai"])
    with live_server(config) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_option_logprobs_count_every_token_where_options_part() -> None:
    # "1" = [5], "10" = [5, 6], "2" = [7]: after [5] the model chooses between 6 and the end.
    logprobs = {(): {5: math.log(0.6), 7: math.log(0.2)}, (5,): {6: math.log(0.3), END: math.log(0.1)}}
    scores = option_logprobs([[5], [5, 6], [7]], logprobs)
    want = [0.75 * 0.25, 0.75 * 0.75, 0.25]  # 0.6 / (0.6 + 0.2) = 0.75; 0.1 / (0.3 + 0.1) = 0.25
    assert probabilities(scores) == pytest.approx(want)
    assert allowed_tokens([[5], [5, 6], [7]]) == {(): {5, 7}, (5,): {6, END}, (5, 6): {END}, (7,): {END}}


def test_options_sharing_tokens_are_scored_by_all_of_them_as_transformers_computes(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Options 1, 10, 100 and 2 on a tokenizer that writes 10 as 1, 0: each option's probability
    from every token it takes (and the end where another option goes on), against the tiny
    model's distributions from transformers reading the same GGUF; and with a random LoRA adapter
    served as a model of its own, against PEFT's model with that adapter (the rows and the scoring
    run with it, not with the base)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pytest.importorskip("accelerate", reason="transformers reads a GGUF file only with accelerate installed")
    from litestar.testing import TestClient

    from mlxr_core.chat.tools import model_parsers, prepare_chat
    from mlxr_core.config.schema import AdapterConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.server import build_app
    from mlxr_core.plugins import load_plugins
    from mlxr_plugins.apis.openai.decisions import ChoiceOption, QuestionFields, question_text

    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_path.parent), gguf_file=tiny_model_path.name, dtype=torch.float32
    ).eval()
    torch.manual_seed(0)
    settings = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    reference = peft.get_peft_model(base, settings)
    with torch.no_grad():  # O(1) updates: PEFT's own B starts at zero
        for key, parameter in reference.named_parameters():
            if "lora_" in key:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
    reference.save_pretrained(str(tmp_path / "adapter"))
    model = ModelConfig(path=str(tiny_model_path), name="tiny", dtype="float32",
                        adapters=[AdapterConfig("rand", str(tmp_path / "adapter"))])  # fmt: skip
    config = Config(models=[model], apis=["openai"])
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        ctx = ServerContext(config=config, host=host, engine=engine)
        info = engine.model("tiny")
        values = ["1", "10", "100", "2"]
        options = [info.tokenizer.encode(value, add_special_tokens=False) for value in values]
        assert options[1][0] == options[0][0] and options[2][:2] == options[1]  # digits split
        question = {"type": "choice", "instructions": "How many?", "choices": [{"value": v} for v in values]}
        fields = QuestionFields(type="choice", instructions="How many?", choices=[ChoiceOption(v) for v in values])
        text = question_text(fields, values, "q")
        messages = [{"role": "user", "content": INPUT}, {"role": "user", "content": text}]
        prompt = prepare_chat(info, model_parsers(ctx, info), messages).prompt_ids
        end = sorted(info.tokenizer.eos_token_ids)

        def distribution(prefix: list[int], adapter: bool) -> Any:
            with torch.no_grad():
                if adapter:
                    logits = reference(torch.tensor([prompt + prefix])).logits
                else:
                    with reference.disable_adapter():
                        logits = reference(torch.tensor([prompt + prefix])).logits
            return torch.log_softmax(logits[0, -1].double(), dim=-1)

        def constrained(option: list[int], adapter: bool) -> float:
            """log P(option) as a decode constrained to the options reads it, step by step."""
            total = 0.0
            for i in range(len(option) + 1):
                prefix = option[:i]
                ways = {o[i] if i < len(o) else -1 for o in options if o[:i] == prefix and len(o) >= i}
                if len(ways) < 2:
                    continue
                logprobs = distribution(prefix, adapter)
                value = {w: float(logprobs[w]) if w >= 0 else float(torch.logsumexp(logprobs[end], 0)) for w in ways}
                chosen = option[i] if i < len(option) else -1
                total += value[chosen] - math.log(sum(math.exp(v) for v in value.values()))
            return total

        got = {}
        with TestClient(build_app(ctx)) as client:
            for name, adapter in (("tiny", False), ("tiny:rand", True)):
                want = [math.exp(constrained(option, adapter)) for option in options]
                assert sum(want) == pytest.approx(1.0)
                r = client.post("/v1/decisions", json={"model": name, "input": INPUT, "questions": [question]})
                assert r.status_code == 200, r.text
                answer = r.json()["answers"][0]
                assert answer["type"] == "choice", answer  # the constrained row answered an option
                got[name] = [p["probability"] for p in answer["probabilities"]]
                assert got[name] == pytest.approx(want, rel=1e-3, abs=1e-6), name
                assert answer["choice"] == values[max(range(len(want)), key=want.__getitem__)]
        assert got["tiny"][0] != pytest.approx(got["tiny"][1])  # 1 and 10 no longer share their first token's probability
        assert got["tiny:rand"] != pytest.approx(got["tiny"], rel=1e-2)  # the adapter's scores, not the base's
    finally:
        engine.stop()


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


@pytest.mark.slow
def test_decisions_with_the_engine_in_a_process_of_its_own_answer_as_in_process(tiny_model_path: Path) -> None:
    """``engine.core: process``: the option scoring job crosses the pipe, and every kind of
    question gets the answers and probabilities the engine thread gives (marked slow: it starts
    an engine process)."""
    from litestar.testing import TestClient

    from mlxr_core.config.schema import EngineConfig
    from mlxr_core.engine.remote import RemoteEngine, make_engine
    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.server import build_app
    from mlxr_core.plugins import load_plugins

    questions = [
        {"type": "predicate", "instructions": "The failure is caused by the slow machine."},
        {"type": "choice", "instructions": "How many cores?", "choices": [{"value": v} for v in ("1", "10", "100", "2")]},
        {"type": "score", "instructions": "How urgent is a fix?", "levels": [{"label": "low"}, {"label": "high"}]},
    ]  # fmt: skip
    answers = {}
    for core in ("thread", "process"):
        model = ModelConfig(path=str(tiny_model_path), name="tiny", dtype="float32")
        config = Config(models=[model], engine=EngineConfig(core=core), apis=["openai"])
        host = load_plugins()
        engine = make_engine(config, host)
        assert isinstance(engine, RemoteEngine) == (core == "process")
        engine.start()
        try:
            with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
                r = client.post("/v1/decisions", json={"model": "tiny", "input": INPUT, "questions": questions})
        finally:
            engine.stop()
        assert r.status_code == 200, r.text
        answers[core] = r.json()["answers"]
    assert [a["type"] for a in answers["process"]] == ["predicate", "choice", "score"]
    for thread, process in zip(answers["thread"], answers["process"], strict=True):
        assert process.keys() == thread.keys()
        for key, value in thread.items():
            if key == "probabilities":
                assert [p["probability"] for p in process[key]] == pytest.approx([p["probability"] for p in value], rel=1e-5)
            elif isinstance(value, float):
                assert process[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert process[key] == value, key
