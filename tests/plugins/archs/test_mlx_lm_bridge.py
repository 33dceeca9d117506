"""The mlx-lm bridge: model types mlx-lm implements and mlxr has no architecture for, served through
mlx-lm's own model classes by mlxr's engine.

Four such families are written by transformers with tiny O(1) random weights, loaded through mlxr's
safetensors format and loader, and compared with transformers (one pass, cached decoding, a
left-padded batch, a prefix-cache hit: :func:`~mlxr_core.testing.hf_reference.check_reference`),
then served by the engine with four concurrent greedy streams, each getting its solo tokens:
OLMoE (a mixture of experts with query/key norms), Granite-MoE (embedding, attention, residual and
logit multipliers), OLMo 3 (sliding-window layers, for which
mlx-lm makes a rotating cache and the bridge a full one with a window mask), Cohere 2 (tied
embeddings, a window pattern, parallel blocks), and recurrent models whose layers keep their
state in mlxr's ``StateCache`` as mlx-lm's layers use theirs: LFM2 (short convolutions beside
attention) and Mamba (whose layers
write their state back only into an ``ArraysCache``: the bridge hands them a view of that class).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the mlx-lm bridge needs mlx-lm: pip install 'mlxr[mlx-lm]'")

from mlxr_core.cli.info import describe_model
from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError, UnknownArchitecture
from mlxr_core.model.checkpoint import Checkpoint
from mlxr_core.model.loader import choose_arch
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import (
    check_reference,
    family_reference,
    load_reference_model,
)

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {"num_experts": 6, "num_experts_per_tok": 2}),
    "granitemoe": (
        "GraniteMoeForCausalLM",
        "GraniteMoeConfig",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "embedding_multiplier": 2.0,
         "logits_scaling": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3},
    ),
    "olmo3": (
        "Olmo3ForCausalLM",
        "Olmo3Config",
        {"sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "cohere2": (
        "Cohere2ForCausalLM",
        "Cohere2Config",
        {"tie_word_embeddings": True, "sliding_window": 12, "sliding_window_pattern": 2,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "mamba": ("MambaForCausalLM", "MambaConfig", {"state_size": 16, "time_step_rank": 8, "conv_kernel": 4, "expand": 2}),
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    return family_reference(FAMILIES, BASE, request.param, tmp_path_factory.mktemp(request.param))


def test_the_family_matches_transformers_through_the_bridge(reference, registries):
    """Loaded through the bridge (its startup note says so), within 1e-4 of transformers in every
    path the engine takes; the hidden states are the backbone's, before the LM head."""
    check_reference(reference, registries)
    loaded = load_reference_model(reference, registries)
    assert loaded.arch_reason.startswith("mlx-lm bridge (no architecture plugin registers")
    assert "kernel choices do not apply" in loaded.arch_reason
    assert loaded.compiled_decode is None
    ids = mx.array([reference.prompts[1]])
    hidden = loaded.arch.hidden_states(loaded.model, ids)
    assert hidden.shape == (1, ids.shape[1], BASE["hidden_size"])
    if reference.config["model_type"] == "olmoe":  # a plain LM head: the logits follow from them
        logits = loaded.model.lm_head(hidden)[0]
        np.testing.assert_allclose(np.array(logits), reference.logits[1], atol=1e-4)

    facts = describe_model(str(reference.folder), dtype="float32")
    assert facts["architecture_path"] == "mlx-lm"
    assert facts["architecture_reason"] == loaded.arch_reason
    assert facts["layers"] == len(loaded.make_cache())  # layers that keep state


def test_the_engine_serves_it_batched_as_solo(reference):
    """Four concurrent greedy streams (continuous batching, a shared prefix from the prefix cache,
    chunked prefill) give each stream its solo tokens."""
    from mlxr_core.config.schema import Config, EngineConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], [*shared, 9, 8], reference.prompts[1], [7, 3]]

    def run(**engine: Any) -> list[list[int]]:
        model = ModelConfig(path=str(reference.folder), name="bridged", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            handles = [eng.submit(GenerationRequest(model="bridged", prompt_ids=p, params=params)) for p in prompts]
            outputs = []
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs
        finally:
            eng.stop()

    solo = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    batched = run(max_batch_size=4, prefill_chunk=16)
    assert [len(out) for out in solo] == [8] * 4
    assert batched == solo


# -- choosing the path ------------------------------------------------------------------------


def checkpoint(tmp_path: Path, **config: Any) -> Checkpoint:
    return Checkpoint(path=tmp_path, format="safetensors", config=config, weights={})


def test_a_native_architecture_wins_over_the_bridge(registries, tmp_path):
    """mlx-lm implements llama too; mlxr's own graph serves it. ``models[].arch: mlx-lm`` asks for
    the bridge instead."""
    native = choose_arch(checkpoint(tmp_path, model_type="llama"), registries)
    assert native.path == "native" and native.reason == "native architecture 'llama' (plugin archs)"
    assert type(native.arch).__name__ == "LlamaArchitecture"
    forced = choose_arch(checkpoint(tmp_path, model_type="llama"), registries, "mlx-lm")
    assert forced.path == "mlx-lm"
    assert forced.reason.startswith("mlx-lm bridge (models[].arch is 'mlx-lm'): mlx-lm ")
    assert "builds mlx_lm.models.llama" in forced.reason


def test_mlx_lm_aliases_resolve_as_mlx_lm_resolves_them(registries, tmp_path):
    """``kimi_k2`` is mlx-lm's DeepSeek-V3 graph (its MODEL_REMAPPING)."""
    chosen = choose_arch(checkpoint(tmp_path, model_type="kimi_k2"), registries)
    assert chosen.path == "mlx-lm" and "builds mlx_lm.models.deepseek_v3" in chosen.reason


@pytest.mark.parametrize("model_type", ["no_such_model", "../llama", "olmoe.sub"])
def test_a_model_type_neither_path_knows_lists_both(registries, tmp_path, model_type):
    with pytest.raises(UnknownArchitecture) as caught:
        choose_arch(checkpoint(tmp_path, model_type=model_type), registries)
    message = str(caught.value)
    assert f"unknown architecture {model_type!r} (available: " in message
    assert "llama" in message and "qwen3" in message
    assert f"mlx-lm bridge: mlx-lm {_mlx_lm_version()} has no model type {model_type!r}" in message
    assert "mlx-lm" not in caught.value.available  # fallbacks are not architectures


def test_without_mlx_lm_the_error_says_how_to_install_it(registries, tmp_path, monkeypatch):
    from mlxr_plugins.archs import mlx_lm_bridge

    monkeypatch.setattr(mlx_lm_bridge.architecture, "mlx_lm_folder", lambda: None)
    with pytest.raises(UnknownArchitecture, match=r"mlx-lm bridge: not installed \(pip install 'mlxr\[mlx-lm\]'\)"):
        choose_arch(checkpoint(tmp_path, model_type="olmoe"), registries)


def test_config_check_accepts_what_the_bridge_serves():
    """``models[].arch`` may name a model type the bridge serves, or the bridge itself."""
    from mlxr_core.checks import unregistered_names
    from mlxr_core.config.schema import Config

    models = [ModelConfig(path="x", arch=arch) for arch in ("olmoe", "mlx-lm", "llama", "no_such_model")]
    problems = unregistered_names(Config(models=models), load_plugins())
    assert [problem.path for problem in problems] == [("models", 3, "arch")]


def test_a_cache_kind_the_engine_cannot_batch_is_refused_with_the_reason(registries, tmp_path, monkeypatch):
    """Falcon-H1 keeps a Mamba state and keys and values in one list per layer (mlx-lm's
    ``CacheList``): refused, naming the kind (recurrent ``ArraysCache`` layers are served)."""
    from mlx_lm.models import cache as mlx_cache

    from mlxr_plugins.archs.mlx_lm_bridge.caches import cache_layout

    config = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    }
    arch = choose_arch(checkpoint(tmp_path, **config), registries, "mlx-lm").arch
    model = arch.build(config, None)
    listed = [mlx_cache.CacheList(mlx_cache.ArraysCache(size=2), mlx_cache.KVCache()), mlx_cache.ArraysCache(size=2)]
    monkeypatch.setattr(type(model), "make_cache", lambda self: listed, raising=False)
    with pytest.raises(ModelLoadError, match=r"falcon_h1 keeps its state in 1 of its 2 layer caches in a kind mlxr's engine cannot batch \(1 CacheList"):
        cache_layout(model, "falcon_h1")


def test_a_graph_that_batches_wrongly_is_refused_when_loaded(registries, tmp_path, monkeypatch):
    """The loader's check decodes two rows alone and as a left-padded batch: a graph that lets a
    row attend to its padding (here: masks that forget it) is refused, not served wrongly."""
    from mlxr_plugins.archs.mlx_lm_bridge.caches import CacheView

    config = {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    }
    arch = choose_arch(checkpoint(tmp_path, **config), registries, "mlx-lm").arch
    model = arch.build(config, None)
    mx.eval(model.parameters())
    arch.check_loaded(model)
    monkeypatch.setattr(CacheView, "make_mask", lambda self, N, **_: None if N == 1 else "causal")
    with pytest.raises(ModelLoadError, match="llama lets a batch row attend to its left padding"):
        arch.check_loaded(model)


def test_mlxr_plugins_lists_the_bridge_and_what_it_adds(capsys):
    from mlxr_core.cli.main import main
    from mlxr_plugins.archs.mlx_lm_bridge import model_types

    assert main(["plugins", "--json"]) == 0
    report = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)}
    bridge = report["mlx_lm_bridge"]
    assert bridge["state"] == "ok" and bridge["provides"] == {"arch_fallbacks": ["mlx-lm"]}
    native = {name for plugin in report.values() for name in plugin["provides"].get("archs", [])}
    served = set(model_types() or ())
    assert {"olmoe", "deepseek_v3", "llama", "kimi_k2"} <= served
    added = len(served - native)
    assert bridge["notes"] == [f"mlx-lm bridge: {added} model types ({len(served & native)} more served natively)"]


# -- masks ------------------------------------------------------------------------------------


def test_the_cache_view_masks_padding_and_windows_as_mlxr_does():
    """A padded batch's mask hides each row's padding; a window layer's also the keys ``window``
    or more positions back (as :func:`mlxr_core.model.masks.window_mask` for mlxr's own layers)."""
    from mlxr_core.model.cache import BatchKVCache, KVCache
    from mlxr_core.model.masks import window_mask
    from mlxr_plugins.archs.mlx_lm_bridge.caches import CacheView

    single = KVCache.from_arrays(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    assert CacheView(single, None).make_mask(1) is None
    assert CacheView(single, None).make_mask(3) == "causal"
    assert CacheView(single, 8).make_mask(3) == "causal"  # every key within the window
    windowed = CacheView(single, 4).make_mask(3)
    want = window_mask(None, 3, 8, 4)
    assert isinstance(windowed, mx.array) and isinstance(want, mx.array)
    assert mx.array_equal(windowed, want).item()

    batch = BatchKVCache(mx.zeros((2, 1, 6, 4)), mx.zeros((2, 1, 6, 4)), [0, 3], 6)
    padded = CacheView(batch, None).make_mask(1)
    assert mx.array_equal(padded, batch.mask()).item()
    both = CacheView(batch, 4).make_mask(1, window_size=None)
    assert mx.array_equal(both, window_mask(batch.mask(), 1, 7, 4)).item()


def _mlx_lm_version() -> str:
    import mlx_lm

    return str(mlx_lm.__version__)
