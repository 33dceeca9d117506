"""Ollama's create over a served model, through the official ``ollama`` client on a real socket:
a PEFT adapter's files uploaded as blobs and created over the tiny base serve as a model of their
own (its tokens equal PEFT's merged model's), ``/api/tags`` lists it with its parent, a bad
adapter is refused naming the tensor while the base serves on, ``/api/delete`` stops serving it;
an older client's Modelfile (``FROM``, ``ADAPTER``) too; every route behind the admin key."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from scripted import live_server

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, ServerConfig

pytest.importorskip("torch", reason="the reference needs torch (CPU)")
pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("peft", reason="the reference needs peft")

from mlxr_core.testing.lora_reference import LoraReference, lora_reference

pytestmark = pytest.mark.slow  # starts a server
KEY = "sk-admin"
TOKENS = 6
OPTIONS = {"num_predict": TOKENS, "temperature": 0}
PROMPT = "t5 t9 t17 t33 t2 t71"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> LoraReference:
    return lora_reference(tmp_path_factory.mktemp("lora"), [[5, 9, 17]])


@pytest.fixture(scope="module")
def url(reference: LoraReference, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXR_DATA_DIR", str(tmp_path_factory.mktemp("data")))
        model = ModelConfig(path=str(reference.base), name="tiny", dtype="float32", context_length=128,
                            runtime_adapters=True, max_adapters=2)  # fmt: skip
        config = Config(models=[model], server=ServerConfig(api_keys=[KEY]), engine=EngineConfig(max_batch_size=4),
                        apis=["ollama"])  # fmt: skip
        with live_server(config) as served:
            yield served


def client(url: str, key: str | None = KEY) -> Any:
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def upload(api: Any, folder: Path) -> dict[str, str]:
    return {file.name: api.create_blob(file) for file in sorted(folder.iterdir()) if file.is_file()}


def generated(api: Any, model: str) -> tuple[list[int], list[int]]:
    """The prompt's ids and the greedy reply's, from ``context``."""
    reply = api.generate(model=model, prompt=PROMPT, raw=True, options=OPTIONS)
    assert reply.eval_count == TOKENS
    return list(reply.context[:-TOKENS]), list(reply.context[-TOKENS:])


def peft_greedy(reference: LoraReference, name: str | None, prompt: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = reference.merged(name).generate(torch.tensor([prompt]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                              do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_create_list_generate_delete(url: str, reference: LoraReference) -> None:
    api = client(url)
    status = api.create(model="tiny-qv", from_="tiny", adapters=upload(api, reference.root / "qv"))
    assert status.status == "success"
    listed = {m.model: m for m in api.list().models}
    assert listed["tiny-qv"].details.parent_model == "tiny" and "tiny" in listed
    prompt, tokens = generated(api, "tiny-qv:latest")
    assert tokens == peft_greedy(reference, "qv", prompt)
    assert generated(api, "tiny")[1] == peft_greedy(reference, None, prompt)
    # created again under its name with another adapter: replaced
    streamed = list(api.create(model="tiny-qv", from_="tiny", adapters=upload(api, reference.root / "all"), stream=True))
    assert streamed[-1].status == "success"
    assert generated(api, "tiny-qv")[1] == peft_greedy(reference, "all", prompt)
    assert api.delete("tiny-qv").status == "success"
    assert "tiny-qv" not in {m.model for m in api.list().models}
    with pytest.raises(ollama.ResponseError) as missing:
        api.generate(model="tiny-qv", prompt=PROMPT, raw=True, options=OPTIONS)
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as configured:
        api.delete("tiny")
    assert configured.value.status_code == 400


def test_a_bad_adapter_is_refused_naming_the_tensor(url: str, reference: LoraReference, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(reference.root / "mlp", bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    name = next(key for key in sorted(tensors) if key.endswith("up_proj.lora_A.weight"))
    tensors[name] = tensors[name][:, :-8].copy()  # narrower than the layer's inputs
    save_file(tensors, bad / "adapter_model.safetensors")
    api = client(url)
    with pytest.raises(ollama.ResponseError) as refused:
        api.create(model="tiny-bad", from_="tiny", adapters=upload(api, bad))
    assert refused.value.status_code == 400 and name in refused.value.error
    assert "tiny-bad" not in {m.model for m in api.list().models}
    assert generated(api, "tiny")[1]  # the base serves on
    with pytest.raises(ollama.ResponseError) as over_an_adapter:
        api.create(model="x", from_="nope", adapters=upload(api, reference.root / "qv"))
    assert over_an_adapter.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as unsupported:
        api.create(model="x", from_="tiny", system="be brief")
    assert unsupported.value.status_code == 400 and "system" in unsupported.value.error


def test_modelfile_and_the_admin_key(url: str, reference: LoraReference) -> None:
    body = {"model": "tiny-mlp", "modelfile": f"FROM tiny\nADAPTER {reference.root / 'mlp'}\n", "stream": False}
    assert httpx.post(f"{url}/api/create", json=body).status_code == 401
    headers = {"authorization": f"Bearer {KEY}"}
    reply = httpx.post(f"{url}/api/create", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200 and reply.json() == {"status": "success"}
    api = client(url)
    prompt, tokens = generated(api, "tiny-mlp")
    assert tokens == peft_greedy(reference, "mlp", prompt)
    bad = {**body, "modelfile": "FROM tiny\nADAPTER /x\nPARAMETER temperature 0\n"}
    reply = httpx.post(f"{url}/api/create", json=bad, headers=headers)
    assert reply.status_code == 400 and "PARAMETER" in reply.json()["error"]
    digest = "sha256:" + "0" * 64
    assert httpx.post(f"{url}/api/blobs/{digest}", content=b"x", headers=headers).status_code == 400  # not its digest
    assert httpx.head(f"{url}/api/blobs/{digest}", headers=headers).status_code == 404
    assert json.loads(httpx.request("DELETE", f"{url}/api/delete", json={"model": "tiny-mlp"}).text)["error"]
    assert api.delete("tiny-mlp").status == "success"
