"""The ``<think>...</think>`` reasoning format (Qwen3, DeepSeek-R1, SmolLM3 ...)."""

from __future__ import annotations

from mlxr_core.chat.parsing import Text
from mlxr_plugins.parsers.tools import held_back

OPEN, CLOSE = "<think>", "</think>"


class ThinkStream:
    """Reasoning inside ``<think>...</think>`` at the start of the output (or from the start, when
    the prompt already opened the block), content after it. A partial marker is held back."""

    def __init__(self, opened: bool) -> None:
        # before: a <think> may still open; thinking: inside; after: plain content.
        self._state = "thinking" if opened else "before"
        self._buffer = ""
        #: Blanks right after ``</think>`` separate the block from the answer; not content.
        self._strip = False

    def feed(self, text: str) -> list[Text]:
        self._buffer += text
        out: list[Text] = []
        if self._state == "before":
            rest = self._buffer.lstrip()
            if rest.startswith(OPEN):
                self._state, self._buffer = "thinking", rest[len(OPEN):]
            elif OPEN.startswith(rest):
                return out  # blanks, or the marker's beginning, so far
            else:
                self._state = "after"
        if self._state == "thinking":
            end = self._buffer.find(CLOSE)
            if end < 0:
                keep = held_back(self._buffer, CLOSE)
                out.append(Text(self._buffer[: len(self._buffer) - keep], "reasoning"))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return [piece for piece in out if piece.text]
            out.append(Text(self._buffer[:end], "reasoning"))
            self._state, self._buffer, self._strip = "after", self._buffer[end + len(CLOSE):], True
        if self._strip:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return [piece for piece in out if piece.text]
            self._strip = False
        out.append(Text(self._buffer))
        self._buffer = ""
        return [piece for piece in out if piece.text]

    def finish(self) -> list[Text]:
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        return [Text(text, "reasoning" if self._state == "thinking" else "content")]


class ThinkParser:
    """``<think>`` blocks; chosen by ``auto`` for templates that mention ``<think>``."""

    thinking_markers = (OPEN, CLOSE)

    def detect(self, template: str) -> int:
        return 3 if OPEN in template else 0

    def stream(self, prompt: str) -> ThinkStream:
        # Qwen3 (enable_thinking) and DeepSeek-R1 templates end the prompt inside the block.
        return ThinkStream(opened=prompt.rstrip().endswith(OPEN))
