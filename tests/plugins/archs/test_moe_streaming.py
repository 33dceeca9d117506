"""Experts streamed from the checkpoint files (``models[].experts.residency: stream``) against the
same model fully resident: tiny Qwen3-MoE, Mixtral and DeepSeek-V3 folders written by transformers
(one tensor per expert), their llama.cpp GGUF (experts stacked, F32 and Q8_0), served by the engine
with continuous batching, a cache smaller than the experts (evictions happen), 64 greedy tokens
per stream; and what an unreadable file does mid-serving."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest
from test_moe_reference import BASE, FAMILIES, write_moe_gguf

from mlxr_core.config.schema import (
    Config,
    EngineConfig,
    ExpertsConfig,
    ModelConfig,
    SpeculationConfig,
)
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest, SamplingParams
from mlxr_core.model.experts.layer import StreamedExperts
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import family_reference, greedy_tokens

STREAMED = ("qwen3_moe", "mixtral")
DEEPSEEK = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
}  # fmt: skip
PROMPTS = [[5, 17, 33, 8, 2, 61, 40, 11], [9, 8, 7], [70, 3, 3, 21, 44, 90, 1, 5, 6, 12, 13], [7, 3]]
TOKENS = 64


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


@pytest.fixture(scope="module", params=[*STREAMED, "deepseek_v3"])
def reference(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v3":
        families = {"deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", {})}
        return family_reference(families, DEEPSEEK, "deepseek_v3", folder)
    return family_reference(FAMILIES, BASE, request.param, folder)


def expert_bytes(path: Path, plugins) -> int:
    """Bytes of every expert as the streamed model holds them (the cache's unit)."""
    loaded = load_model(ModelConfig(path=str(path), dtype="float32", experts=ExpertsConfig(residency="stream")),
                        plugins.registries)  # fmt: skip
    try:
        layers = [m for _, m in loaded.model.named_modules() if isinstance(m, StreamedExperts)]
        assert layers and loaded.nbytes < loaded.metadata["resident_bytes"] + 1
        store = loaded.experts
        entry = store._entry(0, store._read((0, 0))[0])
        return sum(a.nbytes for a in entry.values()) * layers[0].experts * len(layers)
    finally:
        loaded.experts.close()


def serve(path: Path, plugins, prompts=PROMPTS, tokens=TOKENS, **experts):
    """Greedy tokens of ``prompts`` served together (continuous batching), the model's expert
    counts, and each stream's failure (None when it finished)."""
    model = ModelConfig(path=str(path), name="moe", dtype="float32", context_length=128,
                        experts=ExpertsConfig(**experts))  # fmt: skip
    engine = Engine(Config(models=[model], engine=EngineConfig(max_batch_size=4, prefill_chunk=8)), plugins)
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, extra={"ignore_eos": True})
        handles = [engine.submit(GenerationRequest(model="moe", prompt_ids=p, params=params)) for p in prompts]
        outputs, failures = [], []
        for handle in handles:
            events = list(handle)
            failures.append(events[-1].error if isinstance(events[-1], Failed) else None)
            assert isinstance(events[-1], (Finished, Failed)), events[-1]
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
        return outputs, engine.stats()["experts"].get("moe"), failures
    finally:
        engine.stop()


#: The read-ahead each family streams with: every setting covered once.
PREFETCH = {"qwen3_moe": "router", "mixtral": "previous", "deepseek_v3": "none"}


def test_streamed_experts_give_the_resident_tokens(reference, plugins):
    """64 greedy tokens of four streams batched, with a third of the experts cached, as resident."""
    prefetch = PREFETCH[reference.config["model_type"]]
    budget = expert_bytes(reference.folder, plugins) // 3
    resident, _, _ = serve(reference.folder, plugins)
    streamed, stats, failures = serve(reference.folder, plugins, residency="stream", cache_bytes=budget,
                                      prefetch=prefetch)  # fmt: skip
    assert failures == [None] * 4
    assert [len(out) for out in resident] == [TOKENS] * 4
    assert streamed == resident
    assert stats["evictions"] > 0 and stats["misses"] > 0 and stats["cache_bytes"] <= budget
    assert stats["bytes_read"] > 0 and stats["tokens"] >= TOKENS * 4
    assert stats["hits"] + stats["waits"] + stats["misses"] == stats["requests"]


def gguf_model(path: Path, plugins, policy: str, cache_bytes: int | None = None):
    """The GGUF at ``path`` built as the loader builds it (the file has no tokenizer, which
    ``load_model`` wants), its experts streamed into ``cache_bytes`` when given; and the store."""
    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.experts.store import ExpertStore
    from mlxr_core.model.experts.wiring import is_expert_tensor
    from mlxr_core.model.loader import build_model
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

    fmt = GGUFFormat()
    checkpoint = fmt.load(path) if cache_bytes is None else fmt.load_leaving(path, is_expert_tensor)
    arch = plugins.registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(plugins.registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config))
    store = None if cache_bytes is None else ExpertStore(ExpertsConfig("stream", cache_bytes), mx.float32)
    return build_model(checkpoint, arch, kernels, policy, "float32", experts=store), arch, store


def greedy_rows(model, arch, prompts: list[list[int]], count: int) -> list[list[int]]:
    """``count`` greedy tokens of equally long ``prompts`` decoded together, one batch."""
    cache = arch.make_cache(model)
    step = model(mx.array(prompts), cache=cache)[:, -1]
    rows: list[list[int]] = [[] for _ in prompts]
    for _ in range(count):
        following = mx.argmax(step, axis=-1)
        for row, token in zip(rows, following.tolist(), strict=True):
            row.append(token)
        step = model(following[:, None], cache=cache)[:, -1]
    return rows


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_streamed_gguf_experts_give_the_resident_tokens(reference, plugins, tmp_path, quant):
    """llama.cpp's stacked experts, F32 and Q8_0 (kept packed, and dequantized as they are read),
    64 greedy tokens of three rows decoded together, with a third of the experts cached."""
    if reference.config["model_type"] not in STREAMED:
        pytest.skip("mlxr reads no deepseek2 GGUF")
    path = write_moe_gguf(tmp_path / f"moe-{quant}.gguf", reference, quant=quant)
    prompts = [[5, 17, 33, 8], [70, 3, 3, 21], [9, 8, 7, 1]]
    for policy in ("keep", "dequantize") if quant == "q8_0" else ("dequantize",):
        model, arch, _ = gguf_model(path, plugins, policy)
        resident = greedy_rows(model, arch, prompts, TOKENS)
        _, _, probe = gguf_model(path, plugins, policy, 1)
        entry = probe._entry(0, probe._read((0, 0))[0])
        budget = sum(a.nbytes for a in entry.values()) * len(probe.layers) * reference.config["num_experts_per_tok"] * 2
        probe.close()
        model, arch, store = gguf_model(path, plugins, policy, budget)
        try:
            assert greedy_rows(model, arch, prompts, TOKENS) == resident, policy
            stats = store.stats()
            assert stats["evictions"] > 0 and stats["bytes_read"] > 0, stats
        finally:
            store.close()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return family_reference(FAMILIES, BASE, "mixtral", tmp_path_factory.mktemp("mixtral"))


def expert_sets(loaded, prompts: list[list[int]], count: int) -> list[set[tuple[int, int]]]:
    """The (layer, expert) pairs each prompt's solo greedy decoding reads, through the store."""
    store, seen = loaded.experts, []
    fetch = store.fetch

    def recording(layer, needed, ahead=None):
        seen[-1].update((layer, expert) for expert in needed)
        return fetch(layer, needed, ahead)

    store.fetch = recording
    for prompt in prompts:
        seen.append(set())
        greedy_tokens(loaded, prompt, count)
    store.fetch = fetch
    return seen


@pytest.mark.parametrize("drafting", [False, True])
def test_an_unreadable_expert_file_fails_only_the_requests_that_need_it(mixtral, plugins, tmp_path, caplog, drafting):
    """One expert's tensors in a shard of their own, truncated after the model loaded: the
    streams that route to it fail with an error naming the file (logged once), the others finish
    with the resident model's tokens; also when the batch verifies drafts (prompt lookup)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    # Each prompt repeats a pair, which prompt lookup drafts from.
    count, prompts = 6, [[5, 17, 5, 17], [9, 8, 9, 8], [70, 3, 70, 3], [7, 3, 7, 3], [40, 41, 40, 41], [88, 2, 88, 2]]
    probe = load_model(ModelConfig(path=str(mixtral.folder), dtype="float32",
                                   experts=ExpertsConfig("stream", cache_bytes=1)), plugins.registries)  # fmt: skip
    try:
        seen = expert_sets(probe, prompts, count)
    finally:
        probe.experts.close()
    # An expert some prompts read and others never do (the weights are fixed: so is the choice).
    layer, expert = next(key for key in sorted(set().union(*seen)) if 0 < sum(key in s for s in seen) < len(seen))
    broken = [key_set for key_set in seen if (layer, expert) in key_set]
    assert broken and len(broken) < len(prompts)

    folder = tmp_path / "split"
    shutil.copytree(mixtral.folder, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = load_file(mixtral.folder / "model.safetensors")
    own = {name for name in tensors if f".layers.{layer}.block_sparse_moe.experts.{expert}." in name}
    assert len(own) == 3
    save_file({n: a for n, a in tensors.items() if n not in own}, folder / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in own}, folder / "model-00002-of-00002.safetensors")
    index = {n: f"model-0000{1 + (n in own)}-of-00002.safetensors" for n in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))

    resident, _, _ = serve(folder, plugins, prompts, count)
    shard = folder / "model-00002-of-00002.safetensors"
    model = ModelConfig(path=str(folder), name="moe", dtype="float32", context_length=128,
                        experts=ExpertsConfig("stream", cache_bytes=1),
                        speculative=SpeculationConfig(method="prompt_lookup") if drafting else None)  # fmt: skip
    engine = Engine(Config(models=[model], engine=EngineConfig(max_batch_size=8, prefill_chunk=8)), plugins)
    engine.start()
    try:
        os.truncate(shard, shard.stat().st_size // 2)  # mid-serving: the model is loaded
        params = SamplingParams(temperature=0.0, max_tokens=count, extra={"ignore_eos": True})
        with caplog.at_level(logging.ERROR, logger="mlxr_core.model.experts.store"):
            handles = [engine.submit(GenerationRequest(model="moe", prompt_ids=p, params=params)) for p in prompts]
            finals = [list(handle) for handle in handles]
        again = list(engine.submit(GenerationRequest(model="moe", prompt_ids=prompts[0], params=params)))
        drafted = sum(figures.get("drafted", 0) for figures in engine.stats()["decoders"].get("moe", {}).values())
    finally:
        engine.stop()
    for events, used, tokens in zip(finals, seen, resident, strict=True):
        if (layer, expert) in used:
            assert isinstance(events[-1], Failed), events[-1]
            assert shard.name in str(events[-1].error) and "truncated" in str(events[-1].error)
        else:
            assert isinstance(events[-1], Finished), events[-1]
            assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == tokens
    assert isinstance(again[-1], Failed if (layer, expert) in seen[0] else Finished)
    logged = [r for r in caplog.records if shard.name in r.getMessage()]
    assert len(logged) == 1
    assert (drafted > 0) == drafting


def test_a_policy_that_would_requantize_streamed_experts_is_refused(mixtral, plugins):
    """Streamed experts are served as stored: q8 would requantize them, so it is refused by name."""
    from mlxr_core.errors import ConfigError

    setting = ModelConfig(path=str(mixtral.folder), quantization="q8", experts=ExpertsConfig("stream"))
    with pytest.raises(ConfigError, match=r"requantize|convert") as caught:
        load_model(setting, plugins.registries)
    assert caught.value.field == "models[].quantization"
