"""Relevance scoring: the yes/no logits after each input, batched and chunked as embeddings are,
equal to the model's own logits for that input alone; the engine job that computes them."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.embedding import plan_batches
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams
from mlxr_core.engine.scoring import answer_ids, probability, relevance_messages, score_parts
from mlxr_core.errors import RequestError
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

INPUTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34], [40]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def loaded(tiny_path):
    return load_model(ModelConfig(path=str(tiny_path), dtype="float32"), load_plugins().registries)


def direct(loaded, ids: list[int], yes: list[int], no: list[int]) -> tuple[float, float]:
    """log P(next token in ``yes``) and in ``no`` after ``ids`` alone, one forward pass, in numpy."""
    logits = np.array(loaded.model(mx.array([ids]))[0, -1].astype(mx.float32)).astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    return float(np.log(probs[yes].sum())), float(np.log(probs[no].sum()))


def run(parts):
    while True:
        try:
            next(parts)
        except StopIteration as done:
            return done.value


def test_batches_stay_within_a_chunk_and_long_inputs_run_alone():
    lengths = [11, 2, 5, 1, 3, 3]
    batches = plan_batches(lengths, chunk=8)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert (longest > 8 and len(batch) == 1) or len(batch) * longest <= 8


@pytest.mark.parametrize("chunk", [3, 8, 512])
def test_batched_and_chunked_scores_equal_each_input_alone(loaded, chunk):
    yes, no = answer_ids(loaded.tokenizer)
    logits = run(score_parts(loaded, INPUTS, yes=yes, no=no, chunk=chunk))
    for ids, pair in zip(INPUTS, logits, strict=True):
        np.testing.assert_allclose(pair, direct(loaded, ids, yes, no), atol=1e-3)


def test_probability_is_the_softmax_of_the_two_logits():
    for yes, no in [(2.0, -1.0), (-30.0, 40.0), (5.0, 5.0), (800.0, -800.0)]:
        expected = math.exp(yes) / (math.exp(yes) + math.exp(no)) if abs(yes) < 700 else 1.0
        assert probability(yes, no) == pytest.approx(expected, abs=1e-12)


def test_both_spellings_count_and_yes_and_no_must_differ():
    words = {"yes": [11, 1], "Yes": [12], "no": [13], "No": [13, 2]}
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=False: words[text])
    assert answer_ids(tokenizer) == ([11, 12], [13])
    same = SimpleNamespace(encode=lambda text, add_special_tokens=False: [7, len(text)])
    with pytest.raises(ValueError, match="cannot tell 'yes' from 'no'"):
        answer_ids(same)


def test_the_relevance_prompt_carries_query_document_and_instruction():
    system, user = relevance_messages("rivers of France", "The Loire is long.", "Find facts")
    assert system["role"] == "system" and '"yes" or "no"' in system["content"]
    assert user["content"] == "<Instruct>: Find facts\n<Query>: rivers of France\n<Document>: The Loire is long."


def test_the_engine_scores_on_its_thread_while_generating(tiny_path, loaded):
    models = [ModelConfig(path=str(tiny_path), name="tiny", context_length=32)]
    engine = Engine(Config(models=models, engine=EngineConfig(prefill_chunk=4)), load_plugins())
    engine.start()
    try:
        yes, no = answer_ids(loaded.tokenizer)
        result = engine.score("tiny", INPUTS, timeout=60)
        assert result.model == "tiny" and result.prompt_tokens == sum(map(len, INPUTS))
        for ids, pair, score in zip(INPUTS, result.logits, result.scores, strict=True):
            np.testing.assert_allclose(pair, direct(loaded, ids, yes, no), atol=1e-3)
            assert score == pytest.approx(probability(*pair))

        async def both():
            loop = asyncio.get_running_loop()
            request = GenerationRequest("tiny", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
            handle = engine.submit(request, loop=loop)
            scores = await engine.score_async("tiny", [[5, 6, 7]])
            return scores, [event async for event in handle.events()]

        scores, events = asyncio.run(both())
        assert isinstance(events[-1], Finished)
        np.testing.assert_allclose(scores.logits[0], direct(loaded, [5, 6, 7], yes, no), atol=1e-3)
        with pytest.raises(RequestError, match=r"input\[0\] is empty"):
            engine.score("tiny", [[]])
    finally:
        engine.stop()


def test_the_examples_prompt_asks_after_worked_examples_with_the_instruction_as_system() -> None:
    from mlxr_core.engine.scoring import EXAMPLES

    plain = relevance_messages("q?", "d.", prompt="examples")
    assert [m["role"] for m in plain] == ["user", "assistant"] * len(EXAMPLES) + ["user"]
    assert [m["content"] for m in plain[1::2]] == [answer for _, _, answer in EXAMPLES]
    assert plain[-1]["content"] == "Question: q?\nText: d.\nDoes the text answer the question? Answer yes or no."
    instructed = relevance_messages("q?", "d.", "Match legal clauses.", prompt="examples")
    assert instructed[0] == {"role": "system", "content": "Match legal clauses."} and instructed[1:] == plain
    judged = relevance_messages("q?", "d.")
    assert judged[0]["role"] == "system" and "<Query>: q?" in judged[1]["content"]
