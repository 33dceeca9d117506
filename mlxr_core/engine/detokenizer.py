"""Token ids to text, one token at a time, for streaming.

Decoding each token alone is wrong: a token may carry part of a UTF-8 character (an emoji split over
byte-fallback tokens or byte-level BPE pieces), and SentencePiece vocabs render a token's leading
space depending on what precedes it. Decoding everything so far on every token is right but costs
O(n) per token. :class:`StreamingDetokenizer` does what Hugging Face's text-generation-inference
does (its ``prefix_offset``/``read_offset``): it decodes a short window, the tokens of the last
emitted chunk as context plus the tokens not emitted yet, and emits what the new tokens added to
the context's text.
"""

from __future__ import annotations

from collections.abc import Collection

from mlxr_core.model.tokenizer import Tokenizer

#: What an incomplete UTF-8 sequence decodes to; text ending with it is held back.
REPLACEMENT = "\ufffd"
#: Most tokens held back while the text ends in U+FFFD. A UTF-8 character has at most 4 bytes, so
#: beyond this the model is emitting invalid bytes: release them rather than let the window grow.
MAX_PENDING = 16


class StreamingDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is ``decode(all ids)``.

    ``add(token_id)`` returns the text the token finalized (often ``""`` while a character is
    incomplete); ``flush()`` returns whatever is left at the end. Special tokens are skipped,
    except those in ``keep`` (markup a reply parser reads, such as Harmony's ``<|channel|>``): their
    text is emitted as it is, once the text before them is.
    Every call decodes at most ``2 * MAX_PENDING`` tokens, however long the stream.

    Two assumptions about the tokenizer's ``decode``: it concatenates (the text of a window,
    given the chunk before it, is what those tokens add to the whole), and a token that adds no
    text after some text (a skipped special token) never adds any, so it is left out of the window.
    When ``MAX_PENDING`` tokens pile up without completing text (invalid UTF-8 from the model, or
    special tokens before any text) they are released as they are.
    """

    def __init__(self, tokenizer: Tokenizer, keep: Collection[int] = ()):
        self.tokenizer = tokenizer
        self._kept = {i: tokenizer.decode([i], skip_special_tokens=False) for i in keep}
        #: The last emitted chunk (context) followed by the pending tokens.
        self._window: list[int] = []
        self._context_len = 0
        self._context_text = ""
        self._window_text = ""

    def add(self, token_id: int) -> str:
        """Append one token and return the text it completes (``""`` if nothing is final yet)."""
        kept = self._kept.get(token_id)
        if kept is not None:
            # Its text joins no neighbour, and like a skipped one it stays out of the window.
            return self.flush() + kept
        self._window.append(token_id)
        text = self._decode(self._window)
        if text and text == self._window_text and not text.endswith(REPLACEMENT):
            # Nothing added after some text: a skipped special token, which never will add any.
            self._window.pop()
            return ""
        self._window_text = text
        pending = len(self._window) - self._context_len
        grew = len(text) > len(self._context_text) and not text.endswith(REPLACEMENT)
        if grew or pending >= MAX_PENDING:
            return self._emit(text)
        return ""

    def flush(self) -> str:
        """Return the text of the tokens still pending (incomplete UTF-8 becomes U+FFFD)."""
        if len(self._window) == self._context_len:
            return ""
        return self._emit(self._window_text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._context_text) :]
        del self._window[: self._context_len]
        self._context_len = len(self._window)
        self._context_text = self._window_text = self._decode(self._window)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
