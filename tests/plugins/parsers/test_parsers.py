"""The built-in tool-call and reasoning parsers, fed whole and one character at a time."""

from __future__ import annotations

import json

import pytest

from mlxr_core.chat.parsing import OutputSplitter, Text, ToolCall, merge, split_all
from mlxr_plugins.parsers.reasoning import ThinkParser
from mlxr_plugins.parsers.tools import (
    HermesParser,
    LfmParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
)

PARSERS = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
    "pythonic": PythonicParser(),
    "lfm": LfmParser(),
}


def run(parser_name: str, text: str, *, chunk: int | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """Content and (name, arguments) calls, from ``text`` fed whole or ``chunk`` characters at a time."""
    stream = PARSERS[parser_name].stream()
    pieces: list[Text | ToolCall] = []
    step = chunk or max(len(text), 1)
    for i in range(0, len(text), step):
        pieces += stream.feed(text[i : i + step])
    pieces += stream.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Text))
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    assert all(p.id for p in pieces if isinstance(p, ToolCall))
    return content, calls


CASES = [
    # (parser, generated text, expected content, expected calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>'
     '{"name": "b", "arguments": {"x": 1}}</tool_call>',
     "Let me check.\n\n", [("a", {}), ("b", {"x": 1})]),
    # SmolLM2's list form, and arguments written as a JSON string
    ("hermes", '<tool_call>[{"name": "a", "arguments": {"q": "<b>"}}, {"name": "b", "arguments": "{\\"n\\": 2}"}]</tool_call>',
     "", [("a", {"q": "<b>"}), ("b", {"n": 2})]),
    # the output ended before the closing tag
    ("hermes", '<tool_call>{"name": "a", "arguments": {"k": [1, 2]}}', "", [("a", {"k": [1, 2]})]),
    ("hermes", "No tools needed: 3 < 4.", "No tools needed: 3 < 4.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "y"}}; {"name": "b", "parameters": {}}',
     "", [("a", {"x": "y"}), ("b", {})]),
    ("llama3_json", "The answer is {1, 2}.", "The answer is {1, 2}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abc123XYZ"}]', "", [("a", {"x": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": true}}]',
     "", [("a", {}), ("b", {"y": True})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ("mistral", "Sure [TOOL", "Sure [TOOL", []),
    ("pythonic", '[get_weather(city="Paris", days=2), now()]', "", [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]),
    ("pythonic", '```tool_code\nget_weather(city="Paris")\n```', "", [("get_weather", {"city": "Paris"})]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
    # LFM's card: Python calls between its markers, JSON when the system prompt asks for it
    ("lfm", '<|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>Checking.',
     "Checking.", [("get_candidate_status", {"candidate_id": "12345"})]),
    ("lfm", 'Sure. <|tool_call_start|>[{"name": "a", "arguments": {"x": 1}}]<|tool_call_end|>', "Sure. ", [("a", {"x": 1})]),
    ("lfm", "<|tool_call_start|>[f(a=[1, 2]), g()]", "", [("f", {"a": [1, 2]}), ("g", {})]),
    ("lfm", "[f()] is how a call looks", "[f()] is how a call looks", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_parsers_split_content_and_calls(parser: str, text: str, content: str, calls: list, chunk: int | None) -> None:
    assert run(parser, text, chunk=chunk) == (content, calls)


MALFORMED = [
    ("hermes", "<tool_call>{not json}</tool_call> after"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", "<tool_call>{\"name\": \"a\", \"arguments\": {"),  # cut off
    ("llama3_json", '{"name": "a", "parameters": '),
    ("llama3_json", '{"title": "not a call"}'),
    ("mistral", "[TOOL_CALLS] oops, not JSON"),
    ("mistral", '[TOOL_CALLS][{"name": 3}]'),
    ("pythonic", "[get_weather(**kw)]"),
    ("pythonic", "[get_weather(city=input())]"),
    ("lfm", "<|tool_call_start|>[f(**kw)]<|tool_call_end|>"),
]


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
@pytest.mark.parametrize("chunk", [None, 1])
def test_malformed_markup_falls_back_to_the_text_as_generated(parser: str, text: str, chunk: int | None) -> None:
    assert run(parser, text, chunk=chunk) == (text, [])


@pytest.mark.parametrize("parser", list(PARSERS))
def test_streamed_content_never_shows_markup(parser: str) -> None:
    """Content streamed before a call holds back no more than a marker's beginning, and the call's
    markup never appears in any content piece."""
    texts = {
        "hermes": 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "llama3_json": 'Hi <|python_tag|>{"name": "f", "parameters": {}}',
        "mistral": 'Hi [TOOL_CALLS][{"name": "f", "arguments": {}}]',
        "pythonic": "[f()]",
        "lfm": "Hi <|tool_call_start|>[f()]<|tool_call_end|>",
    }
    stream = PARSERS[parser].stream()
    shown = ""
    for char in texts[parser]:
        for piece in stream.feed(char):
            if isinstance(piece, Text):
                shown += piece.text
    pieces = stream.finish()
    assert shown.strip() in ("Hi", "")
    assert [p.name for p in pieces if isinstance(p, ToolCall)] in (["f"], [])
    for marker in ("<tool", "python_tag", "TOOL_CALLS", "f()", "{", "<|tool"):
        assert marker not in shown


@pytest.mark.parametrize(
    ("prompt", "text", "reasoning", "content"),
    [
        ("<|im_start|>assistant\n", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "Paris."),
        ("<|im_start|>assistant\n<think>\n", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
        ("<|im_start|>assistant\n", "Plain answer <think> inside", "", "Plain answer <think> inside"),
        ("<|im_start|>assistant\n", "<think>never closed", "never closed", ""),
        # Qwen3 with enable_thinking=False renders an empty, closed block
        ("assistant\n<think>\n\n</think>\n\n", "Direct.", "", "Direct."),
    ],
)
@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_think_splits_reasoning_from_content(prompt: str, text: str, reasoning: str, content: str, chunk: int | None) -> None:
    stream = ThinkParser().stream(prompt)
    pieces: list[Text] = []
    step = chunk or len(text)
    for i in range(0, len(text), step):
        pieces += stream.feed(text[i : i + step])
    pieces += stream.finish()
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == reasoning
    assert "".join(p.text for p in pieces if p.kind == "content") == content
    assert all("think>" not in p.text for p in pieces if p.kind == "content") or "inside" in content


def test_splitter_reads_calls_after_the_reasoning() -> None:
    splitter = OutputSplitter(ThinkParser().stream(""), HermesParser().stream())
    text = '<think>call it</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    pieces = merge([p for char in text for p in splitter.feed(char)] + splitter.finish())
    assert pieces[0] == Text("call it", "reasoning")
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == [("f", '{"a": 1}')]
    assert not [p for p in pieces if isinstance(p, Text) and p.kind == "content"]
    content, reasoning, calls = split_all(OutputSplitter(ThinkParser().stream(""), HermesParser().stream()), text)
    assert (content, reasoning, len(calls)) == ("", "call it", 1)


@pytest.mark.parametrize(
    ("template", "tool", "reasoning"),
    [
        ("{{'<|im_start|>' + m }}{% if tools %}<tool_call>{% endif %}<think>", "hermes", "think"),
        ("<|im_start|>{{ m }}", "hermes", None),  # ChatML without tools: SmolLM2
        ("<|start_header_id|>ipython<|eot_id|>", "llama3_json", None),
        ("[INST] {{ m }} [/INST][TOOL_CALLS]", "mistral", None),
        ("<start_of_turn>user", "pythonic", None),
        # LFM2's template: ChatML, with its tool list markers (so not Hermes)
        ('<|im_start|>system\nList of tools: <|tool_list_start|>{{ tools }}<|tool_list_end|>', "lfm", None),
        ("{{ m }}", None, None),
    ],
)
def test_auto_choice_follows_the_template(template: str, tool: str | None, reasoning: str | None) -> None:
    from mlxr_core.chat.parsing import choose
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    assert choose(registries.tool_parsers, "auto", template) == tool
    assert choose(registries.reasoning_parsers, "auto", template) == reasoning
    assert choose(registries.tool_parsers, "none", template) is None
    assert choose(registries.tool_parsers, "mistral", template) == "mistral"
