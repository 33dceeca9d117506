"""Valid files with absurd values in the metadata the loaders read (a GGUF's ``llama.*`` keys, a
folder's ``config.json``): each a ModelLoadError naming the file, the key as the file spells it
and the value, raised before the graph is built; ``mlxr info`` prints it as one line and
``mlxr serve`` exits 1 with it.

Loads run in one child process, through the whole loading pipeline (format, architecture,
tokenizer, weights), which reports each outcome and how much its peak memory grew
(:mod:`mlxr_core.testing.loader_fuzz`, whose semantic fuzzer goes over every key).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxr_core.cli.main import main
from mlxr_core.testing import loader_fuzz as fuzz
from mlxr_core.testing.loader_fuzz import MEMORY_SLACK, rewrite_gguf
from mlxr_core.testing.tiny import write_tiny_llama_gguf

HF_LLAMA = Path(__file__).parents[2] / "fixtures" / "tiny_hf" / "llama"


def load_in_child(warmup: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    outcomes, death = fuzz.load_in_child([warmup], paths)
    assert death is None, death
    return outcomes


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("absurd") / "good.gguf")


#: case -> (metadata changes, tensors added or replaced, the key or tensor the error names).
#: The tiny model: 2 layers, hidden 64, 4 heads of 16 (2 KV heads), 267 tokens.
GGUF_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "block_count_1e9": ({"llama.block_count": 10**9}, {}, "llama.block_count"),
    "block_count_beyond_the_weights": ({"llama.block_count": 40}, {}, "llama.block_count"),
    "block_count_float": ({"llama.block_count": 2.5}, {}, "llama.block_count"),
    "head_count_0": ({"llama.attention.head_count": 0}, {}, "llama.attention.head_count"),
    "head_count_kv_not_dividing": ({"llama.attention.head_count_kv": 3}, {}, "llama.attention.head_count_kv"),
    "hidden_size_0": ({"llama.embedding_length": 0}, {}, "llama.embedding_length"),
    "hidden_size_string": ({"llama.embedding_length": "64"}, {}, "llama.embedding_length"),
    "rms_epsilon_string": ({"llama.attention.layer_norm_rms_epsilon": "1e-5"}, {}, "llama.attention.layer_norm_rms_epsilon"),
    "rms_epsilon_negative": ({"llama.attention.layer_norm_rms_epsilon": -1e-5}, {}, "llama.attention.layer_norm_rms_epsilon"),
    "rope_dimension_7": ({"llama.rope.dimension_count": 7}, {}, "llama.rope.dimension_count"),
    "rope_dimension_4096": ({"llama.rope.dimension_count": 4096}, {}, "llama.rope.dimension_count"),
    "rope_base_negative": ({"llama.rope.freq_base": -1.0}, {}, "llama.rope.freq_base"),
    "rope_base_0": ({"llama.rope.freq_base": 0.0}, {}, "llama.rope.freq_base"),
    "rope_base_nan": ({"llama.rope.freq_base": math.nan}, {}, "llama.rope.freq_base"),
    "rope_scaling_0": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, {}, "llama.rope.scaling.factor"),
    "rope_freqs_wrong_length": ({}, {"rope_freqs.weight": np.ones(3)}, "rope_freqs.weight"),
    "rope_freqs_nan": ({}, {"rope_freqs.weight": np.full(8, np.nan)}, "rope_freqs.weight"),
    "context_length_0": ({"llama.context_length": 0}, {}, "llama.context_length"),
    "embedding_of_10_rows": ({}, {"token_embd.weight": np.ones((10, 64)), "output.weight": np.ones((10, 64))}, "token_embd.weight"),
}


def test_absurd_gguf_metadata_is_a_model_load_error_naming_the_key(good_gguf: Path, tmp_path: Path) -> None:
    paths = {
        name: rewrite_gguf(good_gguf, tmp_path / f"{name}.gguf", metadata, tensors)
        for name, (metadata, tensors, _) in GGUF_CASES.items()
    }
    outcomes = load_in_child(good_gguf, list(paths.values()))
    for name, path in paths.items():
        outcome, named = outcomes[str(path)], GGUF_CASES[name][2]
        assert outcome["result"] == "error", (name, outcome)
        assert str(path) in outcome["message"] and named in (outcome["key"], outcome["tensor"]), (name, outcome)
        assert "Traceback" not in outcome["message"]
        assert outcome["grew"] <= 2 * path.stat().st_size + MEMORY_SLACK, (name, outcome)
    assert "1000000000" in outcomes[str(paths["block_count_1e9"])]["message"]


def with_config(folder: Path, changes: dict[str, Any]) -> Path:
    shutil.copytree(HF_LLAMA, folder)
    config = json.loads((HF_LLAMA / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


ROPE = json.loads((HF_LLAMA / "config.json").read_text())["rope_parameters"]
#: case -> (config.json changes, the key the error names).
CONFIG_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "layers_1e9": ({"num_hidden_layers": 1e9}, "num_hidden_layers"),
    "layers_beyond_the_weights": ({"num_hidden_layers": 40}, "num_hidden_layers"),
    "layers_float": ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    "heads_0": ({"num_attention_heads": 0}, "num_attention_heads"),
    "hidden_0": ({"hidden_size": 0}, "hidden_size"),
    "hidden_string": ({"hidden_size": "32"}, "hidden_size"),
    "vocab_0": ({"vocab_size": 0}, "vocab_size"),
    "eps_string": ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    "eps_negative": ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    "rope_theta_0": ({"rope_parameters": {**ROPE, "rope_theta": 0}}, "rope_parameters.rope_theta"),
    "rope_factor_0": ({"rope_parameters": {**ROPE, "factor": 0}}, "rope_parameters.factor"),
    "llama3_band_of_zero_width": ({"rope_parameters": {**ROPE, "high_freq_factor": 1.0}}, "rope_parameters"),
    "partial_rotary_7_dims": ({"partial_rotary_factor": 7 / 8}, "partial_rotary_factor"),
    "tie_embeddings_string": ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
}



def test_absurd_config_json_values_are_a_model_load_error_naming_the_key(tmp_path: Path) -> None:
    folders = {name: with_config(tmp_path / name, changes) for name, (changes, _) in CONFIG_CASES.items()}
    nested = with_config(tmp_path / "config_nested", {})
    (nested / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    header = with_config(tmp_path / "header_nested", {})
    shard = next(header.glob("*.safetensors"))
    text = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    shard.write_bytes(len(text).to_bytes(8, "little") + text)

    small = with_config(tmp_path / "vocab_below_the_tokenizer", {"vocab_size": 10})

    outcomes = load_in_child(HF_LLAMA, [*folders.values(), nested, header, small])
    for name, folder in folders.items():
        outcome = outcomes[str(folder)]
        assert outcome["result"] == "error", (name, outcome)
        assert str(folder / "config.json") in outcome["message"], (name, outcome)
        assert outcome["key"] == CONFIG_CASES[name][1], (name, outcome)
    for folder, file in ((nested, nested / "config.json"), (header, shard)):
        outcome = outcomes[str(folder)]
        assert outcome["result"] == "error" and str(file) in outcome["message"], outcome
        assert "nest" in outcome["message"]
    # An embedding smaller than the vocabulary: the tokenizer file, which holds the tokens, is named.
    outcome = outcomes[str(small)]
    assert outcome["result"] == "error" and str(small / "tokenizer.json") in outcome["message"], outcome


def test_mlxr_info_prints_one_error_line_naming_the_key(good_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = rewrite_gguf(good_gguf, tmp_path / "layers.gguf", {"llama.block_count": 10**9})
    assert main(["info", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"mlxr: error: {path}: key 'llama.block_count': 1000000000 is not an integer in [1, 4096]\n"


def test_mlxr_serve_exits_1_naming_the_key(
    good_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxr_core.logs.setup_logging", lambda *args, **kwargs: 0)  # keep pytest's
    path = rewrite_gguf(good_gguf, tmp_path / "heads.gguf", {"llama.attention.head_count": 0})
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {path}\n")
    assert main(["serve", "--config", str(config), "--port", "0", "--log-level", "critical"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"mlxr: error: {path}: key 'llama.attention.head_count': 0 is not an integer in [1, 4096]"
