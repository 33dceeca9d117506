"""Qwen2.5-VL from llama.cpp's files: the language model as a ``qwen2vl`` GGUF and the tower and
merger as a ``qwen2.5vl_merger`` mmproj, against transformers' Qwen2_5_VLForConditionalGeneration
(CPU, float32) on a tiny random model (:mod:`mlxr_core.testing.tiny_vision`).

Both files are written from transformers' weights with ``gguf``'s writer and its own Hugging
Face -> llama.cpp tensor maps, split as ``convert_hf_to_gguf`` splits them (the fused ``qkv`` into
q, k and v; the patch convolution into its two frames).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.engine.images import PromptImages
from mlxr_core.engine.request import PromptImage
from mlxr_core.kernels import bind_kernels
from mlxr_core.model.checkpoint import TokenizerSpec
from mlxr_core.model.loader import build_model, choose_arch
from mlxr_core.model.vision import load_vision, logits_with_images
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_gguf
from mlxr_core.testing.tiny_vision import (
    BEGIN,
    END,
    IMAGE,
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    QWEN_TEXT,
    QWEN_VISION,
    qwen2_5_vl_model,
)
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

SIZE = (23, 41)  # (height, width): 3x5 tokens


def write_text_gguf(path: Path, state: dict[str, np.ndarray]) -> Path:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, QWEN_TEXT["num_hidden_layers"])
    tensors = {}
    for name, array in state.items():
        if name.startswith("model.visual."):
            continue
        base, kind = name.replace("model.language_model.", "model.").rsplit(".", 1)
        tensors[f"{names.get_name(base)}.{kind}"] = array
    text = QWEN_TEXT
    metadata = {
        "block_count": text["num_hidden_layers"], "embedding_length": text["hidden_size"],
        "feed_forward_length": text["intermediate_size"], "attention.head_count": text["num_attention_heads"],
        "attention.head_count_kv": text["num_key_value_heads"], "attention.layer_norm_rms_epsilon": 1e-5,  # Qwen2_5_VLTextConfig's default
        "rope.freq_base": text["rope_theta"], "context_length": text["max_position_embeddings"],
        "rope.dimension_sections": [*text["rope_scaling"]["mrope_section"], 0],
    }  # fmt: skip
    return write_gguf(path, "qwen2vl", metadata, tensors)


def write_mmproj(path: Path, state: dict[str, np.ndarray], mean: list[float], std: list[float]) -> Path:
    vision = QWEN_VISION
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision["depth"], 3))  # mm.2 is "block" 2
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("qwen2.5vl_merger")
    writer.add_vision_projection_dim(vision["out_hidden_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_image_size(56)
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(mean)
    writer.add_vision_image_std(std)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
    writer.add_vision_window_size(vision["window_size"])
    writer.add_vision_min_pixels(QWEN_MIN_PIXELS)
    writer.add_vision_max_pixels(QWEN_MAX_PIXELS)
    for name, array in state.items():
        if not name.startswith("model.visual."):
            continue
        base, kind = name.removeprefix("model.").rsplit(".", 1)
        if base.endswith("patch_embed.proj"):
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(array[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(array[:, :, 1]))
        elif base.endswith(".qkv"):
            for part, piece in zip("qkv", np.split(array, 3, axis=0), strict=True):
                writer.add_tensor(f"{names.get_name(base[:-3] + part)}.{kind}", np.ascontiguousarray(piece))
        else:
            writer.add_tensor(f"{names.get_name(base)}.{kind}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_qwen2vl_gguf_with_its_mmproj_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    from PIL import Image

    model, processor = qwen2_5_vl_model(tmp_path / "hf", torch, transformers)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (*SIZE, 3), dtype=np.uint8))
    processed = processor(image, return_tensors="pt")
    grid = processed["image_grid_thw"]
    count = int(grid.prod()) // 4
    prompt = [2, 17, 5, BEGIN, *[IMAGE] * count, END, 9, 33, 12, 40]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        tower = model.model.visual(processed["pixel_values"], grid_thw=grid).pooler_output.numpy()
        want = model(input_ids=ids, pixel_values=processed["pixel_values"], image_grid_thw=grid,
                     mm_token_type_ids=(ids == IMAGE).int()).logits[0].numpy()  # fmt: skip
    state = {name: value.numpy() for name, value in model.state_dict().items()}

    fmt, registries = GGUFFormat(), load_plugins().registries
    text = fmt.load(write_text_gguf(tmp_path / "text.gguf", state))
    assert text.config["model_type"] == "qwen2_5_vl"
    assert text.config["rope_scaling"]["mrope_section"] == QWEN_TEXT["rope_scaling"]["mrope_section"]
    # The vocabulary the GGUF would carry: the image token found there gives the image's id.
    tokens = [f"t{i}" for i in range(QWEN_TEXT["vocab_size"])]
    tokens[IMAGE], tokens[BEGIN], tokens[END] = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
    text = attrs.evolve(text, tokenizer=TokenizerSpec("gguf", {"tokenizer.ggml.tokens": tokens}))
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", state, list(processor.image_mean), list(processor.image_std))
    checkpoint = fmt.load_projector(text, mmproj)
    arch = choose_arch(checkpoint, registries).arch
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(checkpoint.config))
    lm = build_model(checkpoint, arch, kernels, "auto", "float32")
    vision = load_vision(checkpoint, arch, mx.float32)
    assert vision is not None and vision.tokens.image_token_id == IMAGE

    pixels = vision.processor(image)
    assert vision.tokens.tokens_for(pixels) == count
    assert float(np.abs(np.array(vision.encode([pixels])) - tower).max()) <= 1e-4
    placed = PromptImages(prompt, [PromptImage(pixels, "0")], vision.tokens)
    logits = logits_with_images(lm, mx.array([prompt]), vision.encode([pixels]), vision.tokens,
                                positions=mx.array(placed.positions[:, None]))[0]  # type: ignore[index]  # fmt: skip
    assert float(np.abs(np.array(logits) - want).max()) <= 1e-4
