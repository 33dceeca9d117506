"""Engine logprobs (:class:`~mlxr_core.engine.request.TokenLogprob`) in OpenAI's two formats: the
chat one (``choices[].logprobs.content[]`` with each token's text, bytes and alternatives) and the
legacy completions one (parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from mlxr_core.engine.request import TokenLogprob
from mlxr_plugins.apis.openai import schemas as s

_PIECES: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Any) -> list[bytes]:
    """Each id's bytes (built once per tokenizer)."""
    pieces = _PIECES.get(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = list(tokenizer.token_bytes().pieces)
    return pieces


class LogprobFormatter:
    """Formats one model's token logprobs; ``top`` alternatives per token are kept."""

    def __init__(self, tokenizer: Any, top: int):
        self.pieces = token_pieces(tokenizer)
        self.top = top

    def _piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def text(self, token: int) -> str:
        return self._piece(token).decode("utf-8", errors="replace")

    def chat(self, entries: Sequence[TokenLogprob]) -> s.ChatLogprobs:
        return s.ChatLogprobs(content=[self._chat_entry(entry) for entry in entries])

    def _chat_entry(self, entry: TokenLogprob) -> s.TokenLogprob:
        piece = self._piece(entry.token)
        top = [
            s.TopLogprob(self.text(token), logprob, list(self._piece(token)))
            for token, logprob in entry.top[: self.top]
        ]
        return s.TokenLogprob(self.text(entry.token), entry.logprob, list(piece), top)

    def completion(self, entries: Sequence[TokenLogprob], offset: int = 0) -> s.CompletionLogprobs:
        """``offset``: characters of text before the first token (the prompt with ``echo``, or
        what earlier chunks of a stream carried)."""
        tokens, offsets = [], []
        for entry in entries:
            text = self.text(entry.token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        top = None
        if self.top:
            top = [
                {self.text(token): logprob for token, logprob in entry.top[: self.top]}
                for entry in entries
            ]
        return s.CompletionLogprobs(tokens, [entry.logprob for entry in entries], top, offsets)
