"""Gemma 4's tool calls (``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>``) and thinking
(``<|channel>thought\\n...<channel|>``): fed whole, a character at a time and in odd chunks, no
markup in any content piece, malformed markup given back as generated, chosen by ``auto`` from a
Gemma 4 template, and their special tokens kept by the detokenizer for them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxr_core.chat.parsing import OutputSplitter, Text, Tool, ToolCall, choose, merge
from mlxr_core.chat.tools import ModelParsers, special_ids
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.detokenizer import StreamingDetokenizer
from mlxr_core.testing.tiny import tiny_gpt2_vocab
from mlxr_plugins.formats.gguf.tokenizer import GGUFTokenizerBackend
from mlxr_plugins.parsers.gemma4 import Gemma4ThinkingParser, Gemma4ToolParser

Q = '<|"|>'
TOOLS, THINKING = Gemma4ToolParser(), Gemma4ThinkingParser()
MARKUP = (*TOOLS.markup_tokens, *THINKING.markup_tokens)


def run_tools(text: str, chunk: int | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """Content and ``(name, arguments)`` calls of ``text`` fed ``chunk`` characters at a time."""
    stream = TOOLS.stream()
    pieces: list[Text | ToolCall] = []
    step = chunk or max(len(text), 1)
    for i in range(0, len(text), step):
        pieces += stream.feed(text[i : i + step])
    pieces += stream.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Text))
    return content, [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]


CALLS = [
    (f"<|tool_call>call:get_weather{{location:{Q}Paris, France{Q},days:3}}<tool_call|>",
     "", [("get_weather", {"location": "Paris, France", "days": 3})]),
    # strings hold braces, commas, colons, quotes and newlines; nested values; calls back to back
    (f"Let me check.<|tool_call>call:a{{}}<tool_call|><|tool_call>call:b-2{{x:[1,-2.5e3,{{y:{Q}a{{b}}, c:d{Q}}}],"
     f'z:true,n:null,s:{Q}say "hi"\nbye{Q}}}<tool_call|>',
     "Let me check.", [("a", {}), ("b-2", {"x": [1, -2500.0, {"y": "a{b}, c:d"}], "z": True, "n": None, "s": 'say "hi"\nbye'})]),
    # the output ended before the closing token
    (f"<|tool_call>call:f{{a:{Q}x{Q}}}", "", [("f", {"a": "x"})]),
    # after the handover to the tool, nothing is the answer
    (f"<|tool_call>call:f{{}}<tool_call|><|tool_response>response:f{{value:{Q}made up{Q}}}", "", [("f", {})]),
    ("No tools needed: {a: b}.", "No tools needed: {a: b}.", []),
    # markup that does not parse runs to its closing token, and stays text; the next call counts
    ("<|tool_call>call:f{a:oops}<tool_call|><|tool_call>call:g{}<tool_call|>",
     "<|tool_call>call:f{a:oops}<tool_call|>", [("g", {})]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), CALLS)
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_calls_split_from_content(text: str, content: str, calls: list, chunk: int | None) -> None:
    assert run_tools(text, chunk) == (content, calls)


MALFORMED = [
    "<|tool_call>not a call",
    "<|tool_call>call:f{a:oops}<tool_call|> after",  # a bare word is not a value
    f"<|tool_call>call:f[{Q}a{Q}]<tool_call|>",  # arguments that are not an object
    f"<|tool_call>call:f{{a:{Q}never closed",
]


@pytest.mark.parametrize("text", MALFORMED)
@pytest.mark.parametrize("chunk", [None, 1])
def test_malformed_calls_fall_back_to_the_text_as_generated(text: str, chunk: int | None) -> None:
    assert run_tools(text, chunk) == (text, [])


def test_streamed_content_never_shows_markup() -> None:
    stream = TOOLS.stream()
    shown, calls = "", []
    for char in f"Hi <|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>":
        pieces = stream.feed(char)
        shown += "".join(p.text for p in pieces if isinstance(p, Text))
        calls += [p.name for p in pieces if isinstance(p, ToolCall)]
    assert shown == "Hi " and calls == ["f"] and stream.finish() == []


def test_rendered_calls_parse_back() -> None:
    arguments = {"city": "São Paulo", "days": [1, 2], "deep": {"ok": False, "none": None}}
    text = TOOLS.render_calls([ToolCall("get_weather", json.dumps(arguments))])
    assert text.startswith("<|tool_call>call:get_weather{city:<|\"|>São Paulo<|\"|>,")
    assert run_tools(text) == ("", [("get_weather", arguments)])


def run_thinking(prompt: str, text: str, chunk: int | None = None) -> tuple[str, str]:
    stream = THINKING.stream(prompt)
    pieces: list[Text] = []
    step = chunk or max(len(text), 1)
    for i in range(0, len(text), step):
        pieces += stream.feed(text[i : i + step])
    pieces += stream.finish()
    for piece in pieces:
        assert "<|channel>" not in piece.text and "<channel|>" not in piece.text
    return "".join(p.text for p in pieces if p.kind == "reasoning"), "".join(p.text for p in pieces if p.kind == "content")


@pytest.mark.parametrize(
    ("prompt", "text", "reasoning", "content"),
    [
        ("<|turn>model\n", "<|channel>thought\nLet me think.<channel|>Paris.", "Let me think.", "Paris."),
        ("<|turn>model\n", "\n<|channel>thought\nHmm.<channel|>\n\nParis.", "Hmm.", "Paris."),
        # 26B/31B templates close an empty block when thinking is off
        ("<|turn>model\n<|channel>thought\n<channel|>", "Direct.", "", "Direct."),
        # after a tool result with thinking on, the prompt opens the block
        ("<|tool_response|>\n<|channel>thought\n", "Got 21.<channel|>It is 21.", "Got 21.", "It is 21."),
        ("<|turn>model\n<|channel>", "thought\nx<channel|>y", "x", "y"),
        ("<|turn>model\n", "  Plain answer", "", "  Plain answer"),
        ("<|turn>model\n", "<|channel>thought\nnever closed", "never closed", ""),
    ],
)
@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_thinking_splits_reasoning_from_content(prompt: str, text: str, reasoning: str, content: str, chunk: int | None) -> None:
    assert run_thinking(prompt, text, chunk) == (reasoning, content)


def test_the_splitter_reads_calls_after_the_thinking() -> None:
    splitter = OutputSplitter(THINKING.stream("<|turn>model\n"), TOOLS.stream())
    text = f"<|channel>thought\nCall it.<channel|><|tool_call>call:f{{a:{Q}1{Q}}}<tool_call|>"
    pieces = merge([p for char in text for p in splitter.feed(char)] + splitter.finish())
    assert pieces == [Text("Call it.", "reasoning"), ToolCall("f", '{"a": "1"}', pieces[-1].id)]  # type: ignore[union-attr]


#: Enough of a Gemma 4 chat template (turns, tool declarations and calls, the closed empty thought).
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|turn>system\n{% for tool in tools %}<|tool>declaration:"
    "{{ tool.function.name }}{}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% for call in m.tool_calls or [] %}<|tool_call>call:{{ call.function.name }}{}<tool_call|>{% endfor %}"
    "{{ m.content or '' }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n<|channel>thought\n<channel|>{% endif %}"
)


def test_auto_picks_gemma4_for_a_gemma4_template() -> None:
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    assert choose(registries.tool_parsers, "auto", TEMPLATE) == "gemma4"
    assert choose(registries.reasoning_parsers, "auto", TEMPLATE) == "gemma4"
    gemma3 = "<start_of_turn>user\n{{ m }}<end_of_turn>"
    assert choose(registries.tool_parsers, "auto", gemma3) == "pythonic"
    assert choose(registries.reasoning_parsers, "auto", gemma3) is None


SPECIAL = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", *MARKUP, "<tool_response|>")


def test_the_engine_keeps_the_markup_for_the_parsers() -> None:
    """Gemma 4's markers are special tokens, which the detokenizer leaves out of the text unless
    asked: a chat with these parsers asks it to keep exactly their markers."""
    from mlxr_core.chat.tools import prepare_chat

    tokens, types, merges = tiny_gpt2_vocab(SPECIAL)
    tokenizer = GGUFTokenizerBackend().build(
        {
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": tokens.index("<turn|>"),
        },
        chat_template=TEMPLATE,
    )  # fmt: skip
    weather = Tool("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    info = ModelInfo("m", 1 << 16, 0, tokenizer, "test", "test")
    chat = prepare_chat(info, ModelParsers(TOOLS, THINKING), messages, tools=[weather])  # type: ignore[arg-type]
    assert chat.keep_special == special_ids(tokenizer, MARKUP) and len(chat.keep_special) == len(MARKUP)
    reply = f"<|channel>thought\nAsk the tool 😀.<channel|><|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
    detokenizer = StreamingDetokenizer(tokenizer, chat.keep_special)
    deltas = [detokenizer.add(i) for i in tokenizer.encode(reply, add_special_tokens=False)]
    assert "".join(deltas) + detokenizer.flush() == reply
    reader = chat.reader()
    pieces = merge([piece for delta in deltas for piece in reader.feed(delta)] + reader.finish())
    assert [p for p in pieces if isinstance(p, Text)] == [Text("Ask the tool 😀.", "reasoning")]
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == [("get_weather", '{"city": "Paris"}')]
    assert reader.finish_reason("stop") == "tool_calls"
