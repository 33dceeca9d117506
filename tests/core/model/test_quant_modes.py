"""MLX's float quantization modes (``nvfp4``, ``mxfp8``, ``mxfp4``): written by ``mlxr convert
--quantize``, loaded from mlx-lm style folders and run packed through the kernel ops.

The reference dequantizes the folder's packed tensors with numpy from the formats' definitions
(OCP Microscaling and NVIDIA's NVFP4): E2M1 values (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5,
1, 1.5, 2, 3, 4, 6) or E4M3 values (bias 7, subnormals below exponent 1), times a scale per group:
E4M3 per 16 elements (NVFP4) or E8M0, ``2 ** (e - 127)``, per 32 (MXFP4, MXFP8). Elements are
packed in order into little-endian uint32 words, the earlier of two 4-bit codes in a byte's low
nibble.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlxr_core.cli.main import main
from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import bind_kernels
from mlxr_core.model.layers.moe import QuantizedSwitchLinear
from mlxr_core.model.loader import build_model, load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.registry import Registry
from mlxr_core.testing.hf_reference import tiny_reference
from mlxr_core.testing.kernel_check import check_kernel_parity
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat
from mlxr_plugins.kernels import KernelImpl, reference

IDS = [5, 6, 7, 8, 9, 10, 11, 40, 41]
#: mode -> (bits, group size, scale format) as the formats define them.
MODES = {"nvfp4": (4, 16, "e4m3"), "mxfp8": (8, 32, "e8m0"), "mxfp4": (4, 32, "e8m0")}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1(codes: np.ndarray) -> np.ndarray:
    magnitude = E2M1[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude)


def e4m3(codes: np.ndarray) -> np.ndarray:
    codes = codes.astype(np.int64)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(
        exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    )
    return np.where(codes & 0x80, -magnitude, magnitude)


def e8m0(codes: np.ndarray) -> np.ndarray:
    return 2.0 ** (codes.astype(np.int64) - 127)


def dequantize(words: np.ndarray, scales: np.ndarray, mode: str) -> np.ndarray:
    bits, group, scale_format = MODES[mode]
    data = np.ascontiguousarray(words).view("<u4").view(np.uint8)
    if bits == 4:
        codes = np.stack([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)
        values = e2m1(codes)
    else:
        values = e4m3(data)
    scale = e4m3(scales) if scale_format == "e4m3" else e8m0(scales)
    grouped = values.reshape(*values.shape[:-1], -1, group) * scale[..., None]
    return grouped.reshape(values.shape).astype(np.float32)


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("src") / "tiny.gguf", quant="f32")


def logits_of(checkpoint, registries, policy="keep", kernels=None):
    arch = registries.archs.get(checkpoint.config["model_type"])
    bound = bind_kernels(
        kernels or registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config)
    )
    model = build_model(checkpoint, arch, bound, policy, "float32")
    return model, np.array(model(mx.array([IDS]))[0])


def copy_of(registry):
    copy = Registry(registry.kind)
    for name in registry.names():
        entry = registry.entry(name)
        copy.add(name, entry.target, plugin=entry.plugin, **entry.meta)
    return copy


def converted(source, folder, mode):
    assert main(["convert", str(source), str(folder), "--quantize", mode, "--dtype", "float32"]) == 0
    return folder


def dense_copy(folder, out):
    """The converted folder with every packed module dequantized by :func:`dequantize`, each in
    its mode in config.json's ``quantization`` block (the default or the module's override)."""
    shutil.copytree(folder, out)
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    block = config.pop("quantization")
    config.pop("quantization_config")
    dense = {}
    for name, array in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".scales"):
            continue
        if f"{module}.scales" in tensors:
            array = dequantize(array, tensors[f"{module}.scales"], block.get(module, block)["mode"])
        dense[name] = array
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    return out


#: The quantization error allowed, as a multiple of MLX affine 4-bit's (``q4``, group 32) on the
#: same model: 4-bit floats round about as coarsely; E4M3's 3 mantissa bits far less.
QUANT_ERROR = {"nvfp4": 1.5, "mxfp8": 0.5, "mxfp4": 1.5}


def relative_error(logits, original):
    return float(np.sqrt(((logits - original) ** 2).mean()) / original.std())


@pytest.mark.parametrize("mode", list(MODES))
def test_convert_writes_the_mode_and_the_model_runs_it_packed(source, tmp_path, registries, mode):
    folder = converted(source, tmp_path / mode, mode)
    bits, group, _ = MODES[mode]
    block = json.loads((folder / "config.json").read_text())["quantization"]
    assert block == {"group_size": group, "bits": bits, "mode": mode}
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    assert {spec.mode for spec in checkpoint.quantization.values()} == {mode}

    model, packed = logits_of(checkpoint, registries, "keep")
    layers = [m for _, m in model.named_modules() if getattr(m, "mode", None) == mode]
    assert len(layers) == len(checkpoint.quantization)  # kept packed, none dequantized
    assert all(type(m).__name__.startswith("Kernel") for m in layers)  # through the kernel op

    reference_folder = dense_copy(folder, tmp_path / f"{mode}-dense")
    _, expected = logits_of(SafetensorsFormat().load(reference_folder, dtype="float32"), registries, "dequantize")
    np.testing.assert_allclose(packed, expected, atol=2e-4, rtol=1e-4)

    _, original = logits_of(GGUFFormat().load(source), registries, "dequantize")
    _, affine = logits_of(GGUFFormat().load(source), registries, "q4")
    error = relative_error(packed, original)
    assert 0 < error < QUANT_ERROR[mode] * relative_error(affine, original)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_policy_requantizes_a_float_model_as_convert_does(source, tmp_path, registries, mode):
    folder = converted(source, tmp_path / mode, mode)
    _, from_folder = logits_of(SafetensorsFormat().load(folder, dtype="float32"), registries)
    _, requantized = logits_of(GGUFFormat().load(source), registries, mode)
    np.testing.assert_allclose(requantized, from_folder, atol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_mlx_lm_loads_the_folder_with_mlxr_logits(source, tmp_path, registries, mode):
    mlx_lm = pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")  # mlx-lm's tokenizer loader
    folder = converted(source, tmp_path / mode, mode)
    model, _ = mlx_lm.load(str(folder))
    theirs = np.array(model(mx.array([IDS]))[0])
    _, ours = logits_of(SafetensorsFormat().load(folder, dtype="float32"), registries)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_mode_the_bound_backend_cannot_run_is_refused_naming_it(source, tmp_path, registries):
    kernels = copy_of(registries.kernels)
    affine_only = KernelImpl(reference.quantized_matmul, modes=("affine",))
    kernels.add("quantized_matmul:affine_only", affine_only, plugin="test", priority=1000)
    folder = converted(source, tmp_path / "nvfp4", "nvfp4")
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    with pytest.raises(ModelLoadError, match=r"quantization\.mode 'nvfp4'.*affine_only.*no kernel for nvfp4") as caught:
        logits_of(checkpoint, registries, "keep", kernels=kernels)
    assert caught.value.key == "quantization.mode"
    logits_of(checkpoint, registries, "dequantize", kernels=kernels)  # the policy may dequantize


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE written by transformers (one tensor per expert, float32)."""
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    shape = {
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "max_position_embeddings": 128, "tie_word_embeddings": False,
    }  # fmt: skip
    folder = tmp_path_factory.mktemp("moe")
    return tiny_reference("Qwen3MoeForCausalLM", "Qwen3MoeConfig", shape, folder, lengths=(9,))


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_experts_run_packed_through_gather_matmul(moe, tmp_path, registries, mode):
    folder = converted(moe.folder, tmp_path / mode, mode)
    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    model, packed = logits_of(checkpoint, registries, "keep")
    experts = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert experts and all(m.mode == mode for m in experts)

    reference_folder = dense_copy(folder, tmp_path / f"{mode}-dense")
    _, expected = logits_of(SafetensorsFormat().load(reference_folder, dtype="float32"), registries, "dequantize")
    np.testing.assert_allclose(packed, expected, atol=2e-4, rtol=1e-4)


def test_a_gather_backend_without_the_mode_refuses_the_experts(moe, tmp_path, registries):
    kernels = copy_of(registries.kernels)
    kernels.add("gather_matmul:affine_only", KernelImpl(reference.gather_matmul, modes=("affine",)),
                plugin="test", priority=1000)  # fmt: skip
    checkpoint = SafetensorsFormat().load(converted(moe.folder, tmp_path / "mxfp8", "mxfp8"), dtype="float32")
    with pytest.raises(ModelLoadError, match=r"quantization\.mode 'mxfp8'.*kernels\.gather_matmul.*affine_only"):
        logits_of(checkpoint, registries, "keep", kernels=kernels)


def test_a_folder_mixing_modes_per_module_loads_each_and_converts_back(source, tmp_path, registries):
    """mlx-lm's per-module overrides: one module ``mxfp8`` in an ``nvfp4`` folder, one ``false``
    (float); each loads as written, mlx-lm agrees, and ``convert --quantize keep`` writes them."""
    folder = converted(source, tmp_path / "mixed", "nvfp4")
    tensors = load_file(str(folder / "model.safetensors"))
    fp8, dense = "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"
    weight = dequantize(tensors[f"{fp8}.weight"], tensors[f"{fp8}.scales"], "nvfp4")
    packed, scales = mx.quantize(mx.array(weight), mode="mxfp8")
    tensors[f"{fp8}.weight"], tensors[f"{fp8}.scales"] = np.array(packed), np.array(scales)
    tensors[f"{dense}.weight"] = dequantize(tensors[f"{dense}.weight"], tensors.pop(f"{dense}.scales"), "nvfp4")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    block = {**config["quantization"], fp8: {"group_size": 32, "bits": 8, "mode": "mxfp8"}, dense: False}
    config["quantization"] = config["quantization_config"] = block
    (folder / "config.json").write_text(json.dumps(config))

    checkpoint = SafetensorsFormat().load(folder, dtype="float32")
    assert checkpoint.quantization[fp8].mode == "mxfp8" and dense not in checkpoint.quantization
    _, ours = logits_of(checkpoint, registries)
    reference_folder = dense_copy(folder, tmp_path / "mixed-dense")
    _, expected = logits_of(SafetensorsFormat().load(reference_folder, dtype="float32"), registries, "dequantize")
    np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=1e-4)

    mlx_lm = pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")  # mlx-lm's tokenizer loader
    model, _ = mlx_lm.load(str(folder))
    np.testing.assert_allclose(np.array(model(mx.array([IDS]))[0]), ours, atol=1e-4, rtol=1e-4)

    again = converted(folder, tmp_path / "again", "keep")
    written = json.loads((again / "config.json").read_text())["quantization"]
    assert written[fp8] == block[fp8] and written[dense] is False
    assert {key: written[key] for key in ("group_size", "bits", "mode")} == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    _, from_again = logits_of(SafetensorsFormat().load(again, dtype="float32"), registries)
    np.testing.assert_allclose(from_again, ours, atol=1e-5)


def test_the_parity_check_runs_the_float_modes_and_skips_those_a_backend_declines(registries):
    kernels = copy_of(registries.kernels)
    kernels.add("quantized_matmul:affine_only", KernelImpl(reference.quantized_matmul, modes=("affine",)),
                plugin="test")  # fmt: skip
    ran = check_kernel_parity(kernels, "quantized_matmul", "mlx_fast", dtypes=("float32",)).ran
    assert {mode for mode in MODES if any(mode in label for label in ran)} == set(MODES)
    report = check_kernel_parity(kernels, "quantized_matmul", "affine_only", dtypes=("float32",))
    assert report.skipped and all("fp" in label for label in report.skipped)
    assert {mode for mode in MODES if any(mode in label for label in report.skipped)} == set(MODES)
    assert not any("fp" in label for label in report.ran)


def test_nvfp4_with_a_global_scale_is_refused_naming_it(source, tmp_path):
    """mlx-lm's nvfp4 experts may carry a float32 scale per expert beside the e4m3 ones; mlxr's
    kernel ops take none, so such a folder is refused rather than loaded wrong."""
    folder = converted(source, tmp_path / "nvfp4", "nvfp4")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.global_scale"] = np.array(3.0, np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    with pytest.raises(ModelLoadError, match="global_scale is not supported") as caught:
        SafetensorsFormat().load(folder, dtype="float32")
    assert caught.value.key == "quantization.mode"
    assert caught.value.tensor == "model.layers.0.mlp.down_proj.global_scale"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_served_model_fuses_its_packed_projections_in_the_mode(source, tmp_path, registries, mode):
    """``load_model`` (as ``mlxr serve`` loads) joins q/k/v and gate/up into one packed matmul
    each: the same logits as the numpy-dequantized folder."""
    folder = converted(source, tmp_path / mode, mode)
    loaded = load_model(ModelConfig(path=str(folder), dtype="float32", quantization="keep"), registries)
    fused = [m for _, m in loaded.model.named_modules() if getattr(m, "mode", None) == mode]
    assert 0 < len(fused) < len(SafetensorsFormat().load(folder, dtype="float32").quantization)
    got = np.array(loaded.model(mx.array([IDS]))[0])
    reference_folder = dense_copy(folder, tmp_path / f"{mode}-dense")
    _, expected = logits_of(SafetensorsFormat().load(reference_folder, dtype="float32"), registries, "dequantize")
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)
