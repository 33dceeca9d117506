"""Tiny random vision models written by transformers (CPU, float32), for tests of the vision side,
the engine and the APIs, each with a word-level tokenizer and a chat template that writes the
family's image marker for each image part of a message:

- :func:`gemma3_vision_model`: a 32x32-pixel SigLIP tower of 8x8 patches, 4 tokens per image;
  ids 60, 61, 62 are ``<image_soft_token>``, ``<start_of_image>`` and ``<end_of_image>``;
- :func:`qwen2_5_vl_model`: Qwen2.5-VL with 4x4-pixel patches merged 2x2 (one token per 8x8
  pixels), windows of 2x2 tokens, M-RoPE sections (2, 3, 3); an image is resized to between
  :data:`QWEN_MIN_PIXELS` and :data:`QWEN_MAX_PIXELS` pixels; ids 60, 61, 62 are
  ``<|image_pad|>``, ``<|vision_start|>`` and ``<|vision_end|>``;
- :func:`qwen3_vl_model`: Qwen3-VL of the same sizes and tokens, a 4x4 position table, DeepStack
  features from the first two of its three vision blocks, interleaved M-RoPE.
- :func:`idefics3_model`: Idefics3 or SmolVLM with a Llama text model, tiles of 32x32 pixels
  (4x4 patches of 8x8, shuffled 2x2: 4 tokens a tile), images resized to a longest edge of 64
  (at most 2x2 tiles and the whole image); ids 60, 61, 62 are ``<image>``,
  ``<fake_token_around_image>`` and ``<global-img>``, 56-59 ``<row_1_col_1>`` ... ``<row_2_col_2>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB, IMAGE, BEGIN, END = 64, 60, 61, 62
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 128,
    "query_pre_attn_scalar": 16,
}
VISION = {
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
    "vision_use_head": False,
}
#: The tower's widths as multiples of 32, so its matrices quantize in groups of 32 (GGUF's Q8_0, MLX).
QUANTIZABLE_VISION = {"hidden_size": 32, "intermediate_size": 64}
#: Gemma 3's way of writing a message's parts (its template, trimmed to what the tests send).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def gemma3_vision_model(
    folder: Path, torch: Any, transformers: Any, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None
) -> Any:  # fmt: skip
    """Write the tiny model and its tokenizer to ``folder``; returns transformers' model (eval).
    ``vision`` overrides :data:`VISION`'s sizes (:data:`QUANTIZABLE_VISION`: widths that split
    into groups of 32), ``text`` :data:`TEXT`'s."""
    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config={**TEXT, **(text or {})},
        vision_config={**VISION, **(vision or {})},
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BEGIN,
        eoi_token_index=END,
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    _add_image_tokens(folder)
    return model


QWEN_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}
QWEN_VISION = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 16,
    "out_hidden_size": 32,
    "fullatt_block_indexes": [1],
}
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 8 * 8 * 2, 8 * 8 * 24
#: Qwen2.5-VL's way of writing a message's parts (its template, trimmed to what the tests send).
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<start_of_image>", "<|vision_start|><|image_pad|><|vision_end|>")


QWEN3_TEXT = {
    **{key: value for key, value in QWEN_TEXT.items() if key not in ("rope_theta", "rope_scaling")},
    "num_hidden_layers": 3,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
}
QWEN3_VISION = {
    **{key: value for key, value in QWEN_VISION.items() if key not in ("window_size", "fullatt_block_indexes")},
    "depth": 3,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
}


def qwen2_5_vl_model(folder: Path, torch: Any, transformers: Any) -> Any:
    """Write the tiny Qwen2.5-VL model, its tokenizer and its image processor's settings to
    ``folder``; returns transformers' model (eval) and image processor."""
    return _qwen_vl_model(folder, torch, transformers, "Qwen2_5_VL", QWEN_TEXT, QWEN_VISION)


def qwen3_vl_model(folder: Path, torch: Any, transformers: Any) -> Any:
    """Write the tiny Qwen3-VL model, its tokenizer and its image processor's settings (mean and
    std 0.5) to ``folder``; returns transformers' model (eval) and image processor."""
    normalize = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    return _qwen_vl_model(folder, torch, transformers, "Qwen3VL", QWEN3_TEXT, QWEN3_VISION, normalize)


def _qwen_vl_model(
    folder: Path, torch: Any, transformers: Any, kind: str, text: dict[str, Any], vision: dict[str, Any],
    normalize: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=BEGIN,
        vision_end_token_id=END,
        video_token_id=VOCAB - 1,
        attn_implementation="eager",
    )
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS,
        **(normalize or {}),
    )  # fmt: skip
    processor.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    names = {IMAGE: "<|image_pad|>", BEGIN: "<|vision_start|>", END: "<|vision_end|>"}
    _add_image_tokens(folder, names, QWEN_CHAT_TEMPLATE)
    return model, processor


IDEFICS3_TEXT = {key: value for key, value in QWEN_TEXT.items() if key != "rope_scaling"}
IDEFICS3_VISION = {key: value for key, value in VISION.items() if key != "vision_use_head"}
#: The tiles' grid tokens of the tiny Idefics3 (at most 2x2 tiles).
ROW_COL = {56 + 2 * row + col: f"<row_{row + 1}_col_{col + 1}>" for row in range(2) for col in range(2)}


def idefics3_model(folder: Path, torch: Any, transformers: Any, kind: str = "Idefics3") -> Any:
    """Write the tiny Idefics3 (``kind="SmolVLM"``: SmolVLM) model, its tokenizer and its image
    processor's settings to ``folder``; returns transformers' model (eval) and image processor."""
    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(
        text_config={"model_type": "llama", **IDEFICS3_TEXT},
        vision_config=IDEFICS3_VISION,
        image_token_id=IMAGE,
        scale_factor=2,
        attn_implementation="eager",
    )
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    processor = getattr(transformers, f"{kind}ImageProcessorPil")(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    processor.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    names = {IMAGE: "<image>", BEGIN: "<fake_token_around_image>", END: "<global-img>", **ROW_COL}
    _add_image_tokens(folder, names, CHAT_TEMPLATE.replace("<start_of_image>", "<image>"))
    return model, processor


def siglip_mmproj_writer(path: Path, vision: dict[str, Any], projector_type: str, projection_dim: int) -> Any:
    """A ``gguf.GGUFWriter`` for llama.cpp's mmproj of a SigLIP tower, its ``clip.vision.*`` keys
    written as ``convert_hf_to_gguf`` writes them (mean and std 0.5, GELU, a scale factor of 2);
    the caller adds more keys and the tensors, then writes the file."""
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector_type)
    writer.add_vision_projection_dim(projection_dim)
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean([0.5] * 3)
    writer.add_vision_image_std([0.5] * 3)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_gelu(True)
    writer.add_vision_projector_scale_factor(2)
    return writer


def _add_image_tokens(folder: Path, names: dict[int, str] | None = None, template: str = CHAT_TEMPLATE) -> None:
    """Ids 60-62 become the family's image tokens (special, so a template's markup splits off
    them; Gemma's by default), and ``template`` the chat template."""
    from tokenizers import AddedToken, Tokenizer

    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    names = names or {IMAGE: "<image_soft_token>", BEGIN: "<start_of_image>", END: "<end_of_image>"}
    for token_id, name in names.items():
        del vocab[f"t{token_id}"]
        vocab[name] = token_id
    path.write_text(json.dumps(data), encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in names.values()])
    tokenizer.save(str(path))
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text(encoding="utf-8"))
    settings["chat_template"] = template
    settings_path.write_text(json.dumps(settings), encoding="utf-8")
