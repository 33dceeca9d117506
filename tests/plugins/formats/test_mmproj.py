"""Gemma 3 with its vision tower and projector in llama.cpp's mmproj GGUF, against transformers'
Gemma3ForConditionalGeneration (CPU, float32) on a tiny random model.

The mmproj is written from transformers' weights with ``gguf``'s own writer and its own
Hugging Face -> llama.cpp tensor map (``gguf.get_tensor_name_map``), as ``convert_hf_to_gguf``
writes Gemma 3's (the projector's norm as ``1 + w``); the text model is the same checkpoint's
folder with the vision side taken out. A quantized tower (a Q8_0 mmproj, an MLX-quantized folder)
loads dequantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.loader import load_model
from mlxr_core.model.paths import resolve_projector
from mlxr_core.model.vision import logits_with_images
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import (
    BEGIN,
    END,
    IMAGE,
    QUANTIZABLE_VISION,
    TEXT,
    VISION,
    gemma3_vision_model,
    siglip_mmproj_writer,
)

PROMPT = [2, 17, 5, BEGIN, *[IMAGE] * 4, END, 9, 33, 12, 40]
VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


@attrs.frozen
class Reference:
    folder: Path  # the whole multimodal checkpoint
    text: Path  # the same without its vision side
    state: dict[str, np.ndarray]
    pixels: np.ndarray
    projected: np.ndarray
    logits: np.ndarray


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("gemma3_mm")
    model = gemma3_vision_model(folder, torch, transformers, QUANTIZABLE_VISION)
    pixels = torch.randn(1, 3, 32, 32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        projected = model.model.get_image_features(pixel_values=pixels)
        projected = getattr(projected, "pooler_output", projected)
        logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits[0]
    text = tmp_path_factory.mktemp("gemma3_text")
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, text / file.name)
    weights = {}
    for file in folder.glob("*.safetensors"):
        weights.update(load_file(file))
    save_file({k: v for k, v in weights.items() if not k.removeprefix("model.").startswith(VISION_PARTS)},
              text / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (text / "config.json").write_text(json.dumps(config))
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    return Reference(folder, text, state, pixels.numpy(), np.asarray(projected).reshape(1, 4, -1), logits.numpy())


def write_mmproj(path: Path, state: dict[str, np.ndarray], quant: str = "F32", **metadata: object) -> Path:
    """The tower and projector as ``convert_hf_to_gguf`` writes Gemma 3's mmproj; ``quant`` for the
    encoder blocks' matrices; ``metadata`` overrides ``clip.vision.*`` values."""
    vision = {**VISION, **QUANTIZABLE_VISION}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    projection_dim = int(metadata.get("projection_dim", 32))  # type: ignore[call-overload]
    # a scale factor of 2: 4x4 patches pooled to 2x2 tokens
    writer = siglip_mmproj_writer(path, vision, str(metadata.get("projector_type", "gemma3")), projection_dim)
    for name, array in state.items():
        name = name.removeprefix("model.")
        if not name.startswith(VISION_PARTS):
            continue
        if not name.startswith(("vision_tower.vision_model.", "multi_modal_projector.")):
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # the hub's names
        base, kind = name.replace("_weight", ".weight").rsplit(".", 1)
        target = f"{names.get_name(base)}.{kind}"
        array = array + 1 if "soft_emb_norm" in base else array
        array = metadata.get(target, array)  # type: ignore[assignment]
        qtype = gguf.GGMLQuantizationType[quant]
        if array.ndim == 2 and target.startswith("v.blk.") and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: Path, mmproj: Path | None = None):
    config = ModelConfig(path=str(path), dtype="float32", compile_decode=False,
                         mmproj=str(mmproj) if mmproj else None)
    return load_model(config, load_plugins().registries)


def worst(got: mx.array | np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.array(got) - want).max())


def test_a_text_folder_with_an_mmproj_matches_transformers(reference, tmp_path):
    assert load(reference.text).vision is None
    loaded = load(reference.text, write_mmproj(tmp_path / "mmproj-tiny-f32.gguf", reference.state))
    vision = loaded.vision
    assert vision is not None and vision.tokens.tokens_per_image == 4 and vision.tokens.image_token_id == IMAGE
    images = vision.encode(list(reference.pixels))
    assert worst(images, reference.projected.reshape(4, -1)) <= 1e-4
    logits = logits_with_images(loaded.model, mx.array([PROMPT]), images, vision.tokens)[0]
    assert worst(logits, reference.logits) <= 1e-4


def test_mlxr_info_describes_the_projectors_tower(reference, tmp_path):
    from mlxr_core.cli.info import describe_model

    facts = describe_model(str(reference.text), dtype="float32",
                           mmproj=str(write_mmproj(tmp_path / "mmproj.gguf", reference.state)))
    assert facts["vision"]["tokens_per_image"] == 4 and facts["vision"]["image_token_id"] == IMAGE
    assert "vision" not in describe_model(str(reference.text), dtype="float32")


def test_quantized_towers_load_dequantized(reference, tmp_path):
    """A Q8_0 mmproj, and a folder whose tower MLX quantized (8-bit, groups of 32): each tower
    holds its quantized weights' exact values and gives transformers' features within what 8-bit
    weights change (about 1% of their size)."""
    from safetensors.numpy import load_file, save_file

    scale = float(np.abs(reference.projected).max())
    loaded = load(reference.text, write_mmproj(tmp_path / "mmproj-q8_0.gguf", reference.state, "Q8_0"))
    q = reference.state["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"]
    want = gguf.quants.dequantize(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    got = loaded.vision.module.vision_tower.encoder.layers[0].self_attn.q_proj.weight
    assert worst(got, want) <= 1e-6 and worst(want, q) > 0
    assert worst(loaded.vision.encode(list(reference.pixels)), reference.projected.reshape(4, -1)) <= 0.03 * scale

    # As mlx-vlm saves a quantized Gemma 3: the tower under vision_model, its convolution channels last.
    folder = tmp_path / "mlx_quantized"
    shutil.copytree(reference.folder, folder)
    weights = {
        name.replace("vision_tower.", "vision_tower.vision_model.", 1):
            np.ascontiguousarray(array.transpose(0, 2, 3, 1)) if array.ndim == 4 else array
        for name, array in load_file(folder / "model.safetensors").items()
    }
    assert any(name.startswith("vision_tower.vision_model.embeddings.") for name in weights)
    quantized = [n for n in weights if "vision_tower." in n and n.endswith(("proj.weight", "fc1.weight", "fc2.weight"))]
    for name in quantized:
        packed, scales, biases = mx.quantize(mx.array(weights.pop(name)), group_size=32, bits=8)
        stem = name.removesuffix(".weight")
        weights.update({f"{stem}.weight": np.array(packed), f"{stem}.scales": np.array(scales),
                        f"{stem}.biases": np.array(biases)})
    save_file(weights, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}}))
    loaded = load(folder)
    assert loaded.vision is not None and len(quantized) == 2 * 6
    assert worst(loaded.vision.encode(list(reference.pixels)), reference.projected.reshape(4, -1)) <= 0.03 * scale


def test_a_corrupt_or_mismatched_mmproj_names_the_file_and_tensor(reference, tmp_path):
    good = write_mmproj(tmp_path / "mmproj.gguf", reference.state)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 4000])
    with pytest.raises(ModelLoadError) as caught:
        load(reference.text, truncated)
    assert caught.value.path == str(truncated) and caught.value.tensor is not None
    assert caught.value.tensor.startswith(("v.", "mm."))

    narrow = reference.state["model.vision_tower.encoder.layers.1.self_attn.q_proj.weight"][:, :16]
    wrong = write_mmproj(tmp_path / "wrong-shape.gguf", reference.state, **{"v.blk.1.attn_q.weight": narrow})
    with pytest.raises(ModelLoadError) as caught:
        load(reference.text, wrong)
    assert caught.value.path == str(wrong) and caught.value.tensor == "v.blk.1.attn_q.weight"

    other = write_mmproj(tmp_path / "qwen.gguf", reference.state, projector_type="qwen2.5vl_merger")
    with pytest.raises(ModelLoadError, match=r"qwen2\.5vl_merger") as caught:
        load(reference.text, other)
    assert caught.value.path == str(other) and caught.value.key == "clip.projector_type"

    wide = write_mmproj(tmp_path / "wide.gguf", reference.state, projection_dim=64)
    with pytest.raises(ModelLoadError, match="64 features") as caught:
        load(reference.text, wide)
    assert caught.value.key == "clip.vision.projection_dim"


def test_the_mmproj_beside_a_gguf_is_found(tmp_path):
    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_projector(None, model) is None
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    assert resolve_projector(None, model) == tmp_path / "mmproj-model-f16.gguf"
    assert resolve_projector("none", model) is None
    assert resolve_projector(None, tmp_path) is None  # a folder carries its tower itself
    (tmp_path / "mmproj-model-q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"name one in models\[\]\.mmproj"):
        resolve_projector(None, model)
    assert resolve_projector(str(tmp_path / "mmproj-model-q8_0.gguf"), model) == tmp_path / "mmproj-model-q8_0.gguf"


def test_a_gguf_vocabulary_gains_gemmas_image_token(tmp_path):
    """llama.cpp's Gemma 3 vocabulary stops before Hugging Face's ``<image_soft_token>``: with an
    mmproj it is appended as a control token, which a prompt's image run encodes to."""
    from mlxr_core.testing.tiny import write_tiny_llama_gguf
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
    from mlxr_plugins.formats.gguf.mmproj import GEMMA3_IMAGE_TOKEN, with_image_token
    from mlxr_plugins.formats.gguf.tokenizer import GGUFTokenizerBackend

    checkpoint = GGUFFormat().load(write_tiny_llama_gguf(tmp_path / "t.gguf"))
    size = len(checkpoint.tokenizer.data["tokenizer.ggml.tokens"])
    spec, token_id = with_image_token(checkpoint.tokenizer, GEMMA3_IMAGE_TOKEN)
    assert token_id == size
    tokenizer = GGUFTokenizerBackend().build(spec.data, chat_template=None)
    plain = tokenizer.encode("hello", add_special_tokens=False)
    ids = tokenizer.encode(f"hello{GEMMA3_IMAGE_TOKEN * 3}hello", add_special_tokens=False)
    assert ids == [*plain, size, size, size, *plain]
    assert with_image_token(spec, GEMMA3_IMAGE_TOKEN) == (spec, size)  # already there: unchanged


def write_gemma3_gguf(path: Path, state: dict[str, np.ndarray], text: dict) -> Path:
    """The language model as ``convert_hf_to_gguf`` writes Gemma 3 (norms as ``1 + w``, tied
    output), with a vocabulary of the model's 64 rows that, like llama.cpp's Gemma 3 vocabulary,
    has no ``<image_soft_token>`` (id 60 is an unused token)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(text["sliding_window"])
    tokens = ["<s>", "</s>", *(f"t{i}" for i in range(2, 64))]
    tokens[IMAGE], tokens[BEGIN], tokens[END] = "<unused0>", "<start_of_image>", "<end_of_image>"
    tokens[58], tokens[59] = "t", "2"  # one merge, t + 2 = t2: a BPE needs some
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, *[1] * 58, 3, 3, 3, 1])
    writer.add_token_merges(["t 2"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, array in state.items():
        if not name.startswith("model.language_model."):
            continue
        base, kind = name.replace("model.language_model.", "model.").rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{kind}", array + 1 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gemma3_gguf_serves_images_with_the_mmproj_beside_it(tmp_path):
    """The image token lies past the GGUF's 64 rows, as in llama.cpp's Gemma 3 files; the prompt's
    image positions take the image's rows all the same. All layers slide, as llama.cpp's fixed
    pattern (every sixth layer global) makes a 3-layer file's."""
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    text = {**TEXT, "layer_types": ["sliding_attention"] * 3}
    model = gemma3_vision_model(tmp_path / "hf", torch, transformers, QUANTIZABLE_VISION, text)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    pixels = torch.randn(1, 3, 32, 32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits[0].numpy()
    served = tmp_path / "served"
    served.mkdir()
    write_mmproj(served / "mmproj-tiny-f32.gguf", state)
    loaded = load(write_gemma3_gguf(served / "tiny-gemma3.gguf", state, text))  # the mmproj picked up
    tokens = loaded.vision.tokens
    assert tokens.image_token_id == 64 and loaded.tokenizer.vocab_size == 65
    ours = [tokens.image_token_id if t == IMAGE else t for t in PROMPT]
    image = pixels.numpy()[0]
    expanded = tokens.expand_for("t2 <start_of_image> t3", [image])
    assert loaded.tokenizer.encode(expanded, add_special_tokens=False).count(64) == 4
    images = loaded.vision.encode([image])
    logits = logits_with_images(loaded.model, mx.array([ours]), images, tokens)[0]
    assert float(np.abs(np.array(logits) - want).max()) <= 1e-4
