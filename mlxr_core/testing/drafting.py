"""Drafts of a controlled acceptance, for tests and benchmarks of drafters inside the batch.

A random-weight model's drafter agrees with its target about as often as chance, so neither long
accepted spans nor the speed a real head would give can be seen with it. :func:`control_acceptance`
wraps a drafting decoder's row drafters: each drafter still runs (its passes, its cache, its
chain), then each draft token is replaced by the target's own (from a plain run of the same
prompt) with probability ``acceptance``. Greedy requests only: the replaced tokens are not drawn
from the distribution the drafter reports, so it reports none.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx


class ControlledDrafter:
    """A row drafter whose tokens are the reference's with probability ``acceptance``."""

    def __init__(self, inner: Any, prompt_length: int, reference: Sequence[int], acceptance: float, rng: random.Random):
        self.inner = inner
        self.prompt_length = prompt_length
        self.reference = list(reference)
        self.acceptance = acceptance
        self.rng = rng
        self.draft_logits = None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The wrapped drafter's (:class:`~mlxr_core.engine.speculation.ReadsHidden`)."""
        layers: tuple[int, ...] = getattr(self.inner, "hidden_layers", ())
        return layers

    def observe(self, start: int, hidden: mx.array, following: Sequence[int]) -> None:
        self.inner.observe(start, hidden, following)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.propose_rows([self], [history], [k])[0]

    @classmethod
    def propose_rows(
        cls, drafters: Sequence[ControlledDrafter], histories: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[list[int]]:
        """The wrapped drafters' drafts, together where their kind proposes together (as the
        batch would call them unwrapped), then each token chosen."""
        drafted: list[list[int]] = [[] for _ in drafters]
        kinds: dict[type, list[int]] = {}
        for index, drafter in enumerate(drafters):
            kinds.setdefault(type(drafter.inner), []).append(index)
        for kind, group in kinds.items():
            if hasattr(kind, "propose_rows"):
                inner = [drafters[i].inner for i in group]
                results = kind.propose_rows(inner, [histories[i] for i in group], [ks[i] for i in group])
            else:
                results = [drafters[i].inner.propose(histories[i], ks[i]) for i in group]
            for index, result in zip(group, results, strict=True):
                drafted[index] = list(result)
        return [drafter._choose(history, draft) for drafter, history, draft in zip(drafters, histories, drafted, strict=True)]

    def _choose(self, history: Sequence[int], drafted: list[int]) -> list[int]:
        at = len(history) - self.prompt_length  # the reference token after history[-1]
        right = self.reference[at : at + len(drafted)]
        return [
            truth if self.rng.random() < self.acceptance else token
            for token, truth in zip(drafted, right, strict=False)
        ] + drafted[len(right) :]


class AcceptanceControl:
    """The settings a decoder's wrapped row drafters read when a request is admitted."""

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]], acceptance: float, seed: int):
        self.references = dict(references)
        self.acceptance = acceptance
        self.rng = random.Random(seed)


def control_acceptance(
    decoder: Any, references: Mapping[tuple[int, ...], Sequence[int]], acceptance: float, *, seed: int = 0
) -> AcceptanceControl:
    """From now on, ``decoder``'s row drafters (a drafting decoder's instance, as the registry
    holds it) for a prompt in ``references`` draft that prompt's reference output (a plain greedy
    run's) with probability ``acceptance`` per token; other prompts' are left as they are. Called
    again, it replaces the references and the acceptance (the decoder is wrapped once)."""
    control: AcceptanceControl | None = getattr(decoder, "acceptance_control", None)
    if control is not None:
        control.references, control.acceptance = dict(references), acceptance
        control.rng.seed(seed)
        return control
    control = AcceptanceControl(references, acceptance, seed)
    original = decoder.row_drafter

    def row_drafter(model: Any, request: Any) -> Any:
        drafter = original(model, request)
        reference = control.references.get(tuple(request.prompt_ids))
        if drafter is None or reference is None:
            return drafter
        return ControlledDrafter(drafter, len(request.prompt_ids), reference, control.acceptance, control.rng)

    decoder.row_drafter = row_drafter
    decoder.acceptance_control = control
    return control


def decode_together(
    engine: Any,
    model: str,
    prompts: Sequence[Sequence[int]],
    tokens: int,
    *,
    speculative: bool = True,
    rows: Sequence[Mapping[str, Any]] = (),
    **params: Any,
) -> list[list[int]]:
    """Submit every prompt to ``engine``'s ``model`` at once (greedy, ``tokens`` each with EOS
    ignored, unless ``params``, or for prompt ``i`` ``rows[i]``, say otherwise; drafting unless
    ``speculative`` is False) and return each one's tokens once all have finished."""
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams

    settings = {"temperature": 0.0, "max_tokens": tokens, "extra": {"ignore_eos": True}, **params}
    own = [{**settings, **(rows[i] if i < len(rows) else {})} for i in range(len(prompts))]
    requests = [
        GenerationRequest(model=model, prompt_ids=list(prompt), params=SamplingParams(**row), speculative=speculative)
        for prompt, row in zip(prompts, own, strict=True)
    ]
    handles = [engine.submit(request) for request in requests]
    outputs = []
    for handle in handles:
        events = list(handle)
        if not isinstance(events[-1], Finished):
            raise AssertionError(f"a request ended with {events[-1]!r}")
        outputs.append([token for event in events if isinstance(event, Delta) for token in event.token_ids])
    return outputs


def two_drafting_steps(
    make: Any,
    prompts: Sequence[Sequence[int]],
    longer: Sequence[Sequence[int]],
    states: Sequence[mx.array],
    ks: Sequence[int],
    *,
    together: bool,
) -> list[tuple[list[int], Any]]:
    """Drafters that read hidden states (``make(row)`` -> one, per row), handed row ``i``'s prompt
    ``prompts[i]`` and proposing, then handed the span ``longer[i]`` adds to it (an accepted span)
    and proposing again, ``ks[i]`` tokens each time; ``states[i]`` (``[len(longer[i]) - 1, W]``)
    are the target's states the drafter reads for ``longer[i]``. The rows propose together (their
    class's ``propose_rows``) or each alone. Returns each step's rows' ``(tokens, draft_logits)``."""
    import numpy as np

    drafters = [make(row) for row in range(len(prompts))]
    out: list[tuple[list[int], Any]] = []
    for step, histories in enumerate((prompts, longer)):
        for drafter, prompt, hidden, row in zip(drafters, prompts, states, longer, strict=True):
            start, end = (0, len(prompt) - 1) if step == 0 else (len(prompt) - 1, len(row) - 1)
            drafter.observe(start, hidden[start:end], row[start + 1 : end + 1])
        if together:
            drafted = type(drafters[0]).propose_rows(drafters, histories, ks)
        else:
            drafted = [d.propose(h, k) for d, h, k in zip(drafters, histories, ks, strict=True)]
        out += [(tokens, np.array(d.draft_logits)) for tokens, d in zip(drafted, drafters, strict=True)]
    return out
