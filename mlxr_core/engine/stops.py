"""Stop strings over streamed text.

Text is checked as it streams, so a stop string may arrive split over many deltas. The matcher
holds back exactly the text that could still be the start of a stop string and never emits text
from a stop string on. It runs an Aho-Corasick automaton over the stop strings: each character
costs O(1) amortized whatever the number and length of the stop strings, and the text held back is
never longer than the longest stop string.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """Finds the first occurrence of any of ``stops`` in a stream of text deltas.

    ``feed(text)`` returns ``(safe_text, hit)``: ``safe_text`` can be emitted now; ``hit`` is True
    once a stop string has appeared, and then ``safe_text`` ends just before it and every later
    call returns ``("", True)``. ``flush()`` returns the text held back at the end of generation.
    Empty stop strings are ignored. When two stop strings end at the same character, the longer
    one (which started earlier) wins.
    """

    def __init__(self, stops: list[str]):
        self.stops = sorted({s for s in stops if s})
        # State 0 is the root; each state is a prefix of some stop string.
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        #: Length of the longest stop string that ends at this state (0: none).
        self._match: list[int] = [0]
        for stop in self.stops:
            self._insert(stop)
        self._link()
        self._state = 0
        # Held-back text as characters from ``_start`` on: appending and emitting stay O(1) per
        # character even when a long stop string keeps most of its length held back.
        self._held: list[str] = []
        self._start = 0
        self._hit = False
        #: The stop string that was hit (the longest one ending there), once :attr:`hit`.
        self.matched: str | None = None

    @property
    def hit(self) -> bool:
        """Whether a stop string has been seen."""
        return self._hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Consume ``text``; return the text safe to emit and whether a stop string was hit."""
        if self._hit:
            return "", True
        if not self.stops:
            return text, False
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for i, char in enumerate(text):
            while char not in goto[state] and state:
                state = fail[state]
            state = goto[state].get(char, 0)
            if match[state]:
                # The stop string ends at text[i]: emit what precedes its first character.
                self._hit = True
                before = "".join(self._held[self._start :]) + text[: i + 1]
                self._held, self._start = [], 0
                self.matched = before[len(before) - match[state] :]
                return before[: len(before) - match[state]], True
        self._state = state
        held = self._held
        held.extend(text)
        end = len(held) - self._depth[state]
        safe = "".join(held[self._start : end])
        self._start = end
        if end > 1024 and 2 * end > len(held):
            del held[:end]
            self._start = 0
        return safe, False

    def flush(self) -> str:
        """Return the text held back (no stop string can complete any more)."""
        if self._hit:
            return ""
        held = "".join(self._held[self._start :])
        self._held, self._start, self._state = [], 0, 0
        return held

    def _insert(self, stop: str) -> None:
        state = 0
        for char in stop:
            nxt = self._goto[state].get(char)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[state][char] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[state] + 1)
                self._match.append(0)
            state = nxt
        self._match[state] = len(stop)

    def _link(self) -> None:
        """Breadth-first failure links; a state also matches what its failure state matches."""
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for char, nxt in self._goto[state].items():
                queue.append(nxt)
                back = self._fail[state]
                while char not in self._goto[back] and back:
                    back = self._fail[back]
                target = self._goto[back].get(char, 0)
                self._fail[nxt] = target if target != nxt else 0
                # Inherit a shorter stop string ending here (the longest match is kept).
                self._match[nxt] = self._match[nxt] or self._match[self._fail[nxt]]
