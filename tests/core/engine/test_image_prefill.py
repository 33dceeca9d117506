"""Requests with images on the engine: a tiny random Gemma 3 vision model against transformers'
greedy generation (CPU, float32), image and text requests batched together, chunked prefill that
reaches an image, and the prefix cache keyed by each image's content hash."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, PromptImage, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import BEGIN, END, IMAGE, gemma3_vision_model

PROMPT = [2, 17, 5, BEGIN, *[IMAGE] * 4, END, 9, 33, 12, 40]
#: Past the 32-position sliding window, the image after several prefill chunks of text.
LONG_PROMPT = [3 + i % 50 for i in range(30)] + PROMPT
TEXT_PROMPT = [2, 7, 11, 19, 23, 29, 31, 37, 41, 43]
#: An image with three crops (Gemma 3's pan-and-scan): four runs of its tokens, text between.
RUN = [BEGIN, *[IMAGE] * 4, END]
CROPS_PROMPT = [2, 17, *RUN, 9, 33, *RUN, 5, *RUN, 5, *RUN, 12, 40]
STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    folder = tmp_path_factory.mktemp("gemma3_vision")
    model = gemma3_vision_model(folder, torch, transformers)
    rng = np.random.default_rng(0)
    pixels = [rng.standard_normal((3, 32, 32)).astype(np.float32) for _ in range(2)]
    pixels.append(rng.standard_normal((4, 3, 32, 32)).astype(np.float32))  # the whole image and 3 crops

    def greedy(prompt: list[int], image: np.ndarray | None) -> list[int]:
        ids = torch.tensor([prompt])
        extra = {}
        if image is not None:
            views = image if image.ndim == 4 else image[None]
            extra = {"pixel_values": torch.tensor(views), "token_type_ids": (ids == IMAGE).long()}
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=STEPS, do_sample=False, **extra)
        return out[0, len(prompt):].tolist()

    want = {
        "image": greedy(PROMPT, pixels[0]),
        "other_image": greedy(PROMPT, pixels[1]),
        "long": greedy(LONG_PROMPT, pixels[0]),
        "text": greedy(TEXT_PROMPT, None),
        "crops": greedy(CROPS_PROMPT, pixels[2]),
    }
    return folder, pixels, want


def start(folder, **engine) -> Engine:
    engine.setdefault("prefix_cache", PrefixCacheConfig(enabled=False))
    config = Config(
        models=[ModelConfig(path=str(folder), name="vision", dtype="float32", compile_decode=False)],
        engine=EngineConfig(**engine),
    )
    eng = Engine(config, load_plugins())
    eng.start()
    return eng


def image(pixels: np.ndarray) -> PromptImage:
    return PromptImage(pixels, hashlib.sha256(pixels.tobytes()).hexdigest())


def request(prompt, images=()) -> GenerationRequest:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, extra={"ignore_eos": True})
    return GenerationRequest(model="vision", prompt_ids=list(prompt), params=params, images=list(images))


def run(handle) -> tuple[list[int], Finished]:
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids], events[-1]


def test_greedy_tokens_with_an_image_match_transformers(reference):
    folder, pixels, want = reference
    eng = start(folder)
    try:
        tokens, finished = run(eng.submit(request(PROMPT, [image(pixels[0])])))
        assert tokens == want["image"]
        assert finished.usage.prompt_tokens == len(PROMPT)
        assert run(eng.submit(request(PROMPT, [image(pixels[1])])))[0] == want["other_image"]
        assert want["image"] != want["other_image"]  # the image, not only its tokens, steers the reply
        assert run(eng.submit(request(TEXT_PROMPT)))[0] == want["text"]
    finally:
        eng.stop()


def test_image_and_text_requests_batch_and_chunk_like_solo_runs(reference):
    folder, pixels, want = reference
    # Chunks of 5 reach into the image part way: its chunk is stretched to hold all of it.
    eng = start(folder, max_batch_size=4, prefill_chunk=5)
    try:
        handles = [
            eng.submit(request(LONG_PROMPT, [image(pixels[0])])),
            eng.submit(request(TEXT_PROMPT)),
            eng.submit(request(PROMPT, [image(pixels[1])])),
            eng.submit(request(CROPS_PROMPT, [image(pixels[2])])),  # pan-and-scan: 4 views, one image
        ]
        assert [run(h)[0] for h in handles] == [want["long"], want["text"], want["other_image"], want["crops"]]
    finally:
        eng.stop()


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(reference):
    folder, pixels, want = reference
    eng = start(folder, prefix_cache=PrefixCacheConfig(enabled=True))
    try:
        first, usage = run(eng.submit(request(LONG_PROMPT, [image(pixels[0])])))
        assert first == want["long"] and usage.usage.cache_written_tokens > 0
        again, usage = run(eng.submit(request(LONG_PROMPT, [image(pixels[0])])))
        assert again == want["long"] and usage.usage.cached_tokens == len(LONG_PROMPT) - 1
        # Another image behind the same tokens reuses only the text before it.
        _, usage = run(eng.submit(request(LONG_PROMPT, [image(pixels[1])])))
        assert usage.usage.cached_tokens == LONG_PROMPT.index(IMAGE)
    finally:
        eng.stop()


def test_images_that_do_not_fit_the_prompt_or_the_model_are_refused(reference, tmp_path):
    folder, pixels, _ = reference
    eng = start(folder)
    try:
        with pytest.raises(RequestError, match="4 image token positions for 2 images"):
            eng.submit(request(PROMPT, [image(pixels[0]), image(pixels[1])]))
        with pytest.raises(RequestError, match="4 image token positions for 0 images"):
            eng.submit(request(PROMPT))
        with pytest.raises(RequestError, match="must not end with an image"):
            eng.submit(request(PROMPT[: PROMPT.index(END)], [image(pixels[0])]))
    finally:
        eng.stop()
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    text_only = Engine(
        Config(models=[ModelConfig(path=str(write_tiny_llama_gguf(tmp_path / "t.gguf")), name="vision")]),
        load_plugins(),
    )
    text_only.start()
    try:
        with pytest.raises(RequestError, match="'vision' takes no images"):
            text_only.submit(request([5, 6, 7], [image(pixels[0])]))
    finally:
        text_only.stop()
