"""Tool-call formats: incremental parsers over streamed text, and how each writes tools into a
prompt for chat templates that render none.

Every format is a :class:`MarkupStream`: plain text passes through as content except for the tail
that may still become an opening marker, which is held back; from an opening marker on, text is
held until the markup is complete, then parsed into calls. Markup that does not parse is given back
as content, exactly as generated.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from mlxr_core.chat.parsing import Text, Tool, ToolCall, new_call_id
from mlxr_core.chat.tools import call_from_object

_DECODER = json.JSONDecoder()
#: What may separate a model's leading calls (Llama 3 writes ``{...}; {...}``).
_BETWEEN_CALLS = " \t\r\n;"

Result = tuple[int, list[ToolCall] | None] | None


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class MarkupStream:
    """Content, then markup opened by one of ``starts`` (anywhere) or ``leading`` (only before any
    content, the marker being part of the markup when ``keep_leading``)."""

    starts: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    keep_leading = False

    def __init__(self) -> None:
        self._buffer = ""
        self._open: str | None = None
        self._content_seen = False

    # -- subclasses ------------------------------------------------------------------------------

    def close(self, marker: str, body: str) -> Result:
        """Given what followed ``marker``: None while the markup is unfinished, else how many
        characters it took and its calls (None: not valid markup)."""
        raise NotImplementedError

    def close_at_end(self, marker: str, body: str) -> list[ToolCall] | None:
        """The calls of markup the output ended inside of (None: it becomes content)."""
        result = self.close(marker, body)
        if result is None or body[result[0]:].strip():
            return None
        return result[1]

    # -- the stream ------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Text | ToolCall]:
        self._buffer += text
        out: list[Text | ToolCall] = []
        while True:
            if self._open is None:
                if not self._scan(out):
                    return out
            else:
                result = self.close(self._open, self._buffer)
                if result is None:
                    return out
                self._closed(result, out)

    def finish(self) -> list[Text | ToolCall]:
        out: list[Text | ToolCall] = []
        if self._open is not None:
            calls = self.close_at_end(self._open, self._buffer)
            if calls is None:
                self._content(self._markup_text(self._open) + self._buffer, out)
            else:
                out.extend(calls)
        elif self._buffer:
            self._content(self._buffer, out)
        self._buffer, self._open = "", None
        return out

    def _scan(self, out: list[Text | ToolCall]) -> bool:
        """Look for an opening marker; True if one was found (and the buffer moved past it)."""
        buffer = self._buffer
        if not self._content_seen:
            rest = buffer.lstrip(_BETWEEN_CALLS)
            for marker in self.leading:
                if rest.startswith(marker):
                    self._open = marker
                    self._buffer = rest if self.keep_leading else rest[len(marker):]
                    return True
            if any(marker.startswith(rest) for marker in self.leading):
                return False  # only blanks, or a marker's beginning, so far
        found = [(buffer.find(marker), marker) for marker in self.starts if marker in buffer]
        if found:
            index, marker = min(found)
            self._content(buffer[:index], out)
            self._open, self._buffer = marker, buffer[index + len(marker):]
            return True
        keep = max((held_back(buffer, marker) for marker in self.starts), default=0)
        self._content(buffer[: len(buffer) - keep], out)
        self._buffer = buffer[len(buffer) - keep:]
        return False

    def _closed(self, result: tuple[int, list[ToolCall] | None], out: list[Text | ToolCall]) -> None:
        used, calls = result
        assert self._open is not None
        if calls is None:
            self._content(self._markup_text(self._open) + self._buffer[:used], out)
        else:
            out.extend(calls)
        self._buffer, self._open = self._buffer[used:], None

    def _markup_text(self, marker: str) -> str:
        return "" if marker in self.leading and self.keep_leading else marker

    def _content(self, text: str, out: list[Text | ToolCall]) -> None:
        if not text:
            return
        if not self._content_seen and not text.strip(_BETWEEN_CALLS):
            return  # blanks before or between leading calls are not an answer
        self._content_seen = True
        out.append(Text(text))


def json_calls(text: str) -> list[ToolCall] | None:
    """Calls from a JSON object or a list of objects, each ``{"name", "arguments"}``."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return object_calls(value)


def object_calls(value: Any) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = call_from_object(item)
        if call is None:
            return None
        if isinstance(item.get("id"), str) and item["id"]:
            call = ToolCall(call.name, call.arguments, item["id"])
        calls.append(call)
    return calls


def decode_prefix(body: str) -> tuple[Any, int] | None:
    """The JSON value at the start of ``body`` (after blanks) and where it ends, or None."""
    start = len(body) - len(body.lstrip())
    try:
        value, end = _DECODER.raw_decode(body, start)
    except ValueError:
        return None
    return value, end


def _tools_json(tools: list[Tool]) -> str:
    return "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


# -- hermes -------------------------------------------------------------------------------------


class HermesStream(MarkupStream):
    starts = ("<tool_call>",)

    def close(self, marker: str, body: str) -> Result:
        end = body.find("</tool_call>")
        if end < 0:
            return None
        return end + len("</tool_call>"), json_calls(body[:end])

    def close_at_end(self, marker: str, body: str) -> list[ToolCall] | None:
        return json_calls(body)


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5 and 3), also
    with a JSON list inside (SmolLM2's function-calling format)."""

    def detect(self, template: str) -> int:
        if "<tool_call>" in template:
            return 3
        return 1 if "<|im_start|>" in template else 0  # ChatML models: Hermes, Qwen, SmolLM2

    def stream(self) -> HermesStream:
        return HermesStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        return (
            "You can call functions to answer the question. The available functions are listed "
            "as JSON within <tools></tools> tags:\n"
            f"<tools>\n{_tools_json(tools)}\n</tools>\n\n"
            "To call functions, reply with a JSON list of calls within <tool_call></tool_call> "
            "tags and no other text, in this format:\n"
            '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>'
        )

    def render_calls(self, calls: list[ToolCall]) -> str:
        items = [{"name": call.name, "arguments": _arguments(call)} for call in calls]
        return f"<tool_call>{json.dumps(items, ensure_ascii=False)}</tool_call>"

    def render_result(self, name: str | None, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


# -- llama 3 ------------------------------------------------------------------------------------


class Llama3JsonStream(MarkupStream):
    starts = ("<|python_tag|>",)
    leading = ("{",)
    keep_leading = True

    def close(self, marker: str, body: str) -> Result:
        decoded = decode_prefix(body)
        if decoded is None:
            stripped = body.lstrip()
            if stripped and stripped[0] not in "{[":
                return len(body), None  # not JSON at all
            return None
        value, end = decoded
        return end, object_calls(value)


class Llama3JsonParser:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``."""

    def detect(self, template: str) -> int:
        if "<|python_tag|>" in template or "ipython" in template:
            return 3
        return 1 if "<|start_header_id|>" in template else 0

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        return (
            "You can call functions. To call one, reply with only a JSON object in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. '
            "The available functions:\n" + _tools_json(tools)
        )

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(
            json.dumps({"name": call.name, "parameters": _arguments(call)}, ensure_ascii=False) for call in calls
        )

    def render_result(self, name: str | None, content: str) -> str:
        return f"Result of {name}: {content}" if name else content


# -- mistral ------------------------------------------------------------------------------------

_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


class MistralStream(MarkupStream):
    starts = ("[TOOL_CALLS]",)

    def close(self, marker: str, body: str) -> Result:
        stripped = body.lstrip()
        if not stripped:
            return None
        if stripped[0] in "[{":  # [TOOL_CALLS][{"name", "arguments", "id"?}, ...]
            decoded = decode_prefix(body)
            return None if decoded is None else (decoded[1], object_calls(decoded[0]))
        # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} (newer tokenizers), possibly repeated
        match = _MISTRAL_NAME.match(body)
        if match is None:
            return None if "[ARGS]" not in body and len(body) < 128 else (len(body), None)
        decoded = decode_prefix(body[match.end():])
        if decoded is None:
            return None
        arguments, end = decoded
        if not isinstance(arguments, dict):
            return match.end() + end, None
        call = ToolCall(match[1], json.dumps(arguments, ensure_ascii=False), match[2] or new_call_id())
        return match.end() + end, [call]


class MistralParser:
    """Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]`` (ids optional) and
    ``[TOOL_CALLS]name[ARGS]{...}``."""

    def detect(self, template: str) -> int:
        if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
            return 3
        return 1 if "[INST]" in template else 0

    def stream(self) -> MistralStream:
        return MistralStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        return (
            "You can call functions. To call them, reply with [TOOL_CALLS] followed by a JSON list "
            'of calls, each {"name": function name, "arguments": {argument: value}}, and nothing '
            "else. The available functions:\n" + _tools_json(tools)
        )

    def render_calls(self, calls: list[ToolCall]) -> str:
        items = [{"name": call.name, "arguments": _arguments(call), "id": call.id} for call in calls]
        return "[TOOL_CALLS]" + json.dumps(items, ensure_ascii=False)

    def render_result(self, name: str | None, content: str) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"


# -- pythonic (Gemma 3) -------------------------------------------------------------------------


def python_calls(source: str) -> list[ToolCall] | None:
    """Calls from ``[f(a=1), g(b="x")]`` or ``f(a=1)``; None if it is anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        calls.append(ToolCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
    return calls


class PythonicStream(MarkupStream):
    leading = ("```tool_code", "[")
    keep_leading = True

    def close(self, marker: str, body: str) -> Result:
        if marker == "```tool_code":
            end = body.find("```", len(marker))
            if end < 0:
                return None
            return end + 3, python_calls(body[len(marker):end])
        for match in re.finditer(r"\]", body):  # the first `]` that closes a valid list of calls
            calls = python_calls(body[: match.end()])
            if calls is not None:
                return match.end(), calls
        if not re.match(r"\s*\[\s*([A-Za-z_]|$)", body):
            return len(body), None  # a list, but not of calls
        return None

    def close_at_end(self, marker: str, body: str) -> list[ToolCall] | None:
        if marker == "```tool_code":
            return python_calls(body[len(marker):])
        return python_calls(body)


class PythonicParser:
    """Python-style calls, ``[get_weather(city="Paris"), ...]`` (Gemma 3's documented format),
    also inside a ```` ```tool_code ```` block."""

    def detect(self, template: str) -> int:
        return 1 if "<start_of_turn>" in template else 0

    def stream(self) -> PythonicStream:
        return PythonicStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        return (
            "You have access to functions. To call functions, reply with only a list in the format "
            "[func_name1(param_name1=value1, param_name2=value2), func_name2(params)] and no other "
            "text. The available functions:\n" + _tools_json(tools)
        )

    def render_calls(self, calls: list[ToolCall]) -> str:
        rendered = []
        for call in calls:
            arguments = _arguments(call)
            items = arguments.items() if isinstance(arguments, dict) else []
            rendered.append(f"{call.name}({', '.join(f'{k}={v!r}' for k, v in items)})")
        return "[" + ", ".join(rendered) + "]"

    def render_result(self, name: str | None, content: str) -> str:
        return f"```tool_output\n{content}\n```"


# -- LFM (Liquid) -------------------------------------------------------------------------------

LFM_CALL, LFM_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
LFM_RESPONSE, LFM_RESPONSE_END = "<|tool_response_start|>", "<|tool_response_end|>"


class LfmStream(MarkupStream):
    starts = (LFM_CALL,)

    def close(self, marker: str, body: str) -> Result:
        end = body.find(LFM_CALL_END)
        if end < 0:
            return None
        return end + len(LFM_CALL_END), _lfm_calls(body[:end])

    def close_at_end(self, marker: str, body: str) -> list[ToolCall] | None:
        return _lfm_calls(body)


def _lfm_calls(body: str) -> list[ToolCall] | None:
    """A Python list of calls (LFM's default) or, when the system prompt asked for JSON, a JSON
    call or list of calls."""
    calls = python_calls(body)
    if calls is None and body.strip().startswith(("{", "[{")):
        calls = json_calls(body)
    return calls


class LfmParser:
    """LFM2 / LFM2.5 / LFM3's ``<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>``
    (Python calls by default, JSON when the system prompt asks for it); results between
    ``<|tool_response_start|>`` and ``<|tool_response_end|>``. The markers are special tokens, kept
    in the text for this parser."""

    markup_tokens = (LFM_CALL, LFM_CALL_END, LFM_RESPONSE, LFM_RESPONSE_END)

    def detect(self, template: str) -> int:
        return 3 if LFM_CALL in template or "<|tool_list_start|>" in template else 0

    def stream(self) -> LfmStream:
        return LfmStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        return "List of tools: <|tool_list_start|>" + _tools_json(tools) + "<|tool_list_end|>"

    def render_calls(self, calls: list[ToolCall]) -> str:
        return LFM_CALL + PythonicParser().render_calls(calls) + LFM_CALL_END

    def render_result(self, name: str | None, content: str) -> str:
        return f"{LFM_RESPONSE}{content}{LFM_RESPONSE_END}"
