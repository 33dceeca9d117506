"""Qwen4-Exp (``qwen4_exp``) against transformers 5.25 on tiny random weights: hyper-connections,
per-layer n-gram embeddings on two DeltaNet layers (the end-of-sequence token occurring in the
prompts, so that the n-grams are cut there), indexed attention picking 2 blocks of 4 tokens
per query (and its tail), sparse experts with a gated shared expert.

The folder is written by transformers (its ``save_pretrained``: experts fused, each n-gram table
in ``split_ngram_parts`` shards, the hashing constants stored) and compared on logits, cached
decoding, a left-padded batch and a prefix-cache hit
(:func:`mlxr_core.testing.hf_reference.check_reference`), and served by the engine batched as
solo. Then where the n-gram tables live, and the refusals: configs whose math this graph does
not compute, stored hashing constants that disagree with the config.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.testing.hf_reference import (
    PROMPT_LENGTHS,
    check_reference,
    load_reference_model,
    tiny_reference,
)
from mlxr_plugins.archs.qwen4_exp import Qwen4ExpArchitecture

VOCAB = 97
#: The prompts tiny_reference draws (seed 0); the end-of-sequence token is their commonest token.
_RNG = np.random.default_rng(1)
PROMPTS = [_RNG.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
EOS = Counter(PROMPTS[0]).most_common(1)[0][0]
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "hc_count": 2,
    "hc_lowrank": 8,
    "ple_layer_ids": [1, 3],
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 50,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 4,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    # Two blocks of 4 picked per query: from its 12th position on a query attends to fewer
    # positions than it sees (the 40-token prompt's last query to 8 of complete blocks and 0-3 more).
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "eos_token_id": EOS,
}
#: As the hybrid families' (test_hybrid_reference.py): transformers' two forms of the recurrence differ by ~1e-4.
ATOL = 1e-3


@pytest.fixture(scope="module")
def registries():
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    reference = tiny_reference("Qwen4ExpForCausalLM", "Qwen4ExpTextConfig", SHAPE, tmp_path_factory.mktemp("qwen4"))
    assert reference.prompts == PROMPTS and PROMPTS[0].count(EOS) >= 2
    return reference


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_it_matches_transformers(reference, registries, backend):
    check_reference(reference, registries, backend=backend, atol=ATOL)


#: The other settings: three streams, 4-grams (three shifts cut at eos) in 3 heads each, a longer
#: dilated convolution, the sigmoid output gate, half of each head rotated, indexer heads wider
#: than attention heads (carried in two extra key heads, zero-padded), one block picked of 6.
OTHER = {**SHAPE, "hc_count": 3, "ngram_size": 4, "heads_per_ngram": 3, "ple_embed_dim": 36,
         "ple_conv_kernel_size": 3, "output_gate_type": "sigmoid", "indexer_head_dim": 24,
         "indexer_budget": 6, "indexer_compress_ratio": 6, "ple_layer_ids": [3],
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}  # fmt: skip


def test_other_settings_match_transformers(registries, tmp_path):
    reference = tiny_reference("Qwen4ExpForCausalLM", "Qwen4ExpTextConfig", OTHER, tmp_path)
    check_reference(reference, registries, atol=ATOL)


def test_the_ngram_tables_stay_in_the_files_out_of_the_weights(reference, registries):
    """Each table's shards are memory-mapped where the checkpoint holds them (in order, as one
    table), never parameters: the resident weights are the checkpoint's bytes less the tables'."""
    from safetensors.numpy import load_file

    stored = load_file(str(reference.folder / "model.safetensors"))
    tables = {name: array for name, array in stored.items() if ".ngram_embedding." in name}
    assert len(tables) == 2 * SHAPE["split_ngram_parts"]
    loaded = load_reference_model(reference, registries)
    table = loaded.model.model.layers[2].ple.ple_embedding.table
    assert all(isinstance(shard, np.memmap) for shard in table.shards)
    joined = [stored[f"model.layers.2.ple.ple_embedding.ngram_embedding.shard_{i}.weight"] for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(table.shards), np.concatenate(joined))
    constants = sum(array.nbytes for name, array in stored.items() if "ple_embedding" in name and name not in tables)
    weights = sum(array.nbytes for array in stored.values()) - sum(t.nbytes for t in tables.values()) - constants
    assert loaded.nbytes == weights
    from mlxr_core.cli.info import describe_model

    assert describe_model(str(reference.folder), dtype="float32", quantization="keep")["resident_bytes"] == weights


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"indexer_budget": None}, "indexer_budget"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ({"ple_layer_ids": [2]}, "ple_layer_ids"),
        ({"eos_token_id": None}, "eos_token_id"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"output_gate_type": "tanh"}, "output_gate_type"),
        ({"ple_embed_dim": 30}, "ple_embed_dim"),
    ],
)
def test_configs_it_does_not_compute_are_refused_naming_the_key(change, key):
    config = {**SHAPE, "model_type": "qwen4_exp_text", **change}
    with pytest.raises(ModelLoadError) as caught:
        Qwen4ExpArchitecture().args(config)
    assert caught.value.key == key


def test_quantized_keys_and_values_are_refused(reference, registries):
    """The indexer reads its keys from the attention cache: stored quantized, they cannot serve."""
    from mlxr_core.config.schema import KVCacheConfig, ModelConfig
    from mlxr_core.errors import ConfigError
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(reference.folder), dtype="float32", kv_cache=KVCacheConfig(bits=8))
    with pytest.raises(ConfigError, match=r"kv_cache cannot apply: .*reads its cache itself"):
        load_model(config, registries)


def test_a_bfloat16_table_is_read_from_its_file_as_stored(tmp_path):
    """A table stored in bfloat16 (as released checkpoints hold it) is memory-mapped and its
    rows come back as the stored values (raw bits read as bfloat16), in the model's dtype."""
    from mlxr_plugins.archs.qwen4_exp_ple import NGramTable, host_rows
    from mlxr_plugins.formats.safetensors.checkpoint import read_weights

    shards = [mx.random.normal((rows, 4)).astype(mx.bfloat16) for rows in (5, 3)]
    mx.save_safetensors(str(tmp_path / "t.safetensors"), {f"ngram_embedding.shard_{i}.weight": s for i, s in enumerate(shards)})
    left: dict[str, Any] = {}
    read_weights({tmp_path / "t.safetensors": None}, mx.float32, leave=lambda name: True, left=left)
    table = NGramTable([host_rows(name, left[name][1]) for name in sorted(left)], mx.float32)
    assert all(isinstance(shard, np.memmap) for shard in table.shards)
    rows = mx.array([[7, 0], [4, 5]])
    want = mx.concatenate(shards)[rows].astype(mx.float32)
    np.testing.assert_array_equal(np.array(table(rows)), np.array(want))


def test_the_released_layout_reads_the_text_model(reference, registries, tmp_path):
    """The vision-language checkpoint: keys under ``text_config`` (attention layers named
    ``full_attention``), weights under ``model.language_model.``, a vision tower not read."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((reference.folder / "config.json").read_text())
    weights = {"model.language_model." + name.removeprefix("model."): array
               for name, array in load_file(str(reference.folder / "model.safetensors")).items()}  # fmt: skip
    weights["lm_head.weight"] = weights.pop("model.language_model.lm_head.weight")
    weights["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), dtype=np.float32)
    outer = {"model_type": "qwen4_exp", "text_config": config, "tie_word_embeddings": False}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(outer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((reference.folder / name).read_bytes())
    moved = type(reference)(tmp_path, reference.prompts, reference.logits, outer)
    got = np.array(load_reference_model(moved, registries).model(mx.array([reference.prompts[1]]))[0])
    np.testing.assert_allclose(got, reference.logits[1], atol=ATOL)


def test_stored_hashing_constants_must_match_the_config(reference):
    """A checkpoint whose stored multipliers are not the config's (another ``seed``) is refused,
    naming the tensor: its table rows were hashed otherwise."""
    from safetensors.numpy import load_file

    weights = {name: mx.array(array) for name, array in load_file(str(reference.folder / "model.safetensors")).items()}
    config = {**reference.config, "seed": SHAPE.get("seed", 1234) + 1}
    with pytest.raises(ModelLoadError, match="hashing constants") as caught:
        Qwen4ExpArchitecture().sanitize(weights, config)
    assert "layer_multipliers" in str(caught.value.tensor)


def test_the_engine_serves_it_batched_as_solo(reference):
    """Four concurrent greedy streams (rows joining and leaving the batch, chunked prefill, a
    one-token prompt whose n-gram context starts empty, a prompt extending a cached one) give
    each stream its solo tokens."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    shared = reference.prompts[0][:24]
    prompts = [[*shared, 5], reference.prompts[1], [EOS], [*shared, 5, 9, 8]]

    def run(**engine: Any) -> list[list[int]]:
        model = ModelConfig(path=str(reference.folder), name="q4", dtype="float32", context_length=128)
        eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
        eng.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=8, extra={"ignore_eos": True})
            handles = [eng.submit(GenerationRequest(model="q4", prompt_ids=p, params=params)) for p in prompts[:3]]
            outputs = []
            for handle in [*handles, None]:
                events = list(handle if handle is not None else eng.submit(
                    GenerationRequest(model="q4", prompt_ids=prompts[3], params=params)))  # fmt: skip
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs
        finally:
            eng.stop()

    solo = run(max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    assert [len(out) for out in solo] == [8] * 4
    assert run(max_batch_size=4, prefill_chunk=16) == solo
