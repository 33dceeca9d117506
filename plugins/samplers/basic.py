"""Temperature, top-k, top-p (nucleus) and min-p as logits processors.

Filtering sets excluded logits to ``-inf``; every processor keeps at least the most likely token.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxr_core.engine.request import SamplingParams

Processor = Callable[[mx.array], mx.array]
NEG_INF = float("-inf")


def temperature(params: SamplingParams) -> Processor | None:
    if params.temperature in (0.0, 1.0):  # 0 is greedy (argmax needs no scaling)
        return None
    scale = 1.0 / params.temperature
    return lambda logits: logits * scale


def top_k(params: SamplingParams) -> Processor | None:
    k = params.top_k
    if k <= 0 or params.temperature == 0.0:
        return None

    def process(logits: mx.array) -> mx.array:
        if k >= logits.shape[-1]:
            return logits
        # The k-th largest value is the threshold; ties at the threshold are kept. (A slice ending
        # at -k + 1 is empty for k = 1.)
        kth = mx.sort(logits, axis=-1)[..., -k:][..., :1]
        return mx.where(logits < kth, NEG_INF, logits)

    return process


def top_p(params: SamplingParams) -> Processor | None:
    p = params.top_p
    if p >= 1.0 or params.temperature == 0.0:
        return None

    def process(logits: mx.array) -> mx.array:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        # Keep a token when the mass *before* it is below p: the smallest set reaching p.
        before = mx.cumsum(probs, axis=-1) - probs
        sorted_kept = mx.where(before < p, sorted_logits, NEG_INF)
        inverse = mx.argsort(order, axis=-1)
        return mx.take_along_axis(sorted_kept, inverse, axis=-1)

    return process


def min_p(params: SamplingParams) -> Processor | None:
    threshold = params.min_p
    if threshold <= 0.0 or params.temperature == 0.0:
        return None
    log_threshold = float(mx.log(mx.array(threshold)))

    def process(logits: mx.array) -> mx.array:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        cutoff = mx.max(logits, axis=-1, keepdims=True) + log_threshold
        return mx.where(logits < cutoff, NEG_INF, logits)

    return process
