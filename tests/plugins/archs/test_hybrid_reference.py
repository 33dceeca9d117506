"""The hybrid linear-attention families against transformers on tiny random weights: Qwen3-Next
(fused DeltaNet projections, sparse experts with a gated shared expert, one dense layer),
Qwen3.5 (separate projections, dense MLPs) and Qwen3.5-MoE (every layer sparse).

Each folder is written by transformers, loaded through mlxr's safetensors format and loader, and
compared on logits, cached decoding over more steps than the convolution's window, a left-padded
batch of rows of different lengths and a prefix-cache hit
(:func:`mlxr_core.testing.hf_reference.check_reference`), on the ``reference`` kernels and the fast
ones. Then what is particular to recurrent state: the prefix cache reuses only a whole stored
prefix and counts the partial match it passed over; the drafting decoders refuse the model; the
engine serves concurrent streams as solo. And the layouts users have: the released checkpoints'
(Qwen3.5's ``text_config``, ``model.language_model.*``, fused experts) and mlx-lm's converted
folders (norms stored as ``1 + weight``).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.errors import ConfigError
from mlxr_core.model.cache import RecurrentCache
from mlxr_core.testing.hf_reference import check_reference, load_reference_model, tiny_reference

BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}
MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
#: transformers' own two forms of the recurrence (one pass: chunked; token by token: the loop)
#: differ by up to 1.3e-4 on these weights (float32, logits of magnitude ~4), in spikes at a few
#: positions rather than growing along the sequence: the tolerance is several times that, and
#: every check also asks for transformers' argmax.
ATOL = 1e-3
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {**MOE, "mlp_only_layers": [2]}),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", MOE),
}


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request, tmp_path_factory):
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    model_class, config_class, extra = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return tiny_reference(model_class, config_class, {**BASE, **extra}, folder)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_the_family_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)


def test_the_prefix_cache_reuses_only_a_whole_recurrent_prefix(reference, registries):
    """A stored 24-token prefix serves a prompt that extends it; a prompt that shares only its
    first 20 tokens cannot resume the state taken at 24: a miss, counted as a partial match."""
    loaded = load_reference_model(reference, registries)
    model, ids = loaded.model, reference.prompts[0]
    cache = loaded.make_cache()
    assert any(isinstance(layer, RecurrentCache) for layer in cache)
    model(mx.array([ids[:24]]), cache=cache)
    prefix = PrefixCache(max_bytes=1 << 24)
    prefix.store(ids[:24], cache)

    reused, caches = prefix.lookup(ids, limit=len(ids) - 1, make_cache=loaded.make_cache)
    assert reused == 24 and caches is not None
    np.testing.assert_allclose(
        np.array(model(mx.array([ids[24:]]), cache=caches)[0]), reference.logits[0][24:], atol=ATOL
    )

    diverging = ids[:20] + [(token + 1) % 97 for token in ids[20:]]
    reused, caches = prefix.lookup(diverging, limit=len(diverging) - 1, make_cache=loaded.make_cache)
    assert (reused, caches) == (0, None)
    assert prefix.stats.partial_unusable == 1 and prefix.stats.hits == 1


def test_drafting_decoders_refuse_recurrent_state(reference, registries):
    from mlxr_plugins.decoders.drafting import check_trimmable

    loaded = load_reference_model(reference, registries)
    with pytest.raises(ConfigError, match="RecurrentCache"):
        check_trimmable(loaded.make_cache(), "prompt_lookup", "hybrid")


def test_the_engine_serves_it_batched_as_solo(reference):
    """Four concurrent greedy streams (continuous batching with recurrent rows joining and
    leaving, chunked prefill, a one-token prompt, a prompt extending a cached one) give each
    stream its solo tokens; the extension is served from the prefix cache."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], reference.prompts[1], [7], [*shared, 5, 9, 8]]

    def run(**engine: Any) -> tuple[list[list[int]], Any]:
        model = ModelConfig(path=str(reference.folder), name="hybrid", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            outputs = []
            handles = [eng.submit(GenerationRequest(model="hybrid", prompt_ids=p, params=params)) for p in prompts[:3]]
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            events = list(eng.submit(GenerationRequest(model="hybrid", prompt_ids=prompts[3], params=params)))
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs, eng.stats().get("prefix_cache", {}).get("hybrid")
        finally:
            eng.stop()

    solo, _ = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    batched, stats = run(max_batch_size=4, prefill_chunk=16)
    assert [len(out) for out in solo] == [8] * 4
    assert batched == solo
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= 24


def released_layout(reference: Any, folder: Any) -> None:
    """Rewrite ``reference``'s folder into ``folder`` as the released checkpoints and mlx-lm
    0.32 read them: rope keys at the top, the layer pattern as ``full_attention_interval``; for
    Qwen3.5 the text model nested in the vision-language layout, its experts fused
    (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``)."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((reference.folder / "config.json").read_text())
    rope = config["rope_parameters"]
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], full_attention_interval=2)
    weights = load_file(str(reference.folder / "model.safetensors"))
    family = config["model_type"].removesuffix("_text")
    if family != "qwen3_next":
        config = {"model_type": family, "text_config": config, "tie_word_embeddings": False}
        fused: dict[str, np.ndarray] = {}
        for name, array in weights.items():
            if ".experts." not in name:
                fused["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = array
        for layer in range(BASE["num_hidden_layers"]) if family == "qwen3_5_moe" else ():
            stem = f"model.layers.{layer}.mlp.experts"
            experts = range(MOE["num_experts"])
            gate_up = [np.concatenate([weights[f"{stem}.{e}.gate_proj.weight"], weights[f"{stem}.{e}.up_proj.weight"]]) for e in experts]
            fused[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(gate_up)
            fused[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = np.stack([weights[f"{stem}.{e}.down_proj.weight"] for e in experts])
        weights = fused
    folder.mkdir(exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((reference.folder / name).read_bytes())


def test_released_and_mlx_lm_folders_load(reference, registries, tmp_path):
    """The released layout loads as it is; mlx-lm loads it too, and the folder mlx-lm then writes
    (conv weights moved, norms holding ``1 + weight``, experts stacked) loads in mlxr: both
    within tolerance of transformers."""
    released = tmp_path / "released"
    released_layout(reference, released)
    rows = [(released, None)]
    if importlib.util.find_spec("mlx_lm") is not None:
        from mlx_lm.utils import load_model, save_config, save_model

        model, config = load_model(released)
        converted = tmp_path / "mlx-lm"
        converted.mkdir()
        save_model(converted, model)
        save_config(config, converted / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (converted / name).write_bytes((released / name).read_bytes())
        rows.append((converted, np.array(model(mx.array([reference.prompts[1]]))[0])))
    for folder, peer in rows:
        moved = type(reference)(folder, reference.prompts, reference.logits, {})
        got = np.array(load_reference_model(moved, registries).model(mx.array([reference.prompts[1]]))[0])
        np.testing.assert_allclose(got, reference.logits[1], atol=ATOL, err_msg=str(folder))
        if peer is not None:  # mlx-lm's own graph on the same folder agrees with transformers too
            np.testing.assert_allclose(peer, reference.logits[1], atol=ATOL)
