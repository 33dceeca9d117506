"""The decoder contract and the sampler chain built once per request.

Sampler plugins register *factories*: ``factory(params, context)`` gets one request's
:class:`~mlxr_core.engine.request.SamplingParams` and a :class:`SamplerContext` and returns a logits
processor (``[B, V] -> [B, V]``), or None when the request does not use it. A processor may also
define ``accept(token: int)``: it is then told every token the request emits, in order, before the
next token's logits are processed (penalties count tokens, grammars advance their state), and
``valid_prefix(tokens: list[int]) -> int``: how many of a draft's tokens, from the first, it allows
to follow (a grammar; drafts are cut there before they are verified). A factory
may define ``validate(params, context)``, called in the caller's thread when the request is
submitted, raising :class:`~mlxr_core.errors.RequestError` (a 400) for parameters it cannot honour.

The engine composes the chain into a :class:`RequestSampler` once per request: no plugin lookup in
the token loop.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import mlx.core as mx

if TYPE_CHECKING:
    from mlxr_core.config.schema import ConstraintLimits
    from mlxr_core.engine.request import SamplingParams, TokenLogprob
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.registry import Registry


@attrs.frozen
class SamplerContext:
    """What a sampler factory may need besides the request's parameters."""

    #: The request's prompt, as the model sees it.
    prompt_ids: Sequence[int] = ()
    #: The model's tokenizer (:class:`mlxr_core.model.tokenizer.Tokenizer`); None in unit tests.
    tokenizer: Any = None
    #: Width of the model's logits (rows of the embedding table; may exceed the vocabulary).
    vocab_size: int = 0
    #: The bounds on an output constraint (``engine.constraint_limits``) for the plugin that
    #: enforces constraints to refuse one past them at submit; None: their defaults.
    constraint_limits: ConstraintLimits | None = None


class LogitsProcessor(Protocol):
    def __call__(self, logits: mx.array) -> mx.array: ...


class RequestSampler:
    """One request's logits processors and its final draw.

    Temperature 0 is greedy (argmax after the processors); otherwise a categorical draw with the
    request's own random key, so a seeded request is reproducible whatever else the engine runs.
    """

    def __init__(self, processors: list[LogitsProcessor], params: SamplingParams):
        self.processors = processors
        self.greedy = params.temperature == 0.0
        #: A batch of rows that are all ``plain_greedy`` is drawn with one argmax.
        self.plain_greedy = self.greedy and not processors
        self._acceptors: list[Callable[[int], None]] = [
            accept for proc in processors if callable(accept := getattr(proc, "accept", None))
        ]
        #: Some processor follows the emitted tokens: the next step's logits cannot be processed
        #: before this step's token is known (no double-buffering across that boundary).
        self.stateful = bool(self._acceptors)
        self._checks: list[Callable[[list[int]], int]] = [
            check for proc in processors if callable(check := getattr(proc, "valid_prefix", None))
        ]
        self.logprobs = params.logprobs
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    def process(self, logits: mx.array) -> mx.array:
        """Apply the processors to ``[B, V]`` logits (float32)."""
        logits = logits.astype(mx.float32)
        for proc in self.processors:
            logits = proc(logits)
        return logits

    def draw(self, logits: mx.array) -> mx.array:
        """``[B, V]`` processed logits -> ``[B]`` token ids."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(logits, key=self.next_key())

    def next_key(self) -> mx.array:
        """A fresh key from the request's random stream (decoders needing more randomness)."""
        self._key, key = mx.random.split(self._key)
        return key

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, may follow the tokens emitted so far: a
        processor that restricts the output (a grammar) says with its ``valid_prefix``; all of
        them where none does. A draft is cut there before it is verified."""
        allowed = len(tokens)
        for check in self._checks:
            allowed = min(allowed, check(tokens[:allowed]))
        return allowed

    def accept(self, token: int) -> None:
        """Tell the stateful processors that ``token`` was emitted."""
        for accept in self._acceptors:
            accept(token)

    def __call__(self, logits: mx.array) -> mx.array:
        return self.draw(self.process(logits))


#: ``[B, V]`` logits -> ``[B]`` token ids (a :class:`RequestSampler` is one).
Sampler = Callable[[mx.array], mx.array]


def _call(factory: Callable[..., Any], params: SamplingParams, context: SamplerContext) -> Any:
    """Call a factory with ``(params, context)``, or ``(params)`` for one written that way."""
    try:
        inspect.signature(factory).bind(params, context)
    except TypeError:
        return factory(params)
    except ValueError:  # no signature (a builtin): assume the current contract
        pass
    return factory(params, context)


def _factories(samplers: Registry) -> list[Callable[..., Any]]:
    entries = sorted(samplers, key=lambda entry: (entry.meta.get("order", 0), entry.name))
    return [entry.load() for entry in entries]


def make_sampler(
    params: SamplingParams, samplers: Registry, context: SamplerContext | None = None
) -> RequestSampler:
    """Compose the request's logits processors (registered by sampler plugins) and a final draw."""
    context = context or SamplerContext()
    processors = [
        proc for factory in _factories(samplers) if (proc := _call(factory, params, context)) is not None
    ]
    return RequestSampler(processors, params)


def validate_sampling(params: SamplingParams, samplers: Registry, context: SamplerContext) -> None:
    """Let every sampler plugin refuse parameters it cannot honour (raises RequestError)."""
    for factory in _factories(samplers):
        validate = getattr(factory, "validate", None)
        if callable(validate):
            validate(params, context)


def top_logprobs(logprobs: mx.array, top: int) -> tuple[mx.array, mx.array]:
    """The ``top`` most likely ids of each row of ``[R, V]`` logprobs and their logprobs, most
    likely first (lazy): the vocabulary partitioned around the ``top``-th, then those sorted."""
    part = mx.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(logprobs, part, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def to_token_logprob(token: int, values: Sequence[Any]) -> TokenLogprob:
    """One row's logprob, then its alternatives' ids and logprobs (read back from the arrays of
    :class:`~mlxr_core.engine.batch.StepLogprobs`), as a :class:`TokenLogprob`."""
    from mlxr_core.engine.request import TokenLogprob

    chosen = float(values[0])
    if len(values) < 3:
        return TokenLogprob(token, chosen)
    top = tuple((int(i), float(v)) for i, v in zip(values[1], values[2], strict=True))
    return TokenLogprob(token, chosen, top)


@attrs.define
class DraftStats:
    """Draft tokens proposed and accepted by a drafting decoder for one model (read from other
    threads: plain ints, approximate while the engine runs)."""

    #: Draft tokens sent to the target model for verification.
    drafted: int = 0
    #: Of those, the tokens the target agreed with (emitted as they were drafted).
    accepted: int = 0
    #: Verification passes of the target model.
    steps: int = 0
    #: Verification passes by the number of draft tokens they accepted (the distribution).
    accepted_per_pass: dict[int, int] = attrs.field(factory=dict)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        self.accepted_per_pass[accepted] = self.accepted_per_pass.get(accepted, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate,
            # Keys as text: the figures may cross a process or JSON boundary.
            "accepted_per_pass": {str(n): count for n, count in sorted(self.accepted_per_pass.items())},
        }


class Decoder(Protocol):
    """A decoding strategy, registered through ``mlxr_register_decoders``.

    ``batched = True`` on the class means the engine's batch runner implements the strategy for
    batched requests (plain decoding); any other decoder gets the engine to itself per request.

    Optional members, looked up with ``getattr``:

    - ``prepare(model, registries, config)``: called on the engine thread once per served model
      that uses the decoder, before the engine accepts requests (or before the first request that
      names the decoder). ``config`` is the decoder's plugin config section
      (``plugins.config.<plugin>``, an instance of the schema the plugin registered) or None. It
      loads what the decoder needs (a draft model) and checks its preconditions, raising an
      :class:`~mlxr_core.errors.MlxrError` that says what does not match: the engine then fails
      to start with that error.
    - ``release(model_name)``: called on the engine thread when it stops, to drop the MLX arrays
      ``prepare`` made for that model.
    - ``draft_stats``: ``{model name: DraftStats}``, reported by ``Engine.stats()``.
    """

    def generate(
        self,
        model: LoadedModel,
        cache: list[Any],
        prompt_ids: list[int],
        sampler: RequestSampler,
        *,
        prefill_chunk: int,
    ) -> Iterator[int]:
        """Prefill ``prompt_ids`` into ``cache`` (in chunks of ``prefill_chunk``) and yield generated
        token ids one at a time, forever; the engine stops iterating (and closes the generator) on
        EOS, a stop string, ``max_tokens`` or cancellation. Runs on the engine thread.

        The engine only hands a non-batched decoder requests whose sampler is not ``stateful`` and
        that ask for no logprobs; others fall back to plain decoding (logged)."""
        ...
