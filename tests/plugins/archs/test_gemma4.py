"""Gemma 4 (text) against transformers on tiny random weights, and the conformance check on the
features that reach across layers.

Two shapes: ``dense`` (E2B-like: sliding and global layers of different head sizes, per-layer
inputs, the last two layers sharing keys and values with the last earlier layer of their type,
double-wide MLPs there) and ``moe`` (26B-like: keys as values on the global layer with its own
key/value head count, experts beside the dense MLP). Norm weights, ``layer_scalar``, the router's
scales and ``per_expert_scale`` are randomized around 1, so that ``w`` vs ``1 + w`` or a missing
scalar shows (transformers initializes them to 1). Each folder is loaded through mlxr's
safetensors format and loader and compared on logits, cached decoding, a left-padded batch and a
prefix-cache hit (:func:`mlxr_core.testing.hf_reference.check_reference`) with both kernel
backends (measured: at most 2e-5 on one-pass logits of magnitude ~4, atol 1e-4); then served by
the engine (compiled step, batch, prefix cache, a one-token prompt), in bfloat16 and 8-bit, and
as a multimodal hub checkpoint.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture
from mlxr_core.testing.hf_reference import (
    Reference,
    check_reference,
    load_reference_model,
    o1_init,
    tiny_reference,
)
from mlxr_plugins.archs.gemma4 import Gemma4Args

S, F = "sliding_attention", "full_attention"
BASE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": 8,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 256,
}
SHAPES: dict[str, dict[str, Any]] = {
    # Layer 3 attends over layer 2's keys and values, layer 4 over layer 1's: the last of each
    # type before the shared ones (not the first of the type, nor a fixed number of layers back).
    "dense": {
        "num_hidden_layers": 5, "layer_types": [S, F, S, S, F], "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97,
    },
    "moe": {
        "num_hidden_layers": 3, "layer_types": [S, S, F], "attention_k_eq_v": True,
        "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0, "enable_moe_block": True,
        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
    },
}  # fmt: skip


def init(model: Any, torch: Any) -> None:
    """O(1) weights, and every scale transformers sets to 1 drawn around 1 (``layer_scalar`` is a
    buffer, not a parameter)."""
    o1_init(model, torch)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.6 + 0.8 * torch.rand_like(buffer))


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    shape = {**BASE, **SHAPES[request.param]}
    # One torch thread: idle OpenMP workers spin long enough to slow every MLX test after them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_reference("Gemma4ForCausalLM", "Gemma4TextConfig", shape, folder, init=init)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_gemma4_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend)


def test_the_engine_batches_compiles_and_reuses_prefixes(reference, registries):
    """Served by the engine (compiled decode step, fused projections, prefix cache), concurrent
    greedy requests, one of a single token and one sharing another's prefix, continue as the
    forward pass over the whole sequence does."""
    import threading

    from mlxr_core.config.schema import Config, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 97, n).tolist() for n in (30, 12, 25)]
    prompts += [[*prompts[0][:20], 5, 6, 7], [7]]
    model = load_reference_model(reference, registries).model
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(model(mx.array([ids]))[0, -1].argmax().item()))
        expected.append(ids[len(prompt) :])
    config = Config(models=[ModelConfig(path=str(reference.folder), name="tiny", dtype="float32")])
    engine = Engine(config, load_plugins())
    engine.start()
    got: dict[int, list[int]] = {}

    def generate(index: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=6, extra={"ignore_eos": True})
        events = engine.submit(GenerationRequest(model="tiny", prompt_ids=prompts[index], params=params))
        got[index] = [token for event in events if isinstance(event, Delta) for token in event.token_ids]

    try:
        threads = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)  # a request lost by a failed step never finishes
    finally:
        engine.stop()
    assert [got.get(i) for i in range(len(prompts))] == expected


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", "auto"), ("float32", "q8")])
def test_half_precision_and_packed_weights_stay_close(reference, registries, dtype, quantization):
    """bfloat16 (keys and values cached in it too, the unweighted value norm included) and 8-bit
    packed weights, experts packed as well: near the float32 reference, mostly the same argmax."""
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.cache import KVCache
    from mlxr_core.model.layers.moe import QuantizedSwitchLinear
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(reference.folder), dtype=dtype, quantization=quantization)
    model = load_model(config, registries).model
    if quantization == "q8" and "experts" in model.layers[0]:
        assert isinstance(model.layers[0].experts.gate_proj, QuantizedSwitchLinear)
    cache = [KVCache() for _ in model.layers]
    ids, want = reference.prompts[0], reference.logits[0]
    got = np.array(model(mx.array([ids]), cache=cache)[0].astype(mx.float32))
    assert {(c.keys.dtype, c.values.dtype) for c in cache} == {(getattr(mx, dtype),) * 2}
    assert np.abs(got - want).mean() < 0.03 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.85


def test_a_multimodal_hub_checkpoint_loads_its_language_model(reference, registries, tmp_path):
    """The hub layout: a ``gemma4`` config whose ``text_config`` gives ``global_head_dim`` (no
    ``per_layer_config``), weights under ``model.language_model.``, towers beside them, and the
    unused key/value weights of shared layers: the same logits."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "hub"
    shutil.copytree(reference.folder, folder)
    text = json.loads((folder / "config.json").read_text())
    del text["per_layer_config"]
    text["global_head_dim"] = BASE["global_head_dim"]
    text["num_global_key_value_heads"] = SHAPES["moe"]["num_global_key_value_heads"]
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1): array
        for name, array in load_file(folder / "model.safetensors").items()
    }
    tensors["model.vision_tower.encoder.weight"] = np.ones((4, 4), dtype=np.float32)
    tensors["model.embed_vision.embedding_projection.weight"] = np.ones((4, 4), dtype=np.float32)
    for layer in range(text["num_hidden_layers"] - text["num_kv_shared_layers"], text["num_hidden_layers"]):
        tensors[f"model.language_model.layers.{layer}.self_attn.k_proj.weight"] = np.ones((4, 4), dtype=np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_reference_model(Reference(folder, reference.prompts, reference.logits, config), registries)
    ids, want = reference.prompts[0], reference.logits[0]
    np.testing.assert_allclose(np.array(loaded.model(mx.array([ids]))[0]), want, atol=1e-4)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_compiled_step_batching_and_fusing_conform(shape, registries):
    """Shared keys and values and per-layer inputs through the compiled decode step, a batch whose
    rows join and leave, and fused projections."""
    arch = registries.archs.get("gemma4_text")
    config = {**TINY_CONFIG, **BASE, **SHAPES[shape], "model_type": "gemma4_text"}
    kernels = bind_kernels(
        registries.kernels, dtype="float32", shapes=arch.kernel_context(config), choices=dict.fromkeys(OPS, "reference")
    )
    check_architecture(arch, config, kernels)


def test_both_config_forms_give_the_same_layer_shapes():
    """Hub configs name ``global_head_dim``; transformers 5 saves ``per_layer_config`` (string keys)."""
    layers = {"num_hidden_layers": 3, "layer_types": [S, S, F], "attention_k_eq_v": True}
    hub = Gemma4Args.from_config({**BASE, **layers, "num_global_key_value_heads": 1})
    saved = Gemma4Args.from_config(
        {**BASE, **layers, "per_layer_config": {"02": {"head_dim": 32, "num_key_value_heads": 1}}}
    )
    for args in (hub, saved):
        assert [args.layer_shape(i) for i in range(3)] == [(16, 2), (16, 2), (32, 1)]
    # Without keys as values, global layers keep num_key_value_heads (as transformers does).
    plain = Gemma4Args.from_config({**BASE, **layers, "attention_k_eq_v": False, "num_global_key_value_heads": 1})
    assert plain.layer_shape(2) == (32, 2)


def test_defaults_follow_transformers():
    config = {key: value for key, value in BASE.items() if key != "global_head_dim"}
    args = Gemma4Args.from_config({**config, "num_hidden_layers": 7})
    assert args.layer_types == [S] * 5 + [F, F]  # every sixth global, and the last forced global
    assert args.layer_shape(5) == (512, 2)  # global_head_dim's default
    assert args.hidden_size_per_layer_input == 256 and args.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 3, "layer_types": [F, S, F], "num_kv_shared_layers": 2},
         "no earlier sliding_attention layer"),
        ({"rope_parameters": {S: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, F: {"rope_theta": 1e6}}},
         "rope_scaling type 'yarn' is not supported by the gemma4 graph"),
        ({"use_bidirectional_attention": "all"}, "not a causal LM"),
        ({"hidden_activation": "silu"}, "not GeGLU"),
        ({"enable_moe_block": True, "num_experts": 4}, r"enable_moe_block with \(4, None, None\) experts"),
        ({"layer_types": [S, "chunked_attention"]}, "layer_types must list"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_with_the_reason(change, message, registries):
    config = {**BASE, "num_hidden_layers": 2, **change}
    arch = registries.archs.get("gemma4")
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes={"masks": ("causal", "array")})
    with pytest.raises(ModelLoadError, match=message):
        arch.build(config, kernels)


def test_mlxr_info_counts_the_experts_a_token_runs(reference):
    """Top-2 of 4 experts: half of every expert stack is inactive per token; the dense model has none."""
    from mlxr_core.cli.info import describe_model

    facts = describe_model(str(reference.folder), dtype="float32")
    config = reference.config
    if not config.get("enable_moe_block"):
        assert facts["active_parameters"] == facts["parameters"]
        return
    experts = config["num_experts"] * 3 * config["moe_intermediate_size"] * config["hidden_size"]
    assert facts["parameters"] - facts["active_parameters"] == config["num_hidden_layers"] * experts // 2
