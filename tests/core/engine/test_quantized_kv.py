"""The engine serving a tiny model with quantized keys and values (``models[].kv_cache``):
batching, chunked prefill and the prefix cache change no token, the KV budget counts packed bytes,
and a model that cannot take it is refused naming the key."""

from __future__ import annotations

import pytest

from mlxr_core.config.schema import (
    Config,
    EngineConfig,
    KVCacheConfig,
    ModelConfig,
    PrefixCacheConfig,
)
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import ConfigError
from mlxr_core.plugins import load_plugins

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [40, 41, 42],
    [100, 17, 23, 99, 3, 8, 61, 62, 63, 64, 65, 66, 70],
    [7],
]
SYSTEM = [(i * 13) % 250 + 3 for i in range(40)]
SETTINGS = [
    KVCacheConfig(bits=8, group_size=32),
    KVCacheConfig(bits=4, group_size=32, start_after=10),
    KVCacheConfig(method="turboquant", bits=3, window=4),
]
IDS = ["8bit", "4bit-start10", "turboquant3-window4"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    # head size 32: a group of 32
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", hidden=128, heads=4, kv_heads=2)


def start(tiny_path, kv_cache, decoder="plain", **engine):
    model = ModelConfig(path=str(tiny_path), name="tiny", context_length=256, kv_cache=kv_cache, decoder=decoder)
    eng = Engine(Config(models=[model], engine=EngineConfig(**engine)), load_plugins())
    eng.start()
    return eng


def generate(eng, prompts, *, together=True):
    """Each prompt's 12 greedy tokens, submitted all at once (``together``) or one after another."""
    def submit(prompt):
        params = SamplingParams(temperature=0.0, max_tokens=12, extra={"ignore_eos": True})
        return eng.submit(GenerationRequest(model="tiny", prompt_ids=list(prompt), params=params))

    handles = [submit(p) for p in prompts] if together else None
    outputs = []
    for index, prompt in enumerate(prompts):
        events = list(handles[index] if handles else submit(prompt))
        assert isinstance(events[-1], Finished), events[-1]
        outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
    return outputs


def solo_runs(tiny_path, kv_cache, prompts):
    eng = start(tiny_path, kv_cache, max_batch_size=1, prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        return generate(eng, prompts, together=False)
    finally:
        eng.stop()


@pytest.mark.parametrize("kv_cache", SETTINGS, ids=IDS)
def test_concurrent_streams_equal_solo_streams_with_the_same_kv_cache(tiny_path, kv_cache):
    expected = solo_runs(tiny_path, kv_cache, PROMPTS)
    assert expected != solo_runs(tiny_path, None, PROMPTS) or kv_cache.bits == 8  # 4-bit does change tokens
    eng = start(tiny_path, kv_cache, max_batch_size=4, prefill_chunk=3)  # chunked prefill too
    try:
        assert generate(eng, PROMPTS) == expected
    finally:
        eng.stop()


@pytest.mark.parametrize("kv_cache", SETTINGS, ids=IDS)
def test_a_prefix_cache_hit_changes_nothing(tiny_path, kv_cache):
    prompts = [[*SYSTEM, 5, 6, 7], [*SYSTEM, 9, 9, 9, 9]]
    expected = solo_runs(tiny_path, kv_cache, prompts)
    eng = start(tiny_path, kv_cache)
    try:
        assert generate(eng, prompts, together=False) == expected
        stats = eng.stats()["prefix_cache"]["tiny"]
    finally:
        eng.stop()
    assert stats["hits"] == 1 and stats["reused_tokens"] == len(SYSTEM)


@pytest.mark.parametrize("kv_cache", SETTINGS[1:], ids=IDS[1:])
def test_a_drafting_decoder_over_a_quantized_cache_gives_plain_greedy_tokens(tiny_path, kv_cache):
    prompt = [*SYSTEM[:12], *SYSTEM[:12], *SYSTEM[:6]]  # repeats for prompt lookup to draft from
    expected = solo_runs(tiny_path, kv_cache, [prompt])
    eng = start(tiny_path, kv_cache, decoder="prompt_lookup", prefix_cache=PrefixCacheConfig(enabled=False))
    try:
        assert generate(eng, [prompt]) == expected
    finally:
        eng.stop()


def test_the_kv_budget_counts_packed_bytes(tiny_path):
    per_token = {}
    for name, kv_cache in [("full", None), ("8", KVCacheConfig(bits=8, group_size=32)),
                           ("4", KVCacheConfig(bits=4, group_size=32)),
                           ("turboquant3", KVCacheConfig(method="turboquant", bits=3))]:  # fmt: skip
        eng = start(tiny_path, kv_cache)
        try:
            per_token[name] = eng.kv_bytes_per_token["tiny"]
        finally:
            eng.stop()
    # float32 activations, head size 32, group 32: 128 bytes per head and position in full
    # precision; 8-bit: 32 + a 4-byte scale and bias; 4-bit: 16 + 8
    assert per_token["8"] / per_token["full"] == pytest.approx(40 / 128)
    assert per_token["4"] / per_token["full"] == pytest.approx(24 / 128)
    # turboquant 3 bits, a key and a value together against 256 bytes: 2-bit key codes (8 bytes),
    # sign bits (4), two float16 norms; 3-bit value codes (12) and a norm
    assert per_token["turboquant3"] / per_token["full"] == pytest.approx(30 / 256)


def test_a_group_size_that_does_not_divide_the_head_size_is_refused(tiny_path):
    with pytest.raises(ConfigError, match=r"kv_cache.group_size 64 does not divide the head size 32") as caught:
        start(tiny_path, KVCacheConfig(bits=8, group_size=64))
    assert caught.value.field == "models[].kv_cache.group_size"
