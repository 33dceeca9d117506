"""LoRA adapters served as models of their own through the engine: 8 concurrent streams over 3
adapters and the base decode in one batch, each equal to the same request served alone and to
PEFT's merged model; the prefix cache keeps adapters apart; a bad adapter is refused while the
base and the other adapters keep serving; adapters beyond ``max_adapters`` take turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxr_core.config.schema import (
    AdapterConfig,
    Config,
    EngineConfig,
    KVCacheConfig,
    ModelConfig,
    PrefixCacheConfig,
)
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.plugins import load_plugins

pytest.importorskip("torch", reason="the reference needs torch (CPU)")
pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("peft", reason="the reference needs peft")

from mlxr_core.testing.lora_reference import ADAPTERS, LoraReference, lora_reference

rng = np.random.default_rng(3)
PROMPTS = [rng.integers(2, 96, 20).tolist() for _ in range(8)]
#: Stream i's model: each adapter and the base twice.
MODELS = ["tiny:qv", "tiny:all", "tiny:mlp", "tiny"] * 2
TOKENS = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> LoraReference:
    return lora_reference(tmp_path_factory.mktemp("lora"), PROMPTS[:1])


def start(
    reference: LoraReference,
    *,
    adapters: dict[str, Path] | None = None,
    kv_cache: Any = None,
    **engine: Any,
) -> Engine:
    folders = adapters or {name: reference.root / name for name in ADAPTERS}
    model = ModelConfig(
        path=str(reference.base), name="tiny", dtype="float32", context_length=128,
        adapters=[AdapterConfig(name, str(path)) for name, path in folders.items()],
        max_adapters=engine.pop("max_adapters", 4), kv_cache=kv_cache,
    )  # fmt: skip
    eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
    eng.start()
    return eng


def request(model: str, prompt: list[int], scale: float = 1.0) -> GenerationRequest:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, extra={"ignore_eos": True})
    return GenerationRequest(model=model, prompt_ids=list(prompt), params=params, adapter_scale=scale)


def tokens_of(handle: Any) -> list[int]:
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def peft_greedy(reference: LoraReference, name: str | None, prompt: list[int]) -> list[int]:
    import torch

    model = reference.merged(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_streams_over_adapters_batch_and_match_alone(reference: LoraReference) -> None:
    alone_engine = start(reference, max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        alone = [
            tokens_of(alone_engine.submit(request(m, p)))
            for m, p in zip(MODELS, PROMPTS, strict=True)
        ]
    finally:
        alone_engine.stop()
    eng = start(reference, max_batch_size=8)
    try:
        handles = [eng.submit(request(m, p)) for m, p in zip(MODELS, PROMPTS, strict=True)]
        together = [tokens_of(handle) for handle in handles]
        steps = eng.stats()["steps"]
    finally:
        eng.stop()
    assert together == alone
    assert steps < 8 * TOKENS  # the streams decoded together, not one after another
    for model, prompt, tokens in list(zip(MODELS, PROMPTS, alone, strict=True))[:4]:
        adapter = model.partition(":")[2] or None
        assert tokens == peft_greedy(reference, adapter, prompt), model
    # the same prompt under each adapter: four different continuations
    eng = start(reference)
    try:
        same = [tokens_of(eng.submit(request(m, PROMPTS[0]))) for m in MODELS[:4]]
    finally:
        eng.stop()
    assert len({tuple(tokens) for tokens in same}) == 4


def test_quantized_kv(reference: LoraReference) -> None:
    """Keys and values stored 8-bit: streams over adapters batched equal each alone."""
    kv = KVCacheConfig(bits=8, group_size=32)
    alone_engine = start(
        reference, kv_cache=kv, max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False)
    )
    try:
        alone = [
            tokens_of(alone_engine.submit(request(m, p)))
            for m, p in zip(MODELS[:4], PROMPTS[:4], strict=True)
        ]
    finally:
        alone_engine.stop()
    eng = start(reference, kv_cache=kv, max_batch_size=4)
    try:
        together = [
            tokens_of(h)
            for h in [
                eng.submit(request(m, p)) for m, p in zip(MODELS[:4], PROMPTS[:4], strict=True)
            ]
        ]
    finally:
        eng.stop()
    assert together == alone


def test_prefix_cache_is_keyed_by_adapter(reference: LoraReference) -> None:
    system = [(i * 13) % 90 + 3 for i in range(40)]
    prompt = [*system, 7, 8, 9]
    eng = start(reference)
    try:
        first = tokens_of(eng.submit(request("tiny:qv", prompt)))
        other = list(eng.submit(request("tiny:all", prompt)))  # another adapter: nothing reused
        again = list(eng.submit(request("tiny:qv", prompt)))  # the same adapter: the prompt reused
    finally:
        eng.stop()
    assert other[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens > 0
    assert [t for e in again if isinstance(e, Delta) for t in e.token_ids] == first
    assert [t for e in other if isinstance(e, Delta) for t in e.token_ids] == peft_greedy(
        reference, "all", prompt
    )


def test_bad_adapter_refused_others_serve(reference: LoraReference, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(reference.root / "qv" / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name] = tensors[name][:8].copy()  # 8 output rows where v_proj has 32
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config = json.loads((reference.root / "qv" / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    folders = {"bad": tmp_path, "all": reference.root / "all"}
    eng = start(reference, adapters=folders)
    try:
        failed = list(eng.submit(request("tiny:bad", PROMPTS[0])))
        served = tokens_of(eng.submit(request("tiny:all", PROMPTS[0])))
        base = tokens_of(eng.submit(request("tiny", PROMPTS[0])))
    finally:
        eng.stop()
    assert isinstance(failed[-1], Failed) and name in str(failed[-1].error)
    assert served == peft_greedy(reference, "all", PROMPTS[0])
    assert base == peft_greedy(reference, None, PROMPTS[0])


def test_more_adapters_than_slots_take_turns(reference: LoraReference) -> None:
    eng = start(reference, max_adapters=1, max_batch_size=8)
    try:
        handles = [eng.submit(request(m, p)) for m, p in zip(MODELS, PROMPTS, strict=True)]
        got = [tokens_of(handle) for handle in handles]
        footprint = eng.lifecycle.slots["tiny"].footprint if eng.lifecycle is not None else 0
    finally:
        eng.stop()
    for model, prompt, tokens in list(zip(MODELS, PROMPTS, got, strict=True))[:4]:
        assert tokens == peft_greedy(reference, model.partition(":")[2] or None, prompt), model
    assert footprint > 0


def test_rows_at_different_scales_batch_and_match_alone(reference: LoraReference) -> None:
    """Streams of one adapter at different scales (and another adapter, and the base) decode in
    one batch, each equal to it served alone; a scale's tokens equal PEFT's merge at that scale."""
    rows = [("tiny:all", 0.5), ("tiny:all", 2.0), ("tiny:all", 1.0), ("tiny:qv", 0.3), ("tiny", 1.0), ("tiny:all", 0.0)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    alone_engine = start(reference, max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        alone = [tokens_of(alone_engine.submit(request(m, p, s))) for (m, s), p in zip(rows, prompts, strict=True)]
    finally:
        alone_engine.stop()
    eng = start(reference, max_batch_size=8)
    try:
        handles = [eng.submit(request(m, p, s)) for (m, s), p in zip(rows, prompts, strict=True)]
        together = [tokens_of(handle) for handle in handles]
        steps = eng.stats()["steps"]
        # the prefix cache keys a prompt by its adapter's scale too: the same prompt at 0.5 again
        again = tokens_of(eng.submit(request("tiny:all", PROMPTS[0], 0.5)))
        with pytest.raises(RequestError, match="adapter scale"):
            eng.submit(request("tiny", PROMPTS[0], 0.5))
    finally:
        eng.stop()
    assert together == alone and again == alone[0]
    assert steps < len(rows) * TOKENS
    assert len({tuple(tokens) for tokens in together[:3]}) == 3  # three scales, three continuations
    assert together[5] == peft_greedy(reference, None, PROMPTS[3])  # scale 0: the base's tokens
    import torch

    with torch.no_grad():
        out = reference.merged("all", 0.5).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=TOKENS,
                                                     min_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                                                     eos_token_id=None)  # fmt: skip
    assert together[0] == out[0, len(PROMPTS[0]) :].tolist()


def test_adapter_created_in_an_engine_process(reference: LoraReference) -> None:
    """An adapter created while serving (Ollama's create) over a model with runtime_adapters, on an
    engine in a process of its own: the caller serves its name (the core's snapshot carries it),
    its tokens and those at scale 0.5 equal PEFT's merges; deleted, the name is gone."""
    import torch

    from mlxr_core.engine.remote import make_engine

    model = ModelConfig(path=str(reference.base), name="tiny", dtype="float32", context_length=128,
                        runtime_adapters=True)  # fmt: skip
    eng = make_engine(Config(models=[model], engine=EngineConfig(core="process", max_batch_size=4)), load_plugins())
    eng.start()
    try:
        assert eng.create_adapter("tiny", "pirate", str(reference.root / "qv")).result(120) is True
        assert eng.adapters == {"pirate": ("tiny", "pirate")}
        got = [tokens_of(eng.submit(request("pirate", PROMPTS[0], scale))) for scale in (1.0, 0.5)]
        assert eng.create_adapter("tiny", "pirate", None).result(120) is False
        assert "pirate" not in eng.adapters
    finally:
        eng.stop()
    for tokens, scale in zip(got, (1.0, 0.5), strict=True):
        with torch.no_grad():
            out = reference.merged("qv", scale).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=TOKENS,
                                                          min_new_tokens=TOKENS, do_sample=False, pad_token_id=0,
                                                          eos_token_id=None)  # fmt: skip
        assert tokens == out[0, len(PROMPTS[0]) :].tolist(), scale
