"""Gemma 3's vision side against transformers' Gemma3ForConditionalGeneration (CPU, float32):
a tiny random model with a tiny SigLIP tower (32x32 pixels, 8x8 patches, 4 tokens per image),
saved by transformers (:mod:`mlxr_core.testing.tiny_vision`) and loaded through mlxr's loader.

The merged sequence's logits match transformers' with the image's tokens attending to each other
both ways (transformers' ``token_type_ids``), in a prompt within the sliding window and in one
longer than it.
"""

from __future__ import annotations

import json

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import RequestError
from mlxr_core.model.vision import (
    ImageTokens,
    image_prefill_mask,
    logits_with_images,
    merge_embeddings,
)
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import BEGIN, END, IMAGE, TEXT, gemma3_vision_model

#: Text, ``<start_of_image>``, four soft tokens, ``<end_of_image>``, text.
PROMPT = [2, 17, 5, BEGIN, *[IMAGE] * 4, END, 9, 33, 12, 40]
#: Longer than the 32-position sliding window, the image at its end.
LONG_PROMPT = [3 + i % 50 for i in range(30)] + PROMPT
#: Pan-and-scan settings for the tiny tower's 32-pixel images, and a wide image they cut in three.
PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
WIDE = (71, 23)
#: The wide image and its three crops, each a run with text between (as transformers' processor
#: writes an image with crops; here as token ids).
RUN = [BEGIN, *[IMAGE] * 4, END]
CROPS_PROMPT = [2, 17, *RUN, 9, 33, *RUN, 5, *RUN, 5, *RUN, 12, 40]


@attrs.frozen
class Reference:
    folder: object
    pixels: np.ndarray  # [1, C, H, W]
    tower: np.ndarray
    projected: np.ndarray
    logits: np.ndarray
    text_logits: np.ndarray  # the same prompt without the image (token type ids off)
    long_logits: np.ndarray
    crops_pixels: np.ndarray  # transformers' processor, pan-and-scan: [1 + crops, C, H, W]
    crops_logits: np.ndarray


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp("gemma3_vision")
    model = gemma3_vision_model(folder, torch, transformers)
    pixels = torch.randn(1, 3, 32, 32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        tower = model.model.vision_tower(pixel_values=pixels).last_hidden_state
        projected = model.model.multi_modal_projector(tower)
        logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
        text_logits = model(input_ids=ids, pixel_values=pixels).logits
        long = torch.tensor([LONG_PROMPT])
        long_logits = model(input_ids=long, pixel_values=pixels, token_type_ids=(long == IMAGE).long()).logits
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=True, **PAN_AND_SCAN)
    crops = processor(wide_image(), return_tensors="pt")
    assert crops["num_crops"].tolist() == [3]
    with torch.no_grad():
        crops_ids = torch.tensor([CROPS_PROMPT])
        crops_logits = model(input_ids=crops_ids, pixel_values=crops["pixel_values"],
                             token_type_ids=(crops_ids == IMAGE).long()).logits
    return Reference(
        folder,
        pixels.numpy(),
        tower.numpy(),
        projected.numpy(),
        logits[0].numpy(),
        text_logits[0].numpy(),
        long_logits[0].numpy(),
        crops["pixel_values"].numpy(),
        crops_logits[0].numpy(),
    )


def wide_image(size: tuple[int, int] = WIDE):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(5).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def loaded(reference):
    from mlxr_core.testing.hf_reference import load_reference_model

    return load_reference_model(reference, load_plugins().registries)  # type: ignore[arg-type]


def worst(got: mx.array | np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.array(got) - want).max())


def test_vision_tower_and_projector_match_transformers(reference, loaded):
    vision = loaded.vision
    assert vision is not None and vision.tokens.tokens_per_image == 4
    pixels = mx.array(reference.pixels.transpose(0, 2, 3, 1))
    tower = vision.module.vision_tower(pixels)
    assert tower.shape == reference.tower.shape
    assert worst(tower, reference.tower) <= 1e-4
    projected = vision.module.multi_modal_projector(tower)
    assert projected.shape == (1, 4, TEXT["hidden_size"])
    assert worst(projected, reference.projected) <= 1e-4
    assert worst(vision.encode(list(reference.pixels)), reference.projected) <= 1e-4


def test_logits_with_one_image_match_transformers(reference, loaded):
    vision = loaded.vision
    images = vision.encode(list(reference.pixels))
    logits = logits_with_images(loaded.model, mx.array([PROMPT]), images, vision.tokens)[0]
    assert worst(logits, reference.logits) <= 1e-4
    # Bidirectional attention among the image's tokens changes the logits from there on.
    assert worst(reference.logits, reference.text_logits) > 1e-3
    causal = attrs.evolve(vision.tokens, bidirectional=False)
    causal_logits = logits_with_images(loaded.model, mx.array([PROMPT]), images, causal)[0]
    assert worst(causal_logits, reference.text_logits) <= 1e-4


def test_logits_past_the_sliding_window_match_transformers(reference, loaded):
    vision = loaded.vision
    images = vision.encode(list(reference.pixels))
    assert len(LONG_PROMPT) > TEXT["sliding_window"]
    logits = logits_with_images(loaded.model, mx.array([LONG_PROMPT]), images, vision.tokens)[0]
    assert worst(logits, reference.long_logits) <= 1e-4


def test_cached_decoding_after_an_image_matches_one_pass(reference, loaded):
    vision = loaded.vision
    images = vision.encode(list(reference.pixels))
    cache = loaded.make_cache()
    split = PROMPT.index(END) + 1
    first = logits_with_images(loaded.model, mx.array([PROMPT[:split]]), images, vision.tokens, cache)
    steps = [first] + [loaded.model(mx.array([[token]]), cache=cache) for token in PROMPT[split:]]
    assert worst(mx.concatenate(steps, axis=1)[0], reference.logits) <= 1e-4


def test_image_processor_matches_transformers(reference, loaded, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    image_module = pytest.importorskip("PIL.Image", reason="image input needs Pillow")
    rng = np.random.default_rng(3)
    png = tmp_path / "image.png"
    image_module.fromarray(rng.integers(0, 256, (45, 71, 3), dtype=np.uint8)).save(png)
    theirs = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    with image_module.open(png) as image:
        want = theirs(image, return_tensors="np")["pixel_values"][0]
        ours = loaded.vision.processor(image)
    assert ours.dtype == np.float32 and ours.shape == want.shape == (3, 32, 32)
    assert worst(ours, want) <= 1e-6
    # The same from the preprocessor config transformers writes.
    theirs.save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "preprocessor_config.json").read_text())
    arch = loaded.arch.vision(loaded.config)
    with image_module.open(png) as image:
        assert worst(arch.processor(loaded.config, settings)(image), want) <= 1e-6


def test_image_tokens_expand_the_marker(loaded):
    tokens = loaded.arch.vision({**loaded.config, "mm_tokens_per_image": 256}).image_tokens(loaded.config)
    text = tokens.expand("<start_of_turn>user\n<start_of_image>What is it?")
    assert text.count("<image_soft_token>") == 4 and "\n\n<start_of_image><image_soft_token>" in text
    assert text.endswith("<end_of_image>\n\nWhat is it?")
    assert tokens.count(PROMPT) == 1
    with pytest.raises(RequestError, match="multiple of 4"):
        tokens.count(PROMPT[:-7])


def test_merge_refuses_a_count_mismatch_and_masks_images_both_ways():
    tokens = ImageTokens(IMAGE, 4, "<m>", "<t>", bidirectional=True)
    embeddings = mx.zeros((1, len(PROMPT), 8))
    with pytest.raises(RequestError, match="4 image token positions for 8"):
        merge_embeddings(embeddings, mx.array([PROMPT]), mx.ones((2, 4, 8)), tokens.image_token_id)
    merged = merge_embeddings(embeddings, mx.array([PROMPT]), mx.arange(32.0).reshape(1, 4, 8), IMAGE)
    rows = np.array(merged[0, :, 0])
    assert rows.tolist() == [0] * 4 + [0, 8, 16, 24] + [0] * 5
    mask = np.array(image_prefill_mask(mx.array([PROMPT]), IMAGE, offset=2))[0, 0]
    assert mask.shape == (len(PROMPT), len(PROMPT) + 2)
    first, last = PROMPT.index(IMAGE), PROMPT.index(IMAGE) + 3
    assert mask[first, last + 2]  # the image's first token sees its last
    assert not mask[first - 1, first + 2]  # the text before it does not
    assert not mask[last + 1, last + 4]  # nor does any token see a later text token
    assert mask[:, :2].all()  # cached positions are all earlier


def test_text_only_checkpoints_have_no_vision(loaded):
    assert loaded.arch.vision({k: v for k, v in loaded.config.items() if k != "vision_config"}) is None


@pytest.mark.parametrize(
    "tower, projector",
    [
        ("model.vision_tower.vision_model.", "model.multi_modal_projector."),  # transformers >= 4.52
        ("vision_tower.vision_model.", "multi_modal_projector."),  # earlier
        ("vision_tower.", "multi_modal_projector."),  # transformers 5's saving
    ],
)
def test_every_weight_layout_maps_onto_the_module(loaded, tower, projector):
    from mlx.utils import tree_flatten

    arch = loaded.arch.vision(loaded.config)
    params = dict(tree_flatten(loaded.vision.module.parameters()))
    checkpoint = {"model.language_model.norm.weight": mx.zeros((32,))}  # text tensors are left out
    for name, array in params.items():
        if name == "vision_tower.embeddings.patch_embedding.weight":
            array = array.transpose(0, 3, 1, 2)  # torch's [D, C, P, P]
        part, rest = name.split(".", 1)
        checkpoint[(tower if part == "vision_tower" else projector) + rest] = array
    checkpoint[tower + "head.probe"] = mx.zeros((1, 1, 24))  # the pooling head is not built
    sanitized = arch.sanitize(checkpoint, loaded.config)
    assert sorted(sanitized) == sorted(params)
    assert all(mx.array_equal(sanitized[name], params[name]) for name in params)


@pytest.mark.parametrize("size", [WIDE, (20, 64), (40, 36), (8, 30)])  # wide, tall, near square, too narrow
def test_pan_and_scan_crops_match_transformers(loaded, size):
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    from mlxr_core.config.schema import VisionConfig

    settings = VisionConfig(pan_and_scan=True, **PAN_AND_SCAN).processor_settings()
    ours = loaded.arch.vision(loaded.config).processor(loaded.config, settings)(wide_image(size))
    theirs = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=True, **PAN_AND_SCAN)
    want = theirs(wide_image(size), return_tensors="np")
    assert ours.shape == (1 + want["num_crops"][0], 3, 32, 32)
    assert worst(ours, np.stack(want["pixel_values"])) <= 1e-6


def test_logits_with_pan_and_scan_crops_match_transformers(reference, loaded):
    vision = loaded.vision
    pixels = reference.crops_pixels
    assert vision.tokens.views_for(pixels) == 4 and vision.tokens.tokens_for(pixels) == 16
    images = vision.encode([pixels])
    assert images.shape == (16, TEXT["hidden_size"])
    logits = logits_with_images(loaded.model, mx.array([CROPS_PROMPT]), images, vision.tokens)[0]
    assert worst(logits, reference.crops_logits) <= 1e-4
    # The prompt's text for it: one run per view, as transformers' Gemma3Processor writes them.
    run = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    text = vision.tokens.expand_for("a <start_of_image> b <start_of_image>", [pixels, pixels[0]])
    assert text == (f"a Here is the original image {run} and here are some crops to help you see better "
                    f"{run} {run} {run} b {run}")


def test_pan_and_scan_is_refused_for_a_model_without_it(tmp_path):
    from mlxr_core.config.schema import ModelConfig, VisionConfig
    from mlxr_core.errors import ConfigError
    from mlxr_core.model.loader import load_model
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    config = ModelConfig(path=str(write_tiny_llama_gguf(tmp_path / "t.gguf")), vision=VisionConfig(pan_and_scan=True))
    with pytest.raises(ConfigError, match="pan_and_scan") as caught:
        load_model(config, load_plugins().registries)
    assert caught.value.field == "models[].vision.pan_and_scan"
