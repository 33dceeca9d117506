"""Idefics3 and SmolVLM against transformers' Idefics3ForConditionalGeneration and
SmolVLMForConditionalGeneration (CPU, float32): tiny random models (:mod:`mlxr_core.testing.tiny_vision`:
tiles of 32x32 pixels, 4 tokens each, images resized to a longest edge of 64) saved by
transformers and loaded through mlxr's loader, with two images of different sizes: a 2x2 grid of
tiles and a 1x2 grid, each followed by the whole image.

Shown for both: the image processor's pixels and tiles, the prompt text of each image, the
tower's and connector's output, the merged sequence's logits with one image and with two, and
cached decoding, the engine's greedy tokens for image and text requests alone, batched and
chunked (transformers' own), and the model's resident bytes counting the vision side.
"""

from __future__ import annotations

import hashlib
import types

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxr_core.chat.prompt import encode_chat
from mlxr_core.errors import ModelLoadError, RequestError
from mlxr_core.model.vision import logits_with_images
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import IMAGE, idefics3_model

#: (height, width): 2x2 tiles and 1x2 tiles after resizing to a longest edge of 64.
SIZES = [(45, 71), (30, 90)]
VIEWS = [5, 3]
STEPS = 5
LEAD, TAIL = "t5 t17 t9", "t33 t12 t40"


@attrs.frozen
class Reference:
    kind: str
    folder: object
    images: list  # PIL images
    pixels: list[np.ndarray]  # per image, transformers' [views, C, H, W]
    grids: list[tuple[int, int]]  # per image, transformers' (rows, cols)
    tower: list[np.ndarray]  # per image, the tower's last hidden states
    features: list[np.ndarray]  # per image, the connector's output
    ids: dict[str, list[int]]
    logits: dict[str, np.ndarray]
    greedy: dict[str, list[int]]


def image_text(kind: str, rows: int, cols: int) -> str:
    """transformers' processor's text for one image of ``rows x cols`` tiles (4 tokens a tile)."""
    tokens = {"fake_token_around_image": "<fake_token_around_image>", "image_token": "<image>",
              "global_image_token": "<global-img>"}  # fmt: skip
    if kind == "SmolVLM":
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        return get_image_prompt_string(rows, cols, 4, **tokens)
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    fake = types.SimpleNamespace(fake_image_token=tokens["fake_token_around_image"], image_token="<image>",
                                 global_image_tag="<global-img>", image_seq_len=4)  # fmt: skip
    return Idefics3Processor.replace_image_token(fake, {"rows": [[rows]], "cols": [[cols]]}, 0)


@pytest.fixture(scope="module", params=["Idefics3", "SmolVLM"])
def reference(request, tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    image_module = pytest.importorskip("PIL.Image", reason="image input needs Pillow")

    kind = request.param
    folder = tmp_path_factory.mktemp(kind.lower())
    model, processor = idefics3_model(folder, torch, transformers, kind)
    rng = np.random.default_rng(3)
    images = [image_module.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    processed = [processor(image, return_tensors="pt", return_row_col_info=True) for image in images]
    pixels = [p["pixel_values"] for p in processed]  # [1, views, C, H, W]
    grids = [(p["rows"][0][0], p["cols"][0][0]) for p in processed]
    texts = {
        "one": f"{LEAD} {image_text(kind, *grids[0])} {TAIL}",
        "two": f"{LEAD} {image_text(kind, *grids[0])} t9 t33 {image_text(kind, *grids[1])} {TAIL}",
    }
    tokenizer = tokenizer_of(folder)
    ids = {name: tokenizer.encode(text).ids for name, text in texts.items()}
    ids["text"] = [2, 7, 11, 19, 23, 29, 31, 37]
    which = {"one": [0], "two": [0, 1], "text": []}
    logits, greedy = {}, {}
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    with torch.no_grad():
        tower = [model.model.vision_model(pixel_values=p[0]).last_hidden_state for p in pixels]
        features = [model.model.connector(t) for t in tower]
        for name, prompt in ids.items():
            extra = {"pixel_values": torch.cat([pixels[k] for k in which[name]], dim=1)} if which[name] else {}
            tensor = torch.tensor([prompt])
            logits[name] = model(input_ids=tensor, **extra).logits[0].numpy()
            out = model.generate(input_ids=tensor, max_new_tokens=STEPS, do_sample=False, **extra)
            greedy[name] = out[0, len(prompt):].tolist()
            assert len(greedy[name]) == STEPS
    return Reference(
        kind, folder, images, [p[0].numpy() for p in pixels], grids,
        [t.numpy() for t in tower], [f.numpy() for f in features], ids, logits, greedy,
    )  # fmt: skip


def tokenizer_of(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def loaded(reference):
    from mlxr_core.testing.hf_reference import load_reference_model

    return load_reference_model(reference, load_plugins().registries)  # type: ignore[arg-type]


def worst(got: mx.array | np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.array(got) - want).max())


def test_image_processor_matches_transformers(reference, loaded):
    assert reference.grids == [(2, 2), (1, 2)]
    for image, want, (rows, cols) in zip(reference.images, reference.pixels, reference.grids, strict=True):
        ours = loaded.vision.processor(image)
        assert ours.dtype == np.float32 and ours.shape == want.shape
        assert (ours.rows, ours.cols) == (rows, cols)
        assert worst(ours, want) <= 1e-6
        assert loaded.vision.tokens.expand_for("a <image> b", [ours]) == f"a {image_text(reference.kind, rows, cols)} b"


def test_one_view_without_splitting_matches_transformers(reference, loaded):
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    settings = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}, "do_image_splitting": False}
    ours = loaded.arch.vision(loaded.config).processor(loaded.config, settings)(reference.images[1])
    theirs = transformers.Idefics3ImageProcessorPil(**settings)(reference.images[1], return_tensors="np")
    assert ours.shape == (1, 3, 32, 32) and worst(ours, theirs["pixel_values"][0]) <= 1e-6
    text = loaded.vision.tokens.expand_for("<image>", [ours])
    assert text == image_text(reference.kind, 0, 0) == "<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"


def test_vision_tower_and_connector_match_transformers(reference, loaded):
    module = loaded.vision.module
    for pixels, tower, features in zip(reference.pixels, reference.tower, reference.features, strict=True):
        ours = module.vision_model(mx.array(pixels.transpose(0, 2, 3, 1)))
        assert ours.shape == tower.shape and worst(ours, tower) <= 1e-4
        assert worst(module.connector(ours), features) <= 1e-4
    encoded = loaded.vision.encode(reference.pixels)
    assert encoded.shape == (4 * sum(VIEWS), 32)
    assert worst(encoded, np.concatenate([f.reshape(-1, 32) for f in reference.features])) <= 1e-4


@pytest.mark.parametrize("name, images", [("one", [0]), ("two", [0, 1])])
def test_logits_with_images_match_transformers(reference, loaded, name, images):
    vision = loaded.vision
    encoded = vision.encode([reference.pixels[k] for k in images])
    logits = logits_with_images(loaded.model, mx.array([reference.ids[name]]), encoded, vision.tokens)[0]
    assert worst(logits, reference.logits[name]) <= 1e-4


def test_cached_decoding_after_two_images_matches_one_pass(reference, loaded):
    vision = loaded.vision
    prompt = reference.ids["two"]
    split = len(prompt) - 3  # past the last image's tokens
    cache = loaded.make_cache()
    first = logits_with_images(loaded.model, mx.array([prompt[:split]]), vision.encode(reference.pixels), vision.tokens, cache)
    steps = [first] + [loaded.model(mx.array([[token]]), cache=cache) for token in prompt[split:]]
    assert worst(mx.concatenate(steps, axis=1)[0], reference.logits["two"]) <= 1e-4


def test_image_and_text_requests_batch_and_chunk_like_transformers(reference, loaded):
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import (
        Delta,
        Finished,
        GenerationRequest,
        PromptImage,
        SamplingParams,
    )

    config = Config(
        models=[ModelConfig(path=str(reference.folder), name="vision", dtype="float32", compile_decode=False)],
        engine=EngineConfig(max_batch_size=4, prefill_chunk=5, prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    pixels = [loaded.vision.processor(image) for image in reference.images]

    def submit(name: str, which: list[int]):
        images = [PromptImage(pixels[k], hashlib.sha256(pixels[k].tobytes()).hexdigest()) for k in which]
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, extra={"ignore_eos": True})
        return engine.submit(GenerationRequest(model="vision", prompt_ids=reference.ids[name], params=params, images=images))

    def tokens(handle) -> list[int]:
        events = list(handle)
        assert isinstance(events[-1], Finished), events[-1]
        return [t for e in events if isinstance(e, Delta) for t in e.token_ids]

    try:
        # A chat message's image part becomes the image's tiles and tokens, as the processor writes them.
        parts = [{"type": "text", "text": LEAD}, {"type": "image"}, {"type": "text", "text": TAIL}]
        image = PromptImage(pixels[0], "0" * 64)
        assert encode_chat(engine.model("vision"), [{"role": "user", "content": parts}], images=[image]) == reference.ids["one"]
        assert tokens(submit("two", [0, 1])) == reference.greedy["two"]  # alone
        handles = [submit("two", [0, 1]), submit("text", []), submit("one", [0])]
        assert [tokens(h) for h in handles] == [reference.greedy[name] for name in ("two", "text", "one")]
    finally:
        engine.stop()


def test_resident_bytes_count_the_vision_side(loaded):
    text = sum(array.nbytes for _, array in tree_flatten(loaded.model.parameters()))
    vision = sum(array.nbytes for _, array in tree_flatten(loaded.vision.module.parameters()))
    assert vision > 0 and loaded.nbytes == text + vision


def test_bad_layouts_and_settings_are_refused(reference, loaded):
    tokens = loaded.vision.tokens
    with pytest.raises(RequestError, match="5 views needs its tiles' rows and columns"):
        tokens.expand_for("<image>", [np.asarray(reference.pixels[0])])
    with pytest.raises(RequestError, match="renders 2 images for the 1 images"):
        tokens.expand_for("<image><image>", [loaded.vision.processor(reference.images[0])])
    vision = loaded.arch.vision(loaded.config)
    with pytest.raises(ModelLoadError, match=r"max_image_size\.longest_edge 64 is not the tower's image_size 32"):
        vision.processor(loaded.config, {"max_image_size": {"longest_edge": 64}})
    with pytest.raises(ModelLoadError, match="scale_factor 3"):
        vision.image_tokens({**loaded.config, "scale_factor": 3})
    assert loaded.arch.vision({k: v for k, v in loaded.config.items() if k != "vision_config"}) is None
    assert sum(t == IMAGE for t in reference.ids["two"]) == 4 * sum(VIEWS)


@pytest.mark.parametrize("text, tower", [("model.text_model.", "model."), ("language_model.model.", "")])  # transformers, mlx-vlm
def test_each_weight_layout_maps_onto_the_modules(loaded, text, tower):
    vision_params = dict(tree_flatten(loaded.vision.module.parameters()))
    text_params = dict(tree_flatten(loaded.model.parameters()))
    checkpoint = {tower + name: array for name, array in vision_params.items()}
    head = "lm_head." if text.startswith("model.") else "language_model.lm_head."
    checkpoint |= {name.replace("model.", text, 1).replace("lm_head.", head, 1): a for name, a in text_params.items()}
    vision = loaded.arch.vision(loaded.config).sanitize(checkpoint, loaded.config)
    assert sorted(vision) == sorted(vision_params)
    assert sorted(loaded.arch.sanitize(checkpoint, loaded.config)) == sorted(text_params)


@pytest.mark.parametrize(
    "size, resize",
    [((1, 1), True), ((3, 500), True), ((200, 7), True), ((64, 64), True), ((45, 71), False)],
)  # (height, width): tiny, a sliver each way, exact; without the first resize (do_resize: false)
def test_odd_image_sizes_cut_as_transformers_cuts_them(reference, loaded, size, resize):
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(7).integers(0, 256, (*size, 3), dtype=np.uint8))
    settings = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}, "do_resize": resize}
    processor = getattr(transformers, f"{reference.kind}ImageProcessorPil")(**settings)
    theirs = processor(image, return_tensors="np", return_row_col_info=True)
    ours = loaded.arch.vision(loaded.config).processor(loaded.config, settings)(image)
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ours.shape == theirs["pixel_values"][0].shape and worst(ours, theirs["pixel_values"][0]) <= 1e-6


def test_mlxr_info_reports_the_vision_side(reference, loaded):
    from mlxr_core.cli.info import describe_model

    facts = describe_model(str(reference.folder), dtype="float32")
    assert facts["architecture"] == reference.kind.lower()
    params = sum(array.size for _, array in tree_flatten(loaded.vision.module.parameters()))
    assert facts["vision"] == {
        "parameters": params, "resident_bytes": params * 4, "tokens_per_image": 4, "image_token_id": IMAGE,
    }
