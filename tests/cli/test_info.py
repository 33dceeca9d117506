"""``mlxr info``: what a model is and what serving it costs, on tiny GGUF files."""

from __future__ import annotations

import json

import pytest

from mlxr_core.cli.main import main
from mlxr_core.testing.tiny import write_tiny_llama_gguf

# write_tiny_llama_gguf's defaults: 2 layers, hidden 64, 4 heads (2 KV) of 16, intermediate 128.
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("info")
    return {q: write_tiny_llama_gguf(folder / f"{q}.gguf", quant=q) for q in ("f32", "q4_0")}


def info(capsys, *args):
    assert main(["info", *args]) == 0
    return capsys.readouterr().out


def test_json_facts(files, capsys):
    facts = json.loads(
        info(
            capsys,
            str(files["q4_0"]),
            "--json",
            "--dtype",
            "float32",
            "--quantization",
            "keep",
            "--context",
            "100",
        )
    )
    assert (facts["format"], facts["architecture"], facts["layers"]) == ("gguf", "llama", LAYERS)
    assert facts["tensor_types"] == {"Q4_0": 16}
    assert facts["quantization"] == {"Q4_0 -> MLX 4-bit g32 (kept)": 16}
    assert facts["kv_bytes_per_token"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    assert (
        facts["memory_at_context_bytes"]
        == facts["resident_bytes"] + 100 * facts["kv_bytes_per_token"]
    )
    dense = json.loads(info(capsys, str(files["f32"]), "--json", "--dtype", "float32"))
    # Packed or dense, the same parameters; packed costs a fraction of the bytes.
    assert facts["parameters"] == dense["parameters"]
    assert facts["resident_bytes"] < dense["resident_bytes"] / 3


def test_the_policy_changes_what_is_resident(files, capsys):
    kept = json.loads(
        info(capsys, str(files["q4_0"]), "--json", "--dtype", "float32", "--quantization", "keep")
    )
    dense = json.loads(
        info(
            capsys,
            str(files["q4_0"]),
            "--json",
            "--dtype",
            "float32",
            "--quantization",
            "dequantize",
        )
    )
    assert dense["quantization"] == {"Q4_0 -> dense float32": 16}
    assert dense["resident_bytes"] > 3 * kept["resident_bytes"]


def test_text_report(files, capsys):
    out = info(capsys, str(files["q4_0"]), "--quantization", "q8", "--context", "64")
    assert "architecture: llama" in out and "Q4_0 -> MLX 8-bit g32 (requantized): 16" in out
    assert "at 64 tokens:" in out and "per token" in out


def test_bad_context_is_a_usage_error(files, capsys):
    assert main(["info", str(files["f32"]), "--context", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_a_mixture_of_experts_reports_its_active_parameters(tmp_path, capsys):
    """Top-2 of 8 experts: a token runs a quarter of the expert weights and all the rest."""
    pytest.importorskip("torch", reason="the tiny model is written by transformers")
    pytest.importorskip("transformers", reason="the tiny model is written by transformers")
    from mlxr_core.testing.hf_reference import tiny_reference

    shape = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 256}
    tiny_reference("Qwen3MoeForCausalLM", "Qwen3MoeConfig", shape, tmp_path, lengths=(4,))
    assert main(["info", str(tmp_path), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    experts = 2 * 3 * 8 * 32 * 64  # layers x projections x experts x width x hidden
    assert facts["architecture"] == "qwen3_moe"
    assert facts["parameters"] - facts["active_parameters"] == experts * 3 // 4
    assert main(["info", str(tmp_path)]) == 0
    assert "per token (mixture of experts)" in capsys.readouterr().out

    # Streamed experts: the same parameters, the experts' float32 bytes in the files, not resident.
    assert main(["info", str(tmp_path), "--json", "--experts", "{residency: stream, cache_bytes: 10000}"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert (streamed["parameters"], streamed["active_parameters"]) == (facts["parameters"], facts["active_parameters"])
    assert streamed["experts"]["stored_bytes"] == experts * 4
    assert streamed["resident_bytes"] == facts["resident_bytes"] - experts * 4
    assert streamed["memory_at_context_bytes"] == streamed["resident_bytes"] + 10000 + streamed["kv_bytes_at_context"]
    assert main(["info", str(tmp_path), "--experts", "{residency: stream, cache_bytes: 10000}"]) == 0
    assert "experts:      streamed" in capsys.readouterr().out
    assert main(["info", str(tmp_path), "--experts", "{residency: stream, cache: 1}"]) == 2
    assert "experts.cache: unknown key" in capsys.readouterr().err


def test_kv_bytes_per_token_under_a_kv_cache_setting(files, capsys):
    args = [str(files["f32"]), "--json", "--dtype", "float32", "--context", "1000"]
    turbo = json.loads(info(capsys, *args, "--kv-cache", "{method: turboquant, bits: 3, window: 16}"))
    # per head: 2-bit key codes (4 bytes), sign bits (2), two float16 norms; 3-bit values (6), a norm
    assert turbo["kv_bytes_per_token"] == LAYERS * KV_HEADS * (4 + 2 + 4 + 6 + 2)
    assert turbo["kv_bytes_per_token_full_precision"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    window_copy = (16 + 64) * turbo["kv_bytes_per_token_full_precision"]  # the window and its slack
    assert turbo["kv_bytes_at_context"] == 1000 * turbo["kv_bytes_per_token"] + window_copy
    assert turbo["kv_cache"] == {"bits": 3, "window": 16, "method": "turboquant", "sketch": True}
    printed = info(capsys, str(files["f32"]), "--kv-cache", "{method: turboquant, bits: 3}")
    assert "KV cache:     72 B per token (turboquant 3-bit; full precision 512 B)" in printed
    assert main(["info", str(files["f32"]), "--kv-cache", "{bits: 8, group_size: 32}"]) == 2
    assert "models[].kv_cache.group_size 32 does not divide the head size 16" in capsys.readouterr().err
