"""LoRA adapters through the OpenAI API: listed by /v1/models with their parent, served as models
of their own (against PEFT's merged model), loaded and unloaded through the admin routes behind
the API keys, an unknown adapter a 404."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from mlxr_core.config.schema import AdapterConfig, Config, EngineConfig, ModelConfig, ServerConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

pytest.importorskip("torch", reason="the reference needs torch (CPU)")
pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("peft", reason="the reference needs peft")

from mlxr_core.testing.lora_reference import LoraReference, lora_reference

KEY = "sk-lora"
PROMPT = [5, 9, 17, 33, 2, 71, 40, 8, 13]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> LoraReference:
    return lora_reference(tmp_path_factory.mktemp("lora"), [PROMPT])


@pytest.fixture(scope="module")
def client(reference: LoraReference) -> Iterator[TestClient[Any]]:
    model = ModelConfig(path=str(reference.base), name="tiny", dtype="float32", context_length=128, max_adapters=2,
                        adapters=[AdapterConfig(name, str(reference.root / name)) for name in ("qv", "all", "mlp")])  # fmt: skip
    config = Config(models=[model], server=ServerConfig(api_keys=[KEY]), engine=EngineConfig(max_batch_size=4),
                    apis=["openai", "ollama"])  # fmt: skip
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(
            build_app(ServerContext(config=config, host=host, engine=engine))
        ) as test_client:
            test_client.headers["authorization"] = f"Bearer {KEY}"
            yield test_client
    finally:
        engine.stop()


def completion(client: TestClient[Any], model: str, **extra: Any) -> Any:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        **extra,
    }
    return client.post("/v1/completions", json=body)


def greedy(reference: LoraReference, name: str | None) -> list[int]:
    import torch

    with torch.no_grad():
        out = reference.merged(name).generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                              do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


def tokens(reply: Any) -> list[int]:
    assert reply.status_code == 200, reply.text
    special = {"<s>": 0, "</s>": 1}  # the tiny vocabulary: <s>, </s>, then t2, t3, ...
    return [
        special[t.strip()] if t.strip() in special else int(t.strip().removeprefix("t"))
        for t in reply.json()["choices"][0]["logprobs"]["tokens"]
    ]


def test_listed_with_parent(client: TestClient[Any]) -> None:
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert {name: cards[name].get("parent") for name in ("tiny", "tiny:qv", "tiny:all", "tiny:mlp")} == {
        "tiny": None, "tiny:qv": "tiny", "tiny:all": "tiny", "tiny:mlp": "tiny",
    }  # fmt: skip
    assert client.get("/v1/models/tiny:all").json()["parent"] == "tiny"
    assert cards["tiny:qv"]["capabilities"] == cards["tiny"]["capabilities"] == ["completion"]


def test_served_as_models(client: TestClient[Any], reference: LoraReference) -> None:
    for name in ("qv", "mlp", None):  # mlp is not resident at first (max_adapters 2): loaded for it
        assert tokens(completion(client, f"tiny:{name}" if name else "tiny")) == greedy(
            reference, name
        ), name
    missing = completion(client, "tiny:nope")
    assert missing.status_code == 404


def test_admin_load_and_unload(client: TestClient[Any], reference: LoraReference) -> None:
    assert client.post("/v1/models/tiny:all/unload", json={}).json() == {
        "id": "tiny:all",
        "loaded": False,
        "object": "model",
    }
    assert client.post("/v1/models/tiny:all/load", json={}).json()["loaded"] is True
    assert tokens(completion(client, "tiny:all")) == greedy(reference, "all")
    refused = client.post("/v1/models/tiny:qv/unload", json={}, headers={"authorization": ""})
    assert refused.status_code == 401


def test_embeddings_of_an_adapter_refused(client: TestClient[Any]) -> None:
    reply = client.post("/v1/embeddings", json={"model": "tiny:qv", "input": "t5 t6 t7"})
    assert reply.status_code == 400 and "LoRA adapter" in reply.json()["error"]["message"]
    assert (
        client.post("/v1/embeddings", json={"model": "tiny", "input": "t5 t6 t7"}).status_code
        == 200
    )


def test_ollama_generate_with_an_adapter(client: TestClient[Any]) -> None:
    """Ollama's tag syntax is the adapter's separator: tiny:qv runs the adapter, as OpenAI's does."""
    prompt = " ".join(f"t{t}" for t in PROMPT)
    options = {"num_predict": 6, "temperature": 0}
    texts = {}
    for model in ("tiny:qv", "tiny"):
        body = {"model": model, "prompt": prompt, "raw": True, "stream": False, "options": options}
        reply = client.post("/api/generate", json=body)
        assert reply.status_code == 200, reply.text
        openai = client.post(
            "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
        )
        assert reply.json()["response"] == openai.json()["choices"][0]["text"], model
        texts[model] = reply.json()["response"]
    assert texts["tiny:qv"] != texts["tiny"]
    refused = client.post("/api/embed", json={"model": "tiny:qv", "input": "t5 t6"})
    assert refused.status_code == 400


def test_an_adapter_load_past_the_wait_is_a_503(client: TestClient[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that does not answer an adapter's load within engine.model_load_wait_s: a 503
    naming the setting (it was a 500 with a traceback)."""
    import concurrent.futures

    ctx: ServerContext = client.app.state["mlxr"]
    monkeypatch.setattr(ctx.config.engine, "model_load_wait_s", 0.05)
    monkeypatch.setattr(ctx.engine, "administer_adapter", lambda name, action: concurrent.futures.Future())
    r = client.post("/v1/models/tiny:mlp/load", json={})
    assert r.status_code == 503 and "model_load_wait_s" in r.text


def test_per_request_scales(client: TestClient[Any], reference: LoraReference) -> None:
    """llama.cpp's lora ([{id, scale}], ids in models[].adapters order: qv, all, mlp) on the base
    model and mlxr's lora_scale on an adapter's name run the adapter at that scale: PEFT's merge
    with its layers' scaling times it; every adapter at 0 is the base."""
    import torch

    with torch.no_grad():
        out = reference.merged("all", 0.5).generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                                     do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    want = out[0, len(PROMPT) :].tolist()
    assert want != greedy(reference, "all")
    assert tokens(completion(client, "tiny", lora=[{"id": 1, "scale": 0.5}, {"id": 0, "scale": 0}])) == want
    assert tokens(completion(client, "tiny:all", lora_scale=0.5)) == want
    assert tokens(completion(client, "tiny", lora=[{"id": 2, "scale": 0.0}])) == greedy(reference, None)
    refused = {
        "lora": completion(client, "tiny", lora=[{"id": 0, "scale": 1}, {"id": 1, "scale": 1}]),
        "lora[0].id": completion(client, "tiny", lora=[{"id": 7, "scale": 1}]),
        "lora_scale": completion(client, "tiny", lora_scale=0.5),
    }
    for param, reply in refused.items():
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert completion(client, "tiny:qv", lora=[{"id": 0, "scale": 1}]).status_code == 400
    assert completion(client, "tiny:qv", lora_scale=99).status_code == 400
