"""Gemma 3n (text) against transformers 5.25 on tiny random weights it writes itself.

Two shapes: ``e2b`` (as the released E2B/E4B: 4 AltUp streams with the first active, LAuReL,
per-layer inputs from a table smaller than the vocabulary so that some ids read its row 0, the
first layers' MLPs sparse at two levels, per-layer MLP widths, sliding and global layers, the
last two layers sharing keys and values with the last earlier layer of their type) and ``other``
(2 streams with the second active, no output scale, untied head, no sharing, every MLP dense).
``correct_output_scale`` (zeros in transformers' init) and the norms are drawn around 1, so that a
dropped scale or ``w`` vs ``1 + w`` shows. Each folder is loaded through mlxr's safetensors format
and loader and compared on logits, cached decoding, a left-padded batch and a prefix-cache hit
(:func:`mlxr_core.testing.hf_reference.check_reference`) on both kernel backends, in the config
as transformers 5.25 writes it and as the released checkpoints spell it (``rope_theta`` and
``rope_local_base_freq``, no ``rope_parameters``); then served by the engine (compiled step,
batching, prefix cache, a one-token prompt) and, renamed, as a multimodal ``gemma3n`` folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import Reference, check_reference, engine_greedy, tiny_reference
from mlxr_plugins.archs.gemma3n import Gemma3nArgs

S, F = "sliding_attention", "full_attention"
BASE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "max_position_embeddings": 256,
    "laurel_rank": 4,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 90,
}
SHAPES: dict[str, dict[str, Any]] = {
    # Layer 3 attends over layer 2's keys and values, layer 4 over layer 1's.
    "e2b": {
        "num_hidden_layers": 5, "layer_types": [S, F, S, S, F], "num_kv_shared_layers": 2,
        "intermediate_size": [48, 64, 48, 48, 32], "activation_sparsity_pattern": [0.95, 0.6, 0.0, 0.0, 0.0],
    },
    "other": {
        "num_hidden_layers": 3, "layer_types": [S, S, F], "num_kv_shared_layers": 0, "intermediate_size": 48,
        "altup_num_inputs": 2, "altup_active_idx": 1, "altup_correct_scale": False, "tie_word_embeddings": False,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp(f"gemma3n_{request.param}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_reference("Gemma3nForCausalLM", "Gemma3nTextConfig", {**BASE, **SHAPES[request.param]}, folder)
    finally:
        torch.set_num_threads(threads)


def released(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the released checkpoints spell it (transformers 4.53)."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope[F]["rope_theta"]
    config["rope_local_base_freq"] = rope[S]["rope_theta"]
    config["rope_scaling"] = None
    return config


def rewritten(reference: Reference, folder: Path, change: Any) -> Reference:
    """A copy of the reference folder with its config.json passed through ``change``."""
    folder = Path(shutil.copytree(reference.folder, folder))
    config = change(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return attrs.evolve(reference, folder=folder)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_gemma3n_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend)


def test_the_released_config_spelling_gives_the_same_model(reference, registries, tmp_path):
    """transformers 5.25 reads the released spelling as the same model (its logits are checked
    too: the rewrite is the released form, not another model); so does mlxr."""
    import torch
    import transformers

    four = rewritten(reference, tmp_path / "released", released)
    model = transformers.Gemma3nForCausalLM.from_pretrained(four.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([four.prompts[1]])).logits[0].numpy()
    assert abs(logits - four.logits[1]).max() < 1e-4
    check_reference(four, registries)


@pytest.mark.parametrize("reference", ["e2b"], indirect=True)
def test_the_engine_batches_compiles_and_reuses_prefixes(reference):
    """Served by the engine (compiled decode step, fused projections, chunked prefill, prefix
    cache), concurrent greedy requests, one of a single token and one sharing another's prefix:
    transformers' greedy tokens."""
    from mlxr_core.testing.hf_reference import transformers_greedy

    prompts = [reference.prompts[0], reference.prompts[1], [*reference.prompts[0][:30], 5, 6], [7]]
    want = transformers_greedy("Gemma3nForCausalLM", reference.folder, prompts, 5)
    assert engine_greedy(reference.folder, prompts, 5, prefill_chunk=16) == want


def hub_layout(reference: Reference, folder: Path, change: Any = lambda config: config) -> Reference:
    """The reference folder as a multimodal ``gemma3n`` hub checkpoint: text_config nested (passed
    through ``change``), ``model.language_model.*``, image and audio parts beside it, and the
    shared layers' key/value weights that hub checkpoints hold and transformers ignores."""
    from safetensors.numpy import load_file, save_file

    def nest(config: dict[str, Any]) -> dict[str, Any]:
        text = change({**config, "model_type": "gemma3n_text"})
        return {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"],
                "text_config": text, "vision_config": {"hidden_size": 16}, "audio_config": {"hidden_size": 16}}

    hub = rewritten(reference, folder, nest)
    path = hub.folder / "model.safetensors"
    prefix = "model.language_model."
    weights = {name.replace("model.", prefix, 1) if name.startswith("model.") else name: array
               for name, array in load_file(path).items()}
    weights["model.embed_audio.embedding.weight"] = np.ones((4, 16), np.float32)
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = np.ones((16, 3, 3, 3), np.float32)
    config = reference.config
    D, H = config["head_dim"], config["hidden_size"]
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    for layer in range(first_shared, config["num_hidden_layers"]):  # never read
        for name, shape in (("k_proj", (config["num_key_value_heads"] * D, H)), ("v_proj", (config["num_key_value_heads"] * D, H)),
                            ("k_norm", (D,))):  # fmt: skip
            weights[f"{prefix}layers.{layer}.self_attn.{name}.weight"] = np.ones(shape, np.float32)
    save_file(weights, path, metadata={"format": "pt"})
    return hub


@pytest.mark.parametrize("reference", ["e2b"], indirect=True)
def test_the_multimodal_checkpoints_language_model(reference, registries, tmp_path):
    """A ``gemma3n`` hub folder serves its language model (:func:`hub_layout`). transformers here
    cannot write one (its vision tower needs timm), so the text folder is renamed into that layout;
    transformers' multimodal model embeds ids below the vision vocabulary's offset (262144) as its
    language model does."""
    check_reference(hub_layout(reference, tmp_path / "hub"), registries)


@pytest.mark.parametrize("reference", ["e2b"], indirect=True)
def test_mlx_lm_folders_load_in_float_and_packed(reference, registries, tmp_path):
    """mlx-lm's conversions of a hub folder (its ``model.language_model.*`` names, the towers
    dropped): float32 gives transformers' logits; 8-bit, the layers mlx-lm packed stay packed, and
    give what the dequantized weights give."""
    import mlx.nn as nn

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model

    mlx_lm = pytest.importorskip("mlx_lm", reason="the folders are converted by mlx-lm")
    hub = hub_layout(reference, tmp_path / "hub", released)  # mlx-lm reads the released spelling
    settings = json.loads((hub.folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # not Gemma's SentencePiece
    (hub.folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    mlx_lm.convert(str(hub.folder), str(tmp_path / "f32"), dtype="float32")
    check_reference(attrs.evolve(hub, folder=tmp_path / "f32"), registries)
    mlx_lm.convert(str(hub.folder), str(tmp_path / "q8"), quantize=True, q_bits=8, q_group_size=32)
    ids = mx.array([reference.prompts[0]])
    logits = {}
    for policy in ("keep", "dequantize"):
        config = ModelConfig(path=str(tmp_path / "q8"), dtype="float32", quantization=policy, compile_decode=False)
        model = load_model(config, registries).model
        packed = [name for name, module in model.named_modules() if isinstance(module, nn.QuantizedLinear)]
        assert bool(packed) == (policy == "keep"), packed
        logits[policy] = np.array(model(ids)[0])
    np.testing.assert_allclose(logits["keep"], logits["dequantize"], atol=1e-4)


@pytest.mark.parametrize("reference", ["e2b"], indirect=True)
def test_soft_tokens_merged_into_the_embeddings(reference, registries):
    """Embeddings ``[B, L, hidden]`` with some rows replaced (where an audio or image tower's soft
    tokens go) give what transformers' language model gives for those ``inputs_embeds`` and the
    ids' per-layer inputs (its multimodal model's text path); unreplaced, the plain forward pass."""
    import torch
    import transformers

    from mlxr_core.testing.hf_reference import load_reference_model

    model = load_reference_model(reference, registries).model
    ids = reference.prompts[1]
    plain = model.model.token_embeddings(mx.array([ids]))
    soft = np.random.default_rng(5).standard_normal((4, plain.shape[-1])).astype(np.float32)
    merged = mx.concatenate([plain[:, :3], mx.array(soft[None]), plain[:, 7:]], axis=1)
    np.testing.assert_allclose(np.array(model(mx.array([ids]), embeddings=plain)[0]), reference.logits[1], atol=1e-4)
    theirs = transformers.Gemma3nForCausalLM.from_pretrained(reference.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = theirs.model(inputs_embeds=torch.tensor(np.array(merged)),
                              per_layer_inputs=theirs.model.get_per_layer_inputs(tokens)).last_hidden_state
        cap = theirs.config.final_logit_softcapping
        want = (torch.tanh(theirs.lm_head(hidden) / cap) * cap)[0].numpy()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), embeddings=merged)[0]), want, atol=1e-4)


@pytest.mark.parametrize("reference", ["e2b"], indirect=True)
def test_the_kv_budget_counts_shared_layers_as_placeholders(reference, registries):
    """Per position, the three layers with their own keys hold 2 x 2 heads x 16 features; the two
    sharing layers one placeholder feature each for keys and values (what the budget reserves)."""
    from mlxr_core.engine.batch import kv_bytes_per_token
    from mlxr_core.testing.hf_reference import load_reference_model

    loaded = load_reference_model(reference, registries)
    assert kv_bytes_per_token(loaded) == (3 * 2 * 2 * 16 + 2 * 2) * 4


@pytest.mark.parametrize(
    ("keys", "field"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"activation_sparsity_pattern": [0.95]}, "activation_sparsity_pattern"),
        ({"activation_sparsity_pattern": 0.95}, "activation_sparsity_pattern"),
        ({"intermediate_size": [48, 48]}, "intermediate_size"),
        ({"layer_types": [S, "chunked_attention", F]}, "layer_types"),
        ({"altup_active_idx": 4}, "altup_active_idx"),
        ({"num_kv_shared_layers": 3}, "num_kv_shared_layers"),
        ({"layer_types": [F, S, S], "num_kv_shared_layers": 2}, "num_kv_shared_layers"),
        ({"rope_parameters": {F: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                              S: {"rope_type": "default", "rope_theta": 1e4}}}, "rope_scaling"),
        ({"rope_parameters": {F: {"rope_type": "default", "rope_theta": 1e6},
                              S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "rope_parameters.sliding_attention"),
    ],
)  # fmt: skip
def test_a_config_it_would_compute_otherwise_is_refused_by_name(keys, field):
    from mlxr_core.kernels import bind_kernels
    from mlxr_plugins.archs.gemma3n import Gemma3nArchitecture

    config = {**BASE, **SHAPES["other"], "model_type": "gemma3n_text", **keys}
    kernels = bind_kernels(load_plugins().registries.kernels, dtype="float32", shapes={})
    with pytest.raises(ModelLoadError) as caught:
        Gemma3nArchitecture().build(config, kernels)
    assert caught.value.key == field, caught.value


def test_defaults_follow_transformers():
    """Without the per-layer keys, the layers are what Gemma3nTextConfig makes of the same keys:
    every 5th global, the first 10 sparse at 0.95 (of more than 10 layers), one MLP width for all."""
    transformers = pytest.importorskip("transformers", reason="compares with transformers' config")
    keys = {**BASE, "num_hidden_layers": 12, "intermediate_size": 48, "num_kv_shared_layers": 4}
    theirs = transformers.Gemma3nTextConfig(**keys)
    ours = Gemma3nArgs.from_config(keys)
    assert ours.layer_types == theirs.layer_types
    assert ours.activation_sparsity_pattern == theirs.activation_sparsity_pattern
    assert ours.intermediate_size == theirs.intermediate_size
    assert [ours.kv_source(i) is not None for i in range(12)] == [m == "reuse" for m in theirs.kv_sharing_modes]
