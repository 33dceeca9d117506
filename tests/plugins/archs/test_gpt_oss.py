"""The gpt_oss graph against transformers' ``GptOssForCausalLM`` on tiny random weights, through
every format that holds it: the Hugging Face folder; the same folder with MXFP4 experts, as OpenAI
ships the checkpoints (against transformers dequantizing that very folder); and GGUF files as
llama.cpp's converter writes them (F32, gate and up apart or in one tensor; MXFP4 experts).

The tiny config alternates sliding layers (window 8, shorter than the prompts) with full ones,
routes each token to 2 of 4 experts, and stretches RoPE by YaRN (factor 4 over 32 original
positions, ``truncate: false``, which moves the correction range here). Sinks and expert biases
are O(1) and the gate/up weights large enough that the SwiGLU clamp at 7 is hit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.model.layers.moe import QuantizedSwitchLinear
from mlxr_core.model.loader import build_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import Reference, check_reference, o1_init, tiny_reference
from mlxr_core.testing.tiny import write_gguf
from mlxr_plugins.archs.gpt_oss import GptOssArchitecture, GptOssArgs
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

ATOL = 1e-4
SHAPE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}
#: e2m1, the 4-bit codes of MXFP4 (bit 3 the sign).
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def init(model: Any, torch: Any) -> None:
    """O(1) weights; sinks and biases spread around 0; gate/up large enough to hit the clamp."""
    o1_init(model, torch)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                parameter.copy_(torch.randn_like(parameter))
            if name.endswith("gate_up_proj"):
                parameter.mul_(4.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp("gpt_oss")
    return tiny_reference("GptOssForCausalLM", "GptOssConfig", SHAPE, folder, init=init)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., rows, in]`` -> Hugging Face's MXFP4 ``blocks`` (uint8 ``[..., rows, in/32, 16]``,
    two codes a byte, the earlier element in the low nibble) and e8m0 ``scales`` (uint8
    ``[..., rows, in/32]``): per group of 32 the smallest power of two fitting it into +-6,
    each value rounded to the nearest code."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    top = np.abs(groups).max(-1)
    exponent = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)), -127).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))
    # Contiguous: safetensors' numpy writer stores a strided array's buffer as it lies.
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent + 127).astype(np.uint8))


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4[blocks & 15], FP4[blocks >> 4]
    out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*out.shape[:-2], -1)


@pytest.fixture(scope="module")
def mxfp4(reference, tmp_path_factory) -> tuple[Reference, dict[str, np.ndarray]]:
    """The folder with MXFP4 experts (and OpenAI's ``quantization_config``), transformers' logits
    for it (dequantizing on CPU), and the float weights it holds (experts as decoded)."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    shutil.copytree(reference.folder, folder, dirs_exist_ok=True)
    tensors = load_file(reference.folder / "model.safetensors")
    dense = dict(tensors)
    for name in [name for name in tensors if name.endswith(EXPERTS)]:
        blocks, scales = encode_mxfp4(tensors.pop(name).swapaxes(-1, -2))  # [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dense[name] = decode_mxfp4(blocks, scales).swapaxes(-1, -2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    model = transformers.GptOssForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].numpy() for ids in reference.prompts]
    return Reference(folder, reference.prompts, logits, config), dense


@pytest.mark.parametrize("backend", ["mlx_fast", "reference"])
def test_folder_matches_transformers(reference, registries, backend):
    """Logits, cached decoding, a left-padded batch and a prefix-cache hit."""
    check_reference(reference, registries, backend=backend, atol=ATOL)


def test_mxfp4_folder_matches_transformers_dequantizing_it(mxfp4, reference, registries):
    """``quantization: auto`` on CPU unpacks the experts: transformers' own dequantization of the
    same bytes, to float rounding (and not the float reference: the experts are rounded)."""
    folder_reference, _ = mxfp4
    check_reference(folder_reference, registries, atol=ATOL)
    assert np.abs(folder_reference.logits[0] - reference.logits[0]).max() > 100 * ATOL


def test_mxfp4_experts_stay_packed_and_exact(mxfp4, registries):
    """``keep``: MLX ``mxfp4`` modules multiplied packed (``gather_qmm``), the same logits."""
    folder_reference, _ = mxfp4
    model, report = load(folder_reference.folder, registries, "keep")
    packed = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(packed) == 3 * SHAPE["num_hidden_layers"]
    assert all((m.mode, m.bits, m.group_size) == ("mxfp4", 4, 32) for m in packed)
    assert report == {"MLX 4-bit mxfp4 g32 -> MLX 4-bit mxfp4 g32 (kept)": 3 * SHAPE["num_hidden_layers"]}
    assert_matches(model, folder_reference)


def test_mxfp4_blocks_without_scales_are_named(mxfp4, registries, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(mxfp4[0].folder, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"MXFP4 blocks without their .*layers\.1\.mlp\.experts\.down_proj_scales"):
        load(folder, registries, "auto")


#: Hugging Face module -> llama.cpp tensor, as ``convert_hf_to_gguf`` maps gpt-oss.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_gpt_oss_gguf(path: Path, weights: dict[str, np.ndarray], config: dict[str, Any], *,
                       fused: bool = False, experts: str = "f32") -> Path:
    """The weights as llama.cpp's converter writes gpt-oss: experts ``[E, out, in]``, gate and up
    de-interleaved into two tensors (or, as newer converters may, stacked in one), sinks as
    ``attn_sinks.weight``, experts stored as ``experts`` (``mxfp4``: llama.cpp's MXFP4 files)."""
    tensors: dict[str, np.ndarray] = {}
    for name, data in weights.items():
        if not name.startswith("model.layers."):
            tensors[TOP_NAMES[name]] = data
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}"
        if rest == "self_attn.sinks":
            tensors[f"{block}.attn_sinks.weight"] = data
        elif rest.startswith("mlp.experts.gate_up_proj"):
            kind = "bias" if rest.endswith("_bias") else "weight"
            rows = data if kind == "bias" else data.swapaxes(-1, -2)  # [E, 2I, H], interleaved
            gate, up = rows[:, 0::2], rows[:, 1::2]
            if fused:
                tensors[f"{block}.ffn_gate_up_exps.{kind}"] = np.concatenate([gate, up], axis=1)
            else:
                tensors[f"{block}.ffn_gate_exps.{kind}"], tensors[f"{block}.ffn_up_exps.{kind}"] = gate, up
        elif rest.startswith("mlp.experts.down_proj"):
            kind = "bias" if rest.endswith("_bias") else "weight"
            tensors[f"{block}.ffn_down_exps.{kind}"] = data if kind == "bias" else data.swapaxes(-1, -2)
        else:
            module, kind = rest.rsplit(".", 1)
            tensors[f"{block}.{GGUF_NAMES[module]}.{kind}"] = data
    rope = config["rope_parameters"]
    metadata: dict[str, Any] = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "expert_feed_forward_length": config["intermediate_size"],
        "expert_count": config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "attention.sliding_window": config["sliding_window"],
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }
    quants = {name: experts for name in tensors if "_exps.weight" in name}
    return write_gguf(path, "gpt-oss", metadata, tensors, quants=quants)


def float_weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("layout", ["split", "fused"])
def test_gguf_matches_transformers(reference, registries, tmp_path, layout):
    path = write_gpt_oss_gguf(tmp_path / "f32.gguf", float_weights(reference.folder), reference.config,
                              fused=layout == "fused")
    checkpoint = GGUFFormat().load(path)
    config = checkpoint.config
    assert config["model_type"] == "gpt_oss" and config["num_local_experts"] == 4
    assert config["rope_scaling"]["truncate"] is False
    assert_matches(build(checkpoint, registries, "dequantize"), reference)


@pytest.mark.parametrize("policy", ["dequantize", "keep"])
def test_mxfp4_gguf_matches_transformers(mxfp4, registries, tmp_path, policy):
    """ggml's MXFP4 blocks (another nibble order) repacked as MLX ``mxfp4``: transformers' logits
    for the MXFP4 folder, whether unpacked or multiplied packed."""
    folder_reference, dense = mxfp4
    path = write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", dense, folder_reference.config, experts="mxfp4")
    checkpoint = GGUFFormat().load(path)
    assert checkpoint.quantization["model.layers.0.mlp.switch_mlp.up_proj"].mode == "mxfp4"
    model = build(checkpoint, registries, policy)
    packed = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(packed) == (9 if policy == "keep" else 0)
    assert_matches(model, folder_reference)


def test_info_describes_the_folders(reference, mxfp4):
    from mlxr_core.cli.info import describe_model

    total = sum(array.size for array in float_weights(reference.folder).values())
    facts = describe_model(str(reference.folder), dtype="float32")
    assert facts["architecture"] == "gpt_oss" and facts["parameters"] == total
    expert_share = 3 * 4 * (2 * 32 * 64 + 2 * 32 + 64 * 32 + 64) // 2  # half of the experts idle
    assert facts["active_parameters"] == total - expert_share
    packed = describe_model(str(mxfp4[0].folder), dtype="float32", quantization="keep")
    assert packed["parameters"] == total
    assert packed["resident_bytes"] < facts["resident_bytes"]


def test_config_forms():
    """transformers 5's ``rope_parameters``, the ``rope_scaling`` spelling, or neither."""
    base = {key: SHAPE[key] for key in ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads")}
    args = GptOssArgs.from_config({**base, "rope_parameters": SHAPE["rope_parameters"]})
    assert args.rope_theta == 150000.0 and args.rope_scaling is not None
    assert args.rope_scaling["factor"] == 4.0 and "rope_theta" not in args.rope_scaling
    default = GptOssArgs.from_config(base)
    assert default.rope_scaling is not None and default.rope_scaling["factor"] == 32.0
    assert [default.is_sliding(i) for i in range(3)] == [True, False, True]
    typed = GptOssArgs.from_config({**base, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    assert [typed.is_sliding(i) for i in range(3)] == [False, True, False]
    assert GptOssArchitecture().kernel_context({**base})["sinks"] is True


def load(folder: Path, registries: Any, policy: str) -> tuple[Any, dict[str, int]]:
    """The folder's model under ``policy`` (mlx_fast kernels) and what the policy did."""
    from collections import Counter

    from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

    report: Counter[str] = Counter()
    return build(SafetensorsFormat().load(folder), registries, policy, report), dict(report)


def build(checkpoint: Any, registries: Any, policy: str, report: Any = None) -> Any:
    arch = registries.archs.get(checkpoint.config["model_type"])
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config),
                           choices=dict.fromkeys(OPS, "mlx_fast"))
    return build_model(checkpoint, arch, kernels, policy, "float32", report)


def assert_matches(model: Any, reference: Reference) -> None:
    for ids, want in zip(reference.prompts, reference.logits, strict=True):
        got = np.array(model(mx.array([ids]))[0])
        assert np.abs(want).max() > 1.0  # not a comparison of near-zero numbers
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
