"""``logit_bias`` and the repetition, frequency and presence penalties as logits processors.

The penalties follow the tokens the request emits (``accept``); the repetition penalty also covers
the prompt, as in the Hugging Face / llama.cpp convention, while OpenAI's frequency and presence
penalties count the generated tokens only.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import SamplingParams
from mlxr_core.errors import RequestError


class LogitBias:
    def __init__(self, bias: dict[int, float]):
        self.ids = mx.array(list(bias), dtype=mx.int32)
        self.values = mx.array(list(bias.values()), dtype=mx.float32)

    def __call__(self, logits: mx.array) -> mx.array:
        return logits.at[:, self.ids].add(self.values)


def logit_bias(params: SamplingParams, context: SamplerContext) -> LogitBias | None:
    return LogitBias(params.logit_bias) if params.logit_bias else None


def _validate_logit_bias(params: SamplingParams, context: SamplerContext) -> None:
    width = context.vocab_size
    for token, value in params.logit_bias.items():
        if token < 0 or (width and token >= width):
            raise RequestError(
                f"logit_bias names token {token}, outside this model's vocabulary (0..{width - 1})",
                field="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise RequestError(
                f"logit_bias values must be between -100 and 100, got {value} for token {token}",
                field="logit_bias",
            )


logit_bias.validate = _validate_logit_bias  # type: ignore[attr-defined]


class Penalties:
    """Counts of the generated tokens (and which tokens the prompt holds), kept on the device."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        self.repetition = params.repetition_penalty
        self.frequency = params.frequency_penalty
        self.presence = params.presence_penalty
        self.prompt_ids = prompt_ids
        self.counts: mx.array | None = None  # [V] float32: times each token was generated
        self.in_prompt: mx.array | None = None  # [V] bool

    def _start(self, width: int) -> None:
        self.counts = mx.zeros((width,), dtype=mx.float32)
        in_prompt = mx.zeros((width,), dtype=mx.bool_)
        if self.repetition != 1.0 and self.prompt_ids:
            ids = mx.array([t for t in self.prompt_ids if 0 <= t < width], dtype=mx.int32)
            in_prompt = in_prompt.at[ids].add(mx.array(True))
        self.in_prompt = in_prompt

    def __call__(self, logits: mx.array) -> mx.array:
        if self.counts is None:
            self._start(logits.shape[-1])
        assert self.counts is not None and self.in_prompt is not None
        generated = self.counts > 0
        if self.repetition != 1.0:
            seen = mx.logical_or(generated, self.in_prompt)
            penalised = mx.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = mx.where(seen, penalised, logits)
        if self.frequency:
            logits = logits - self.frequency * self.counts
        if self.presence:
            logits = logits - self.presence * generated.astype(mx.float32)
        return logits

    def accept(self, token: int) -> None:
        if self.counts is None or not 0 <= token < self.counts.shape[0]:
            return
        self.counts = self.counts.at[token].add(1.0)


def penalties(params: SamplingParams, context: SamplerContext) -> Penalties | None:
    if params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty:
        return None
    return Penalties(params, list(context.prompt_ids))


def _validate_penalties(params: SamplingParams, context: SamplerContext) -> None:
    if params.repetition_penalty <= 0.0:
        raise RequestError(
            f"repetition_penalty must be positive, got {params.repetition_penalty}",
            field="repetition_penalty",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise RequestError(f"{name} must be between -2 and 2, got {value}", field=name)


penalties.validate = _validate_penalties  # type: ignore[attr-defined]
