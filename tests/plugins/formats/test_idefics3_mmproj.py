"""SmolVLM / Idefics3 from llama.cpp's files: a ``llama`` text GGUF and an ``idefics3`` mmproj
beside it, written from a tiny random transformers Idefics3ForConditionalGeneration with ``gguf``'s
own writer and Hugging Face -> llama.cpp tensor map (q and k rows permuted as the converter does,
``clip.vision.preproc_image_size`` the processor's longest edge), against transformers (CPU,
float32): the merged sequence's logits with two images of different sizes, and the processor's
tiles from the file's settings.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.loader import load_model
from mlxr_core.model.vision import logits_with_images
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import _permute_for_ggml
from mlxr_core.testing.tiny_vision import (
    BEGIN,
    END,
    IDEFICS3_TEXT,
    IDEFICS3_VISION,
    IMAGE,
    ROW_COL,
    VOCAB,
    idefics3_model,
    siglip_mmproj_writer,
)

SIZES = [(45, 71), (30, 90)]  # 2x2 and 1x2 tiles
NEWLINE = 53  # in the GGUF's vocabulary (the folder's word-level tokenizer drops whitespace)


def write_mmproj(path: Path, state: dict[str, np.ndarray]) -> Path:
    """The tower and connector as ``convert_hf_to_gguf`` writes SmolVLM's mmproj."""
    vision = IDEFICS3_VISION
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    writer = siglip_mmproj_writer(path, vision, "idefics3", IDEFICS3_TEXT["hidden_size"])
    writer.add_vision_preproc_image_size(64)  # the processor's size.longest_edge
    for name, array in state.items():
        if name.startswith(("model.vision_model.", "model.connector.")):
            base, kind = name.rsplit(".", 1)
            writer.add_tensor(f"{names.get_name(base)}.{kind}", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(path: Path, state: dict[str, np.ndarray]) -> Path:
    """The text model as ``convert_hf_to_gguf`` writes a llama (q and k rows permuted), with the
    folder's vocabulary: the image, tile and grid tokens as control tokens."""
    text = IDEFICS3_TEXT
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, text["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(text["rope_theta"])
    special = {IMAGE: "<image>", BEGIN: "<fake_token_around_image>", END: "<global-img>", **ROW_COL}
    tokens = ["<s>", "</s>", *(special.get(i, f"t{i}") for i in range(2, VOCAB))]
    tokens[NEWLINE], tokens[54], tokens[55] = "\u010a", "t", "2"  # byte-level "\n"; one merge, as a BPE needs
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 2 or i in special else 1 for i in range(VOCAB)])
    writer.add_token_merges(["t 2"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    heads = {"q_proj": text["num_attention_heads"], "k_proj": text["num_key_value_heads"]}
    for name, array in state.items():
        if not name.startswith(("model.text_model.", "lm_head.")):
            continue
        base, kind = name.replace("model.text_model.", "model.").rsplit(".", 1)
        proj = base.rsplit(".", 1)[-1]
        if proj in heads:
            array = _permute_for_ggml(array, heads[proj])
        writer.add_tensor(f"{names.get_name(base)}.{kind}", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    image_module = pytest.importorskip("PIL.Image", reason="image input needs Pillow")
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("idefics3_hf")
    model, processor = idefics3_model(folder, torch, transformers)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    rng = np.random.default_rng(3)
    images = [image_module.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    pixels = [processor(image, return_tensors="pt")["pixel_values"] for image in images]
    files = tmp_path_factory.mktemp("idefics3_gguf")
    write_mmproj(files / "mmproj-tiny-f32.gguf", state)
    loaded = load_model(
        ModelConfig(path=str(write_llama_gguf(files / "tiny-smolvlm.gguf", state)), dtype="float32", compile_decode=False),
        load_plugins().registries,
    )  # the mmproj beside it picked up
    ours = [loaded.vision.processor(image) for image in images]
    text = loaded.vision.tokens.expand_for("t5 t17 <image> t9 t33 <image> t12 t40", ours)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=torch.cat(pixels, dim=1)).logits[0].numpy()
    return loaded, [p[0].numpy() for p in pixels], ours, ids, want, files


def test_a_llama_gguf_with_an_idefics3_mmproj_matches_transformers(served):
    loaded, theirs, ours, ids, want, _ = served
    assert loaded.config["model_type"] == "idefics3" and loaded.vision.tokens.image_token_id == IMAGE
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.shape == reference.shape and float(np.abs(mine - reference).max()) <= 1e-6
    # The GGUF vocabulary reads an image's text as the folder's tokenizer does, its newlines kept.
    image_text = loaded.vision.tokens.expand_for("<image>", [ours[0]])
    image_ids = loaded.tokenizer.encode(image_text, add_special_tokens=False)
    kept = [t for t in image_ids if t != NEWLINE]
    assert image_ids.count(NEWLINE) == 3 and kept == ids[2 : 2 + len(kept)] and len(kept) == 4 * 6 + 7
    assert ids.count(IMAGE) == 4 * (5 + 3)
    images = loaded.vision.encode(ours)
    logits = logits_with_images(loaded.model, mx.array([ids]), images, loaded.vision.tokens)[0]
    assert float(np.abs(np.array(logits) - want).max()) <= 1e-4


def test_an_idefics3_projector_refuses_a_llama_of_another_width(served, tmp_path):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    *_, files = served
    copy = tmp_path / "mmproj.gguf"
    copy.write_bytes((files / "mmproj-tiny-f32.gguf").read_bytes())
    config = ModelConfig(path=str(write_tiny_llama_gguf(tmp_path / "t.gguf")), mmproj=str(copy), dtype="float32")
    with pytest.raises(ModelLoadError, match="text model's width is"):
        load_model(config, load_plugins().registries)
