"""The thinking budget (:mod:`mlxr_core.chat.thinking`): once a reply has spent its budget of
tokens inside the model's thinking markers, the end marker's tokens are forced, one a step, and
the reply goes on unconstrained (the answer).

The budget arrives as ``params.extra["thinking_budget"]``: ``{"tokens", "start", "end",
"opened"}`` (``opened``: the prompt ends inside the block, as Qwen3's templates leave it). Without
``opened``, the block starts where the reply writes the start marker.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.chat.thinking import THINKING_BUDGET
from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import SamplingParams
from mlxr_core.errors import RequestError


class ThinkingBudget:
    """Counts the reply's tokens inside the thinking block and forces its end past ``budget``."""

    def __init__(self, budget: int, start: list[int], end: list[int], opened: bool):
        self.budget, self.start, self.end = budget, start, end
        self.thinking = opened
        self.spent = 0
        #: The index in ``end`` of the next token to force; None: nothing forced.
        self.forcing: int | None = 0 if opened and budget == 0 else None
        self._tail: list[int] = []

    def __call__(self, logits: mx.array) -> mx.array:
        if self.forcing is None:
            return logits
        forced = mx.arange(logits.shape[-1]) == self.end[self.forcing]
        return mx.where(forced, logits, -mx.inf)

    def accept(self, token: int) -> None:
        self._tail = [*self._tail, token][-max(len(self.start), len(self.end)) :]
        if self.forcing is not None:
            self.forcing += 1
            if self.forcing == len(self.end):
                self.thinking, self.forcing = False, None
        elif not self.thinking:
            if self.spent == 0 and self._tail[-len(self.start) :] == self.start:
                self.thinking = True
                self.forcing = 0 if self.budget == 0 else None
        elif self._tail[-len(self.end) :] == self.end:
            self.thinking = False
            self.spent = self.budget + 1  # the block is over: a later start marker is text
        else:
            self.spent += 1
            if self.spent >= self.budget:
                self.forcing = 0

    def valid_prefix(self, tokens: list[int]) -> int:
        """A draft may not run past the budget (the end marker is forced there)."""
        if self.forcing is not None:
            return 0
        if self.thinking:
            return min(len(tokens), self.budget - self.spent)
        return len(tokens)


def thinking_budget(params: SamplingParams, context: SamplerContext) -> ThinkingBudget | None:
    budget = params.extra.get(THINKING_BUDGET)
    if budget is None or context.tokenizer is None:
        return None
    encode = context.tokenizer.encode
    start = encode(budget["start"], add_special_tokens=False)
    end = encode(budget["end"], add_special_tokens=False)
    return ThinkingBudget(int(budget["tokens"]), start, end, bool(budget["opened"]))


def _validate(params: SamplingParams, context: SamplerContext) -> None:
    budget: Any = params.extra.get(THINKING_BUDGET)
    if budget is not None and (not isinstance(budget.get("tokens"), int) or budget["tokens"] < 0):
        raise RequestError("a thinking budget must be a count of tokens >= 0", field="thinking.budget_tokens")


thinking_budget.validate = _validate  # type: ignore[attr-defined]
