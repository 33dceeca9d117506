"""What the drafting decoders share: verifying a draft with one forward pass of the target, the
speculative rejection sampling that keeps the target's distribution, and cache rollback.

A draft of ``k`` tokens ``d_1..d_k`` follows the last emitted token ``t``. The target runs once over
``[t, d_1..d_k]``; row ``i`` of its logits is its distribution for the token after ``d_i`` (row 0:
after ``t``). At temperature 0 the longest prefix of the draft equal to the target's argmaxes is
accepted, and the target's own argmax after it is emitted too, so the output is exactly the
target's greedy output. Otherwise draft token ``d_i`` is accepted with probability
``min(1, p_i(d_i) / q_i(d_i))``; the first rejected one is replaced by a draw from
``norm(max(0, p_i - q_i))``, and when all are accepted a bonus token is drawn from ``p_{k+1}``
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"). A draft
without a distribution (copied from the prompt) is a point mass: ``q_i(d_i) = 1``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.engine.decoding import RequestSampler
from mlxr_core.engine.speculation import speculative_sample

__all__ = ["check_trimmable", "logits_width", "speculative_sample", "trim", "verify"]
from mlxr_core.errors import ConfigError


def verify(
    target_logits: mx.array,
    draft: mx.array,
    sampler: RequestSampler,
    draft_logits: mx.array | None = None,
) -> tuple[int, list[int]]:
    """Check a draft against the target's logits over ``[last, *draft]`` (``[k + 1, V]``, raw).

    :return: the number of draft tokens accepted and the tokens to emit: the accepted draft prefix
        followed by one token of the target's own. Evaluates (one host sync).
    """
    processed = sampler.process(target_logits)
    if sampler.greedy:
        choice = mx.argmax(processed, axis=-1)
        mx.eval(choice, draft)
        targets: list[int] = choice.tolist()  # type: ignore[assignment]
        proposed: list[int] = draft.tolist()  # type: ignore[assignment]
        n = 0
        while n < len(proposed) and proposed[n] == targets[n]:
            n += 1
        return n, [*proposed[:n], targets[n]]
    accepted, replacement = speculative_sample(processed, draft, draft_logits, sampler.next_key())
    mx.eval(accepted, replacement, draft)
    passed: list[bool] = accepted.tolist()  # type: ignore[assignment]
    replacements: list[int] = replacement.tolist()  # type: ignore[assignment]
    proposed = draft.tolist()  # type: ignore[assignment]
    n = 0
    while n < len(proposed) and passed[n]:
        n += 1
    return n, [*proposed[:n], replacements[n]]


def trim(cache: list[Any], n: int) -> None:
    """Forget the last ``n`` positions of every layer's cache (rejected draft tokens)."""
    if n > 0:
        for layer in cache:
            layer.trim(n)


def check_trimmable(cache: list[Any], decoder: str, model: str) -> None:
    """Raise a :class:`ConfigError` unless every layer's cache can drop its last positions."""
    stuck = sorted(
        {
            type(layer).__name__
            for layer in cache
            if not callable(getattr(layer, "is_trimmable", None)) or not layer.is_trimmable()
        }
    )
    if stuck:
        raise ConfigError(
            f"decoder {decoder} cannot serve model {model}: its caches ({', '.join(stuck)}) cannot "
            "drop positions, so rejected draft tokens could not be rolled back; use decoder: plain",
            field="models[].decoder",
        )


def logits_width(model: Any) -> int:
    """Width of ``model``'s logits (rows of its LM head), from a one-token forward pass."""
    logits = model.model(mx.array([[0]], dtype=mx.int32), cache=model.make_cache())
    return int(logits.shape[-1])
