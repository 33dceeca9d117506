"""What the API plugins share for tool calling and thinking: the parsers of a served model, the
prompt rendered with tools, forced tool choices, and the splitter for one request's output.

Messages reach :func:`prepare_chat` in the form Hugging Face chat templates expect, whatever the
API: an assistant turn may carry ``tool_calls`` (``[{"id", "type": "function", "function":
{"name", "arguments": <dict>}}]``) and tool results are ``{"role": "tool", "content",
"tool_call_id", "name"}`` turns. A template that renders no tools gets them the parser's way: the
definitions in the system prompt, earlier calls as the model writes them, results as user turns.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.chat.parsing import (
    ChannelParser,
    OutputSplitter,
    ReasoningParser,
    SpecialMarkup,
    Text,
    Tool,
    ToolCall,
    ToolParser,
)
from mlxr_core.chat.prompt import render_prompt, without_volatile_spans
from mlxr_core.engine.request import Constraint, PromptImage
from mlxr_core.errors import RequestError

if TYPE_CHECKING:
    from mlxr_core.engine.admission import ModelInfo
    from mlxr_core.http.context import ServerContext
    from mlxr_core.model.tokenizer import Tokenizer

_TOOLS_VARIABLE = re.compile(r"\btools\b")


@attrs.frozen
class ToolChoice:
    """``none``, ``auto``, ``required`` (some tool) or ``function`` (the tool named ``name``)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@attrs.frozen
class ModelParsers:
    """The parsers one served model uses (None: off), the variables its config gives every
    chat's template (``models[].chat_template_kwargs``) and the system prompt spans removed before
    tokenizing (``engine.prefix_cache.volatile_spans``, compiled), and its default thinking budget."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    volatile_spans: tuple[re.Pattern[str], ...] = ()
    #: Reasoning tokens a reply may spend when its request sets no budget
    #: (``models[].thinking_budget``, :mod:`mlxr_core.chat.thinking`); None: unbounded.
    thinking_budget: int | None = None

    @property
    def channels(self) -> ChannelParser | None:
        """The parser of a format that frames every reply (Harmony), in either role."""
        for parser in (self.tool, self.reasoning):
            if isinstance(parser, ChannelParser):
                return parser
        return None

    @property
    def markup_tokens(self) -> tuple[str, ...]:
        """The special tokens the parsers read, which the engine keeps in a reply's text."""
        tokens: list[str] = []
        for parser in (self.tool, self.reasoning):
            if isinstance(parser, SpecialMarkup):
                tokens += parser.markup_tokens
        return tuple(tokens)


def model_parsers(ctx: ServerContext, info: ModelInfo) -> ModelParsers:
    """The parsers chosen for the model ``info`` when it loaded (:attr:`ModelInfo.tool_parser`,
    :attr:`ModelInfo.reasoning_parser`), and its config's template variables."""
    model_config = model_config_of(ctx, info)
    registries = ctx.host.registries
    return ModelParsers(
        tool=registries.tool_parsers.get(info.tool_parser) if info.tool_parser else None,
        reasoning=registries.reasoning_parsers.get(info.reasoning_parser) if info.reasoning_parser else None,
        template_kwargs=dict(model_config.chat_template_kwargs) if model_config else {},
        volatile_spans=compiled_spans(tuple(ctx.config.engine.prefix_cache.volatile_spans)),
        thinking_budget=model_config.thinking_budget if model_config else None,
    )


@functools.lru_cache(maxsize=8)
def compiled_spans(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """``engine.prefix_cache.volatile_spans`` compiled (checked when the config loaded)."""
    return tuple(re.compile(pattern) for pattern in patterns)


def model_config_of(ctx: ServerContext, info: ModelInfo) -> Any:
    """The ``models[]`` entry that loaded ``info`` (None for a model built without one)."""
    models = ctx.config.models
    return models[info.config_index] if 0 <= info.config_index < len(models) else None


def constraints_supported(ctx: ServerContext, kind: str | None = None) -> bool:
    """Whether a sampler plugin enforces :attr:`SamplingParams.constraint` (meta ``constraints``,
    the kinds it enforces), of ``kind`` when given."""
    return any(
        kinds and (kind is None or kind in kinds)
        for kinds in (entry.meta.get("constraints") for entry in ctx.host.registries.samplers)
    )


@attrs.define
class ChatSetup:
    """One chat request, rendered: the prompt and how to read the reply."""

    prompt: str
    prompt_ids: list[int]
    parsers: ModelParsers
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True
    #: The ids of the parsers' markup tokens, for the engine to keep in the reply's text.
    keep_special: frozenset[int] = frozenset()

    @property
    def constraint(self) -> Constraint | None:
        """What a forced tool choice constrains the output to: a call as JSON, or a reply in the
        model's channel format that ends with a call."""
        if not self.choice.forced:
            return None
        channels = self.parsers.channels
        if channels is not None:
            return Constraint(kind="lark", value=channels.forced_grammar(self._offered()))
        return Constraint(kind="json_schema", value=call_schema(self._offered()))

    def _offered(self) -> list[Tool]:
        if self.choice.mode == "function":
            return [tool for tool in self.tools if tool.name == self.choice.name]
        return self.tools

    def splitter(self) -> OutputSplitter | ForcedCall:
        """A fresh splitter for the reply."""
        channels = self.parsers.channels
        if channels is not None:
            return OutputSplitter(channels.stream(self.prompt), show_reasoning=self.parsers.reasoning is not None)
        tool_stream = None
        if self.tools and self.choice.mode != "none" and self.parsers.tool is not None:
            tool_stream = self.parsers.tool.stream()
        if self.choice.forced:
            return ForcedCall({tool.name for tool in self._offered()}, OutputSplitter(None, tool_stream))
        reasoning = self.parsers.reasoning.stream(self.prompt) if self.parsers.reasoning else None
        return OutputSplitter(reasoning, tool_stream)

    def reader(self) -> ReplyReader:
        """A fresh reader of the reply's text."""
        return ReplyReader(self, self.splitter())


@attrs.define
class ReplyReader:
    """One reply's pieces: reasoning, content, and calls to offered tools (only the first when
    parallel calls are off). A call to a tool that was not offered is kept as the text it was."""

    setup: ChatSetup
    splitter: OutputSplitter | ForcedCall
    calls: int = 0

    def feed(self, text: str) -> list[Text | ToolCall]:
        return self._keep(self.splitter.feed(text))

    def finish(self) -> list[Text | ToolCall]:
        return self._keep(self.splitter.finish())

    def whole(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """A whole reply as ``(content, reasoning, calls)``."""
        pieces = self.feed(text) + self.finish()
        content = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "content")
        reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "reasoning")
        return content, reasoning, [p for p in pieces if isinstance(p, ToolCall)]

    def finish_reason(self, reason: str) -> str:
        """``"tool_calls"`` for a reply that ended by calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _keep(self, pieces: list[Text | ToolCall]) -> list[Text | ToolCall]:
        offered = self.setup._offered() if self.setup.choice.mode != "none" else []
        names = {tool.name for tool in offered}
        channels = self.setup.parsers.channels
        out: list[Text | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if piece.name not in names:
                    parser = self.setup.parsers.tool
                    text = parser.render_calls([piece]) if parser else piece.arguments
                    if channels is not None:  # its markup is special tokens, never shown
                        for token in channels.markup_tokens:
                            text = text.replace(token, "")
                    out.append(Text(text))
                    continue
                if self.calls and not self.setup.parallel:
                    continue
                self.calls += 1
            out.append(piece)
        return out


@attrs.define
class ForcedCall:
    """The reply to a forced tool choice: ``{"name", "arguments"}`` JSON (what the constraint
    enforces). Without enforcement a model may still answer in its own markup (parsed by
    ``fallback``) or in prose, which stays content: no call is ever made up."""

    names: set[str]
    fallback: OutputSplitter
    _text: list[str] = attrs.field(factory=list)

    def feed(self, text: str) -> list[Text | ToolCall]:
        self._text.append(text)
        return []

    def finish(self) -> list[Text | ToolCall]:
        text = "".join(self._text)
        call = call_from_json(text.strip(), self.names)
        if call is not None:
            return [call]
        return self.fallback.feed(text) + self.fallback.finish()


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``; arguments hold only the keys a tool
    declares where its schema is silent on others (:meth:`Tool.forced_arguments_schema`)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.forced_arguments_schema()},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_from_json(text: str, names: set[str] | None = None) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}``, or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return call_from_object(value, names)


def call_from_object(value: Any, names: set[str] | None = None) -> ToolCall | None:
    """A call from a decoded ``{"name", "arguments"}`` (or ``"parameters"``) object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or (names is not None and value["name"] not in names):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable."""
    return bool(template and _TOOLS_VARIABLE.search(template))


def prepare_chat(
    info: ModelInfo,
    parsers: ModelParsers,
    messages: list[dict[str, Any]],
    *,
    tools: list[Tool] | None = None,
    choice: ToolChoice | None = None,
    parallel: bool = True,
    prefill: str = "",
    template_kwargs: dict[str, Any] | None = None,
    images: Sequence[PromptImage] = (),
) -> ChatSetup:
    """Render and tokenize a conversation (call it in a worker thread: templating is slow).

    ``prefill`` is text the reply continues (Anthropic's final assistant turn).
    ``template_kwargs`` are the request's template variables (``chat_template_kwargs``, e.g.
    ``enable_thinking``), over the model's (``parsers.template_kwargs``); the names the
    rendering sets itself (``messages``, ``tools``, ``add_generation_prompt``) are refused.
    With ``images`` (the request's, loaded, in the order of the messages' ``{"type": "image"}``
    parts), each image marker the template writes becomes that image's tokens
    (:meth:`~mlxr_core.model.vision.ImageTokens.expand_for`).
    """
    tools = list(tools or [])
    choice = choice or ToolChoice()
    _check_choice(tools, choice)
    messages = without_volatile_spans(messages, parsers.volatile_spans)
    tokenizer = info.tokenizer
    shown = tools if choice.mode != "none" else []
    kwargs: dict[str, Any] = {**parsers.template_kwargs, **(template_kwargs or {})}
    reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt"})
    if reserved:
        raise RequestError(f"chat_template_kwargs must not set {reserved[0]!r}", field="chat_template_kwargs")
    if renders_tools(tokenizer.chat_template) or parsers.tool is None:
        messages = [_hf_message(message) for message in messages]
        if shown:
            kwargs["tools"] = [tool.as_openai() for tool in shown]
    else:
        messages = _inline_tools(messages, shown, parsers.tool)
    prompt, ids = render_prompt(info, messages, template_kwargs=kwargs, prefill=prefill, images=images)
    keep = special_ids(tokenizer, parsers.markup_tokens)
    return ChatSetup(prompt, ids, parsers, tools, choice, parallel, keep)


def special_ids(tokenizer: Tokenizer, texts: tuple[str, ...]) -> frozenset[int]:
    """The ids of those ``texts`` that are one special token of ``tokenizer`` (a token the
    detokenizer would leave out of the text)."""
    ids = set()
    for text in texts:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and not tokenizer.decode(encoded, skip_special_tokens=True):
            ids.add(encoded[0])
    return frozenset(ids)


def _check_choice(tools: list[Tool], choice: ToolChoice) -> None:
    if choice.forced and not tools:
        raise RequestError("tool_choice forces a tool call but no tools are given", field="tool_choice")
    if choice.mode == "function" and all(tool.name != choice.name for tool in tools):
        raise RequestError(f"tool_choice names {choice.name!r}, which is not among tools", field="tool_choice")
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools must have distinct names", field="tools")


def _hf_message(message: dict[str, Any]) -> dict[str, Any]:
    """``tool_calls`` arguments as objects, as Hugging Face templates expect."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        calls.append({**call, "function": {**call["function"], "arguments": _as_object(arguments)}})
    return {**message, "tool_calls": calls}


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _inline_tools(
    messages: list[dict[str, Any]], tools: list[Tool], parser: ToolParser
) -> list[dict[str, Any]]:
    """Tools, calls and results as plain text turns, for a template that renders none of them."""
    out: list[dict[str, Any]] = []
    names_by_id: dict[str, str] = {}
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call["function"]
                arguments = function["arguments"]
                text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                calls.append(ToolCall(function["name"], text, call.get("id") or ""))
                names_by_id[call.get("id") or ""] = function["name"]
            content = (content + "\n" if content else "") + parser.render_calls(calls)
        elif role == "tool":
            name = message.get("name") or names_by_id.get(message.get("tool_call_id") or "")
            role, content = "user", parser.render_result(name, content)
        if out and out[-1]["role"] == role == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + content}
        else:
            out.append({"role": role, "content": content})
    if tools:
        instructions = parser.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
