"""Thinking budgets: a cap on the tokens a reply spends in its reasoning channel.

A request asks with ``reasoning.effort`` (Responses), ``reasoning_effort`` (chat completions) or
Anthropic's ``thinking.budget_tokens``; a model may have a default (``models[].thinking_budget``).
The cap reaches the ``thinking_budget`` sampler (:mod:`mlxr_plugins.samplers.thinking`) through
:attr:`~mlxr_core.engine.request.SamplingParams.extra`: once the reply has spent that many tokens
inside the model's thinking markers, the sampler forces the end-of-thinking marker and the answer
follows. Models whose reasoning parser names no markers (:class:`ThinkingMarkers`) think unbounded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxr_core.chat.parsing import ThinkingMarkers

if TYPE_CHECKING:
    from mlxr_core.chat.tools import ChatSetup
    from mlxr_core.engine.request import SamplingParams

#: The :attr:`SamplingParams.extra` key the sampler reads.
THINKING_BUDGET = "thinking_budget"
#: Reasoning tokens an effort allows (OpenAI's efforts; ``none`` closes the block at once).
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


def thinking_budget(setup: ChatSetup, *, tokens: int | None = None, effort: str | None = None) -> dict[str, Any] | None:
    """The budget of one rendered chat (``setup``) as the sampler takes it: ``tokens`` where the
    request gave a count, else its ``effort``'s, else the model's default; None where there is
    none or the model's reasoning parser names no markers."""
    if tokens is None:
        tokens = EFFORT_BUDGETS[effort] if effort is not None else setup.parsers.thinking_budget
    reasoning = setup.parsers.reasoning
    if tokens is None or not isinstance(reasoning, ThinkingMarkers):
        return None
    start, end = reasoning.thinking_markers
    return {"tokens": tokens, "start": start, "end": end, "opened": setup.prompt.rstrip().endswith(start)}


def limit_thinking(params: SamplingParams, setup: ChatSetup, *, tokens: int | None = None, effort: str | None = None) -> None:
    """Set the budget of :func:`thinking_budget` on ``params`` (nothing where there is none)."""
    budget = thinking_budget(setup, tokens=tokens, effort=effort)
    if budget is not None:
        params.extra[THINKING_BUDGET] = budget
