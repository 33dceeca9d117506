"""Requests with images on the engine for a language model with M-RoPE: tiny random Qwen2.5-VL
and Qwen3-VL models (DeepStack features merged in with the image) against transformers' greedy
generation (CPU, float32). Rows of one batch sit at different cache
offsets with different rotary shifts (a text row, a one-image row, a two-image row, left padded),
prefill chunks reach into the images, the decode step runs compiled and eager, and a prompt
served from the prefix cache (no prefill left but its last token) decodes at the right positions.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, PromptImage, SamplingParams
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny_vision import BEGIN, END, IMAGE, qwen2_5_vl_model, qwen3_vl_model

STEPS = 6
SIZES = [(23, 41), (16, 15)]  # 3x5 and 2x2 tokens
TEXT_PROMPT = [2, 7, 11, 19, 23, 29, 31, 37, 41, 43]


def prompt_for(*counts: int, lead: int = 3) -> list[int]:
    ids = [3 + i % 50 for i in range(lead)]
    for count in counts:
        ids += [BEGIN, *[IMAGE] * count, END, 9, 33]
    return [*ids, 12, 40]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def reference(request, tmp_path_factory):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    image_module = pytest.importorskip("PIL.Image", reason="image input needs Pillow")
    folder = tmp_path_factory.mktemp(request.param)
    writer = qwen2_5_vl_model if request.param == "qwen2_5_vl" else qwen3_vl_model
    model, processor = writer(folder, torch, transformers)
    rng = np.random.default_rng(5)
    images = [image_module.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    inputs = [processor(image, return_tensors="pt") for image in images]
    counts = [int(i["image_grid_thw"].prod()) // 4 for i in inputs]

    def greedy(prompt: list[int], which: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        extra = {}
        if which:
            extra = {
                "pixel_values": torch.cat([inputs[k]["pixel_values"] for k in which]),
                "image_grid_thw": torch.cat([inputs[k]["image_grid_thw"] for k in which]),
                "mm_token_type_ids": (ids == IMAGE).int(),
            }
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=STEPS, do_sample=False, **extra)
        return out[0, len(prompt):].tolist()

    prompts = {
        "one": (prompt_for(counts[0], lead=9), [0]),
        "two": (prompt_for(*counts), [0, 1]),
        "text": (TEXT_PROMPT, []),
    }
    want = {name: greedy(prompt, which) for name, (prompt, which) in prompts.items()}
    return folder, images, prompts, want


def start(folder, compile_decode: bool = False, **engine) -> Engine:
    engine.setdefault("prefix_cache", PrefixCacheConfig(enabled=False))
    config = Config(
        models=[ModelConfig(path=str(folder), name="vl", dtype="float32", compile_decode=compile_decode)],
        engine=EngineConfig(**engine),
    )
    eng = Engine(config, load_plugins())
    eng.start()
    return eng


def request(eng: Engine, images: list, prompt: list[int], which: list[int]) -> GenerationRequest:
    processor = eng.model("vl").image_processor
    assert processor is not None
    loaded = [processor(images[k]) for k in which]
    pictures = [PromptImage(p, hashlib.sha256(p.tobytes()).hexdigest()) for p in loaded]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, extra={"ignore_eos": True})
    return GenerationRequest(model="vl", prompt_ids=list(prompt), params=params, images=pictures)


def run(handle) -> tuple[list[int], Finished]:
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids], events[-1]


@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager", "compiled"])
def test_image_and_text_rows_batch_and_chunk_like_transformers(reference, compile_decode):
    folder, images, prompts, want = reference
    # Chunks of 5 reach into the images part way: each chunk is stretched to hold its image.
    eng = start(folder, compile_decode, max_batch_size=4, prefill_chunk=5)
    try:
        handles = {name: eng.submit(request(eng, images, *prompts[name])) for name in ("two", "text", "one")}
        assert {name: run(handle)[0] for name, handle in handles.items()} == want
    finally:
        eng.stop()


def test_a_prompt_from_the_prefix_cache_decodes_at_its_shifted_positions(reference):
    folder, images, prompts, want = reference
    eng = start(folder, prefix_cache=PrefixCacheConfig(enabled=True))
    try:
        first, finished = run(eng.submit(request(eng, images, *prompts["two"])))
        assert first == want["two"] and finished.usage.cache_written_tokens > 0
        again, finished = run(eng.submit(request(eng, images, *prompts["two"])))
        assert finished.usage.cached_tokens == len(prompts["two"][0]) - 1
        assert again == want["two"]
    finally:
        eng.stop()
