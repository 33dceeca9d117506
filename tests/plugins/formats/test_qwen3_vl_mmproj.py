"""Qwen3-VL from llama.cpp's files: the language model as a ``qwen3vl`` GGUF and the tower, merger
and DeepStack mergers as a ``qwen3vl_merger`` mmproj, against transformers'
Qwen3VLForConditionalGeneration (CPU, float32) on a tiny random model
(:mod:`mlxr_core.testing.tiny_vision`).

Both files are written from transformers' weights with ``gguf``'s writer and its own Hugging
Face -> llama.cpp tensor maps, named as ``convert_hf_to_gguf`` names them (the patch convolution
as its two frames, the merger's layers as ``mm.0``/``mm.2``, each DeepStack merger as
``v.deepstack.N`` by the tower block it follows).
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
from mlxr_core.errors import ModelLoadError
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
    QWEN3_TEXT,
    QWEN3_VISION,
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    qwen3_vl_model,
)
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat

SIZE = (23, 41)  # (height, width): 3x5 tokens
MERGER_NAMES = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}


def write_text_gguf(path: Path, state: dict[str, np.ndarray], deepstack: int) -> Path:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, QWEN3_TEXT["num_hidden_layers"])
    tensors = {}
    for name, array in state.items():
        if name.startswith("model.visual."):
            continue
        base, kind = name.replace("model.language_model.", "model.").rsplit(".", 1)
        tensors[f"{names.get_name(base)}.{kind}"] = array
    text, rope = QWEN3_TEXT, QWEN3_TEXT["rope_parameters"]
    metadata = {
        "block_count": text["num_hidden_layers"], "embedding_length": text["hidden_size"],
        "feed_forward_length": text["intermediate_size"], "attention.head_count": text["num_attention_heads"],
        "attention.head_count_kv": text["num_key_value_heads"], "attention.key_length": text["head_dim"],
        "attention.value_length": text["head_dim"], "attention.layer_norm_rms_epsilon": 1e-6,  # Qwen3VLTextConfig's default
        "rope.freq_base": rope["rope_theta"], "context_length": text["max_position_embeddings"],
        "rope.dimension_sections": [*rope["mrope_section"], 0], "n_deepstack_layers": deepstack,
    }  # fmt: skip
    return write_gguf(path, "qwen3vl", metadata, tensors)


def mmproj_tensors(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tower's tensors under llama.cpp's names, as ``convert_hf_to_gguf`` writes them."""
    vision = QWEN3_VISION
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    tensors = {}
    for name, array in state.items():
        if not name.startswith("model.visual."):
            continue
        base, kind = name.removeprefix("model.").rsplit(".", 1)
        parts = base.split(".")
        if base == "visual.patch_embed.proj" and kind == "weight":
            tensors["v.patch_embd.weight"], tensors["v.patch_embd.weight.1"] = array[:, :, 0], array[:, :, 1]
        elif parts[1] == "merger":
            tensors[f"{MERGER_NAMES[parts[2]]}.{kind}"] = array
        elif parts[1] == "deepstack_merger_list":
            block = vision["deepstack_visual_indexes"][int(parts[2])]
            tensors[f"v.deepstack.{block}.{parts[3].removeprefix('linear_')}.{kind}"] = array
        else:
            tensors[f"{names.get_name(base)}.{kind}"] = array
    return {name: np.ascontiguousarray(array) for name, array in tensors.items()}


def write_mmproj(path: Path, tensors: dict[str, np.ndarray], mean: list[float], std: list[float]) -> Path:
    vision = QWEN3_VISION
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("qwen3vl_merger")
    writer.add_vision_projection_dim(vision["out_hidden_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_image_size(int(vision["num_position_embeddings"] ** 0.5) * vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(mean)
    writer.add_vision_image_std(std)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_is_deepstack_layers([i in vision["deepstack_visual_indexes"] for i in range(vision["depth"])])
    writer.add_vision_min_pixels(QWEN_MIN_PIXELS)
    writer.add_vision_max_pixels(QWEN_MAX_PIXELS)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_qwen3vl_gguf_with_its_mmproj_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    from PIL import Image

    model, processor = qwen3_vl_model(tmp_path / "hf", torch, transformers)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (*SIZE, 3), dtype=np.uint8))
    processed = processor(image, return_tensors="pt")
    grid = processed["image_grid_thw"]
    count = int(grid.prod()) // 4
    prompt = [2, 17, 5, BEGIN, *[IMAGE] * count, END, 9, 33, 12, 40]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.model.visual(processed["pixel_values"], grid_thw=grid)
        tower = np.concatenate([out.pooler_output.numpy(), *[f.numpy() for f in out.deepstack_features]], axis=-1)
        want = model(input_ids=ids, pixel_values=processed["pixel_values"], image_grid_thw=grid,
                     mm_token_type_ids=(ids == IMAGE).int()).logits[0].numpy()  # fmt: skip
    state = {name: value.numpy() for name, value in model.state_dict().items()}

    fmt, registries = GGUFFormat(), load_plugins().registries
    deepstack = len(QWEN3_VISION["deepstack_visual_indexes"])
    text = fmt.load(write_text_gguf(tmp_path / "text.gguf", state, deepstack))
    assert text.config["model_type"] == "qwen3_vl"
    # The vocabulary the GGUF would carry: the image token found there gives the image's id.
    tokens = [f"t{i}" for i in range(QWEN3_TEXT["vocab_size"])]
    tokens[IMAGE], tokens[BEGIN], tokens[END] = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
    text = attrs.evolve(text, tokenizer=TokenizerSpec("gguf", {"tokenizer.ggml.tokens": tokens}))
    mean, std = list(processor.image_mean), list(processor.image_std)
    checkpoint = fmt.load_projector(text, write_mmproj(tmp_path / "mmproj.gguf", mmproj_tensors(state), mean, std))
    assert checkpoint.config["vision_config"]["deepstack_visual_indexes"] == QWEN3_VISION["deepstack_visual_indexes"]
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

    # A DeepStack merger of the wrong width fails the load naming the mmproj and the tensor.
    tensors = mmproj_tensors(state)
    tensors["v.deepstack.1.fc2.weight"] = tensors["v.deepstack.1.fc2.weight"][:, :-1]
    bad = write_mmproj(tmp_path / "bad.gguf", tensors, mean, std)
    with pytest.raises(ModelLoadError) as caught:
        load_vision(fmt.load_projector(text, bad), arch, mx.float32)
    assert "bad.gguf" in str(caught.value) and "v.deepstack.1.fc2.weight" in str(caught.value)

    # A merger for a block the file does not mark is refused, naming the key.
    tensors = {name.replace("v.deepstack.1.", "v.deepstack.2."): array for name, array in mmproj_tensors(state).items()}
    with pytest.raises(ModelLoadError, match="is_deepstack_layers"):
        fmt.load_projector(text, write_mmproj(tmp_path / "moved.gguf", tensors, mean, std))
    # A text model taking another number of DeepStack features than the mmproj gives is refused.
    one = attrs.evolve(text, config={**text.config, "num_deepstack_layers": 1})
    with pytest.raises(ModelLoadError, match="2 DeepStack layers"):
        fmt.load_projector(one, tmp_path / "mmproj.gguf")
