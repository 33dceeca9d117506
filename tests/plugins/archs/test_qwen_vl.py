"""Qwen2.5-VL and Qwen3-VL against transformers' Qwen2_5_VLForConditionalGeneration and
Qwen3VLForConditionalGeneration (CPU, float32): tiny random models
(:mod:`mlxr_core.testing.tiny_vision`: 4x4 patches merged 2x2; Qwen2.5-VL's windows of 2x2
tokens and one full-attention block, Qwen3-VL's resampled position table and DeepStack features
from two blocks) saved by transformers and loaded through mlxr's loader, with two images of
different sizes (3x5 and 2x2 tokens).

Shown for both: the image processor's patches and grids, the vision tower's output for both
images, the merged sequence's logits with one image and with two, and cached decoding after the
prompt (greedy tokens and each step's logits) through the batched decode step and its M-RoPE
shift. The rest (marker expansion, weight layouts, bad configs, ``mlxr info``) on Qwen2.5-VL.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.engine.images import PromptImages
from mlxr_core.engine.request import PromptImage
from mlxr_core.errors import RequestError
from mlxr_core.model.layers.mrope import mrope_positions
from mlxr_core.model.vision import logits_with_images
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import BEGIN, END, IMAGE, qwen2_5_vl_model, qwen3_vl_model

WRITERS = {"qwen2_5_vl": qwen2_5_vl_model, "qwen3_vl": qwen3_vl_model}
#: The tests that need one family only.
QWEN2_5 = pytest.mark.parametrize("reference", ["qwen2_5_vl"], indirect=True)
STEPS = 5
#: (height, width) in pixels: 3x5 and 2x2 tokens of 8x8 pixels after resizing.
SIZES = [(23, 41), (16, 15)]


def prompt_for(*counts: int) -> list[int]:
    """Text, then each image's run of tokens between its start and end tokens, then text."""
    ids = [2, 17, 5]
    for count in counts:
        ids += [BEGIN, *[IMAGE] * count, END, 9, 33]
    return [*ids, 12, 40]


@attrs.frozen
class Reference:
    folder: object
    images: list  # PIL images
    hf_pixels: list[np.ndarray]  # per image, transformers' pixel_values rows
    grids: list[tuple[int, int, int]]
    tower: list[np.ndarray]  # per image, the merged tokens
    one_logits: np.ndarray
    two_logits: np.ndarray
    greedy: list[int]
    step_logits: np.ndarray  # [STEPS, vocab]


@pytest.fixture(scope="module", params=sorted(WRITERS))
def reference(request, tmp_path_factory) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    image_module = pytest.importorskip("PIL.Image", reason="image input needs Pillow")
    folder = tmp_path_factory.mktemp(request.param)
    model, processor = WRITERS[request.param](folder, torch, transformers)
    rng = np.random.default_rng(3)
    images = [image_module.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    processed = [processor(image, return_tensors="pt") for image in images]
    pixels = [p["pixel_values"] for p in processed]
    grids = [p["image_grid_thw"] for p in processed]
    counts = [int(g.prod()) // 4 for g in grids]

    def forward(ids: list[int], which: list[int], **extra):
        tensor = torch.tensor([ids])
        return dict(
            input_ids=tensor,
            pixel_values=torch.cat([pixels[k] for k in which]),
            image_grid_thw=torch.cat([grids[k] for k in which]),
            mm_token_type_ids=(tensor == IMAGE).int(),
            **extra,
        )

    with torch.no_grad():
        tower = []
        for k in range(2):
            out = model.model.visual(pixels[k], grid_thw=grids[k])
            deepstack = [feature.numpy() for feature in getattr(out, "deepstack_features", None) or []]
            tower.append(np.concatenate([out.pooler_output.numpy(), *deepstack], axis=-1))
        one = model(**forward(prompt_for(counts[0]), [0])).logits[0].numpy()
        two_prompt = prompt_for(*counts)
        two = model(**forward(two_prompt, [0, 1])).logits[0].numpy()
        out = model.generate(**forward(two_prompt, [0, 1]), max_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    greedy = out.sequences[0, len(two_prompt):].tolist()
    step_logits = torch.cat(out.logits).numpy()
    return Reference(
        folder, images, [p.numpy() for p in pixels], [tuple(int(v) // d for v, d in zip(g[0].tolist(), (1, 2, 2), strict=True)) for g in grids],
        tower, one, two, greedy, step_logits,
    )  # fmt: skip


@pytest.fixture(scope="module")
def loaded(reference):
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(reference.folder), dtype="float32", compile_decode=False)
    return load_model(config, load_plugins().registries)


def worst(got: mx.array | np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.array(got) - want).max())


def processed(loaded, reference) -> list[np.ndarray]:
    return [loaded.vision.processor(image) for image in reference.images]


def test_image_processor_matches_transformers(reference, loaded):
    for pixels, want, grid in zip(processed(loaded, reference), reference.hf_pixels, reference.grids, strict=True):
        assert pixels.dtype == np.float32
        assert loaded.vision.tokens.grid(pixels) == grid
        assert worst(pixels.reshape(want.shape), want) <= 1e-6
    assert [g[1:] for g in reference.grids] == [(3, 5), (2, 2)]


def test_vision_tower_matches_transformers(reference, loaded):
    pixels = processed(loaded, reference)
    for image, want in zip(pixels, reference.tower, strict=True):
        got = loaded.vision.module(mx.array(image[None]))
        assert got.shape == (1, *want.shape)
        assert worst(got[0], want) <= 1e-4
    # Two images of different sizes in one call: each image's tokens, in order; two of one size
    # go through the tower together.
    assert worst(loaded.vision.encode(pixels), np.concatenate(reference.tower)) <= 1e-4
    want = np.concatenate([reference.tower[0], reference.tower[0], reference.tower[1]])
    assert worst(loaded.vision.encode([pixels[0], pixels[0], pixels[1]]), want) <= 1e-4


def rotary_positions(prompt: list[int], pixels: list[np.ndarray], loaded) -> PromptImages:
    images = [PromptImage(p, str(k)) for k, p in enumerate(pixels)]
    return PromptImages(prompt, images, loaded.vision.tokens)


@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_match_transformers(reference, loaded, count):
    pixels = processed(loaded, reference)[:count]
    vision = loaded.vision
    prompt = prompt_for(*(vision.tokens.tokens_for(p) for p in pixels))
    placed = rotary_positions(prompt, pixels, loaded)
    assert placed.positions is not None
    logits = logits_with_images(loaded.model, mx.array([prompt]), vision.encode(pixels), vision.tokens,
                                positions=mx.array(placed.positions[:, None]))[0]  # fmt: skip
    want = reference.one_logits if count == 1 else reference.two_logits
    assert logits.shape == want.shape
    assert worst(logits, want) <= 1e-4
    # Without M-RoPE's positions the same embeddings give other logits: the positions matter.
    plain = logits_with_images(loaded.model, mx.array([prompt]), vision.encode(pixels), vision.tokens)[0]
    assert worst(plain, want) > 1e-2


def test_cached_decoding_after_two_images_matches_transformers(reference, loaded):
    pixels = processed(loaded, reference)
    vision = loaded.vision
    prompt = prompt_for(*(vision.tokens.tokens_for(p) for p in pixels))
    placed = rotary_positions(prompt, pixels, loaded)
    assert placed.shift < 0  # the images take fewer positions than tokens
    cache = loaded.make_cache()
    # Prefill in two chunks (the second starts inside the text between the images), as the engine does.
    split = prompt.index(END) + 2
    for start, stop in ((0, split), (split, len(prompt) - 1)):
        chunk = pixels[:1] if start == 0 else pixels[1:]
        logits_with_images(loaded.model, mx.array([prompt[start:stop]]), vision.encode(chunk), vision.tokens,
                           cache, start, mx.array(placed.positions[:, None, start:stop]))  # fmt: skip
    rows = [layer.to_batch() for layer in cache]
    token, tokens, steps = prompt[-1], [], []
    for _ in range(STEPS):
        logits = loaded.decode(mx.array([token]), rows, None, mx.array([placed.shift]))
        token = int(mx.argmax(logits[0]).item())
        steps.append(np.array(logits[0]))
        tokens.append(token)
    # The first step feeds the last prompt token: its logits are the prompt's last.
    assert worst(steps[0], reference.two_logits[-1]) <= 1e-4
    assert tokens == reference.greedy
    assert worst(np.stack(steps), reference.step_logits) <= 1e-4
    # Decoded at the cache's own positions instead, the steps after the prompt go wrong.
    rows = [layer.to_batch() for layer in cache]
    unshifted = loaded.decode(mx.array([prompt[-1]]), rows, None)
    assert worst(unshifted[0], reference.step_logits[0]) > 1e-2


def test_mrope_positions_follow_the_grids():
    # Text, a 1x2x3 image, text: the image's rows and columns count from where it starts, and
    # the text after it from the largest position before it plus one.
    positions = mrope_positions(10, [(2, 8)], [(1, 2, 3)])
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


@QWEN2_5
def test_image_tokens_expand_each_marker_by_its_image(reference, loaded):
    tokens = loaded.vision.tokens
    pixels = processed(loaded, reference)
    counts = [tokens.tokens_for(p) for p in pixels]
    assert counts == [15, 4]
    text = tokens.expand("a<|vision_start|><|image_pad|><|vision_end|>b<|image_pad|>", counts)
    assert text == "a<|vision_start|>" + "<|image_pad|>" * 15 + "<|vision_end|>b" + "<|image_pad|>" * 4
    with pytest.raises(RequestError, match="renders 2 images for the 1 images"):
        tokens.expand("a<|image_pad|>b<|image_pad|>", counts[:1])
    with pytest.raises(RequestError, match="of 15, 4 tokens"):
        rotary_positions(prompt_for(15, 3), pixels, loaded)
    assert tokens.count(prompt_for(15, 4)) == 2 and tokens.count(prompt_for()) == 0


@QWEN2_5
def test_configs_the_graph_cannot_follow_are_refused_naming_the_key(reference, loaded):
    from mlxr_core.errors import ModelLoadError
    from mlxr_core.kernels import bind_kernels

    registries = load_plugins().registries
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=loaded.arch.kernel_context(loaded.config))
    text = dict(loaded.config["text_config"])
    cases = {
        "rope_scaling.mrope_section": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 3, 4]}},
        "rope_scaling": {**text, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
    }
    for key, broken in cases.items():
        with pytest.raises(ModelLoadError) as caught:
            loaded.arch.build({**loaded.config, "text_config": broken}, kernels)
        assert caught.value.key == key
    vision = {**loaded.config["vision_config"], "num_heads": 3}
    with pytest.raises(ModelLoadError, match="num_heads 3") as caught:
        loaded.arch.vision(loaded.config).build({**loaded.config, "vision_config": vision})
    assert caught.value.key == "vision_config.hidden_size"


@QWEN2_5
def test_every_weight_layout_maps_onto_the_module(reference, loaded):
    from mlx.utils import tree_flatten

    arch = loaded.arch.vision(loaded.config)
    params = dict(tree_flatten(loaded.vision.module.parameters()))
    for prefix in ("visual.", "model.visual.", "vision_tower."):
        checkpoint = {"model.language_model.norm.weight": mx.zeros((32,)), "lm_head.weight": mx.zeros((64, 32))}
        for name, array in params.items():
            if name == "patch_embed.proj.weight":
                array = array.reshape(array.shape[0], 3, 2, 4, 4)  # torch's Conv3d [D, C, T, P, P]
                if prefix == "vision_tower.":
                    array = array.transpose(0, 2, 3, 4, 1)  # mlx-vlm's channels last
            checkpoint[prefix + name] = array
        sanitized = arch.sanitize(checkpoint, loaded.config)
        assert sorted(sanitized) == sorted(params)
        assert all(mx.array_equal(sanitized[name], params[name]) for name in params)
        assert sorted(loaded.arch.sanitize(checkpoint, loaded.config)) == ["lm_head.weight", "model.norm.weight"]
    assert loaded.arch.vision({k: v for k, v in loaded.config.items() if k != "vision_config"}) is None


@QWEN2_5
def test_mlxr_info_reports_the_vision_side(reference, loaded):
    from mlx.utils import tree_flatten

    from mlxr_core.cli.info import describe_model

    facts = describe_model(str(reference.folder), dtype="float32")
    assert facts["architecture"] == "qwen2_5_vl"
    params = sum(array.size for _, array in tree_flatten(loaded.vision.module.parameters()))
    assert facts["vision"] == {
        "parameters": params, "resident_bytes": params * 4, "tokens_per_image": None, "image_token_id": IMAGE,
    }


def test_the_processor_reads_each_way_of_writing_its_pixel_bounds():
    from mlxr_plugins.archs.qwen2_5_vl_vision import QwenImageProcessor, VisionArgs

    layouts = [
        {"min_pixels": 3136, "max_pixels": 12845056},  # the released Qwen2.5-VL checkpoints
        {"size": {"shortest_edge": 3136, "longest_edge": 12845056}},  # transformers 5
        {"size": {"min_pixels": 3136, "max_pixels": 12845056}},
    ]
    for settings in layouts:
        processor = QwenImageProcessor.from_config(VisionArgs(), settings)
        assert (processor.min_pixels, processor.max_pixels) == (3136, 12845056)
    assert QwenImageProcessor.from_config(VisionArgs(), None).max_pixels == 28 * 28 * 1280
