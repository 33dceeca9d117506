"""Acceptance: gpt-oss's Harmony format on a live ``mlxr serve``, through the official ``openai``,
``anthropic`` and ``ollama`` clients. Two tiny random models whose vocabulary has Harmony's
special tokens and whose chat template renders Harmony, so ``auto`` picks the ``harmony``
parsers: a gpt-oss (the ``gpt_oss`` graph, from a GGUF as llama.cpp writes one) and a llama; a forced tool choice makes it reason in ``analysis``, then call the tool in
``commentary to=functions.get_weather <|constrain|>json`` (the grammar the structured-output
sampler enforces). Each API must return the reasoning apart (``reasoning_content``, a
``thinking`` block, ``message.thinking``), the call as its tool call, whole and streamed, and no
markup in any text; the tool's result sent back renders as Harmony and the reply has no markup."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from test_acceptance_openai import ServerProcess, serving

from mlxr_core.testing.tiny import HARMONY_SPECIAL_TOKENS, tiny_gpt2_vocab, write_tiny_llama_gguf
from mlxr_plugins.parsers.harmony import MARKUP
from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

pytestmark = pytest.mark.slow

#: The served models: gpt-oss's graph, and a llama with gpt-oss's vocabulary and template.
MODELS = ("tiny-gpt-oss", "tiny-harmony")
PARAMETERS = {
    "type": "object",
    # Enums: the ollama client sends a property's type, description and enum only.
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS}}]
QUESTION = "What is the weather in Paris right now?"
DATE = "2026-11-25"
RESULT = json.dumps({"temperature": 21, "sky": "sunny"})


def write_tiny_gpt_oss_gguf(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                            kv_heads: int = 2, head_dim: int = 16, experts: int = 4, top_k: int = 2,
                            width: int = 64, window: int = 8) -> Path:
    """A tiny random gpt-oss as llama.cpp writes one (sinks, biased attention and experts, a biased
    router, YaRN, alternating window layers), with the Harmony vocabulary and template."""
    import gguf

    tokens, types, merges = tiny_gpt2_vocab(HARMONY_SPECIAL_TOKENS)
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def vector(n: int, around: float = 0.0, spread: float = 0.1) -> np.ndarray:
        return (around + spread * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name("tiny-gpt-oss")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_uint32("gpt-oss.expert_feed_forward_length", width)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(window)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(512)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(HARMONY_CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", (0.5 * rng.standard_normal((vocab, hidden))).astype(np.float32))
    for i in range(layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", vector(hidden, 1.0))
        for name, rows in (("attn_q", heads), ("attn_k", kv_heads), ("attn_v", kv_heads)):
            w.add_tensor(f"{b}.{name}.weight", matrix(rows * head_dim, hidden))
            w.add_tensor(f"{b}.{name}.bias", vector(rows * head_dim))
        w.add_tensor(f"{b}.attn_output.weight", matrix(hidden, heads * head_dim))
        w.add_tensor(f"{b}.attn_output.bias", vector(hidden))
        w.add_tensor(f"{b}.attn_sinks.weight", vector(heads, 0.0, 1.0))
        w.add_tensor(f"{b}.post_attention_norm.weight", vector(hidden, 1.0))
        w.add_tensor(f"{b}.ffn_gate_inp.weight", matrix(experts, hidden))
        w.add_tensor(f"{b}.ffn_gate_inp.bias", vector(experts))
        for name, shape in (("ffn_gate_exps", (experts, width, hidden)), ("ffn_up_exps", (experts, width, hidden)),
                            ("ffn_down_exps", (experts, hidden, width))):
            w.add_tensor(f"{b}.{name}.weight", matrix(*shape))
            w.add_tensor(f"{b}.{name}.bias", vector(shape[0] * shape[1]).reshape(shape[:2]))
    w.add_tensor("output_norm.weight", vector(hidden, 1.0))
    w.add_tensor("output.weight", matrix(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = Path(tmp_path_factory.mktemp("harmony"))
    gpt_oss = write_tiny_gpt_oss_gguf(folder / "tiny-gpt-oss.gguf")
    llama = write_tiny_llama_gguf(
        folder / "tiny-harmony.gguf", special_tokens=HARMONY_SPECIAL_TOKENS, eos_token="<|return|>",
        chat_template=HARMONY_CHAT_TEMPLATE,
    )
    # The template writes today's date into the system message: pinned, so the random models'
    # greedy replies are the same whatever day the tests run.
    models = "".join(f"  - path: {path}\n    name: {name}\n    context_length: 2048\n"
                     f"    chat_template_kwargs: {{current_date: '{DATE}'}}\n"
                     for path, name in zip((gpt_oss, llama), MODELS, strict=True))
    config = folder / "server.yaml"
    config.write_text(f"models:\n{models}apis: [openai, anthropic, ollama]\n")
    with serving(config) as process:
        yield process


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def no_markup(*texts: str | None) -> None:
    for text in texts:
        assert not any(token in (text or "") for token in MARKUP), text


def test_openai_reasoning_and_tool_call_round_trip(server: ServerProcess, model: str) -> None:
    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    ask = {"model": model, "tools": OPENAI_TOOLS, "tool_choice": forced, "max_tokens": 400, "temperature": 0}
    reply = client.chat.completions.create(messages=messages, **ask)
    choice = reply.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.finish_reason == "tool_calls" and not choice.message.content and reasoning
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, PARAMETERS)
    no_markup(reasoning)

    deltas = [c.choices[0].delta for c in client.chat.completions.create(messages=messages, stream=True, **ask) if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == arguments  # type: ignore[union-attr]
    assert "".join(d.content or "" for d in deltas) == ""
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    answer = client.chat.completions.create(model=model, messages=messages, tools=OPENAI_TOOLS, max_tokens=60, temperature=0)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
    no_markup(message.content, (message.model_extra or {}).get("reasoning_content"))


def test_anthropic_thinking_and_tool_use_round_trip(server: ServerProcess, model: str) -> None:
    client = anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=120)
    tools: Any = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": PARAMETERS}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    ask: Any = {"model": model, "max_tokens": 400, "extra_body": {"temperature": 0}, "tools": tools,
                "tool_choice": {"type": "tool", "name": "get_weather"}}
    reply = client.messages.create(messages=messages, **ask)
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    thinking, block = reply.content
    assert thinking.thinking  # type: ignore[union-attr]
    no_markup(thinking.thinking)  # type: ignore[union-attr]
    assert block.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(block.input, PARAMETERS)  # type: ignore[union-attr]

    with client.messages.stream(messages=messages, **ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == thinking.thinking  # type: ignore[union-attr]
    assert final.content[1].input == block.input  # type: ignore[union-attr]

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]},  # type: ignore[union-attr]
    ]
    answer = client.messages.create(model=model, max_tokens=60, extra_body={"temperature": 0}, tools=tools, messages=messages)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type in ("thinking", "text") for b in answer.content)
    no_markup(*(getattr(b, "text", None) or getattr(b, "thinking", None) for b in answer.content))


def test_ollama_thinking_and_tool_calls_round_trip(server: ServerProcess, model: str) -> None:
    client = ollama.Client(host=server.url(), timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    options: Any = {"temperature": 0, "num_predict": 400, "tool_choice": "get_weather"}
    reply = client.chat(model=model, messages=messages, tools=OPENAI_TOOLS, options=options, think=True)
    (call,) = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and not reply.message.content
    assert reply.message.thinking
    no_markup(reply.message.thinking)
    parts = list(client.chat(model=model, messages=messages, tools=OPENAI_TOOLS, options=options, think=True, stream=True))
    assert "".join(part.message.thinking or "" for part in parts) == reply.message.thinking
    assert "".join(part.message.content for part in parts) == ""
    streamed = [c for part in parts for c in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", dict(call.function.arguments))]

    # Without think, the reasoning (which a Harmony model cannot skip) is left out, not shown as content.
    quiet = client.chat(model=model, messages=messages, tools=OPENAI_TOOLS, options=options)
    assert not quiet.message.thinking and not quiet.message.content and quiet.message.tool_calls

    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
    ]
    answer = client.chat(model=model, messages=messages, tools=OPENAI_TOOLS, options={"temperature": 0, "num_predict": 60}, think=True)
    assert not answer.message.tool_calls
    no_markup(answer.message.content, answer.message.thinking)
