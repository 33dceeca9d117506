"""Relevance scores from a causal LM: how much the model prefers ``yes`` to ``no`` as the next
token after a templated (query, document) prompt, as Qwen3-Reranker scores (its card: the
probability of "yes" against "no" at the end of the prompt); both spellings count (``Yes``,
``No``), as a chat model may capitalize its answer. Two prompts (``models[].rerank_prompt``):
``judge``, Qwen3-Reranker's own, for a model trained on it; ``examples``, the question asked
plainly after :data:`EXAMPLES` answered (a chat model not trained to rerank follows worked
examples far better than the judge's instructions: on SmolLM2-135M-Instruct, the relevant
document scored highest for 1 query in 4 with ``judge`` and 4 in 4 with ``examples``).

Runs on the engine thread (see :meth:`mlxr_core.engine.engine.Engine.score`), batched as the
embeddings are (:func:`mlxr_core.engine.embedding.plan_batches`): right-padded rows, whose real
positions never see their padding under a causal mask, and the logits read at each row's last
real position; an input longer than a chunk runs alone through a KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx

from mlxr_core.engine.embedding import plan_batches

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.tokenizer import Tokenizer

#: The question a reranking prompt asks (Qwen3-Reranker's system prompt).
JUDGE = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".'
)
#: The instruction when the client gives none (Qwen3-Reranker's default).
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
#: ``models[].rerank_prompt`` values.
RERANK_PROMPTS = ("judge", "examples")
#: The ``examples`` prompt's worked (query, document, answer) turns before the pair scored.
EXAMPLES = (
    ("What color is the sky?", "On a clear day the sky is blue.", "yes"),
    ("What color is the sky?", "Dogs are loyal animals.", "no"),
    ("How many legs does a spider have?", "Spiders have eight legs.", "yes"),
    ("How many legs does a spider have?", "The train leaves at noon.", "no"),
)


@attrs.frozen
class Scores:
    """Per input (in input order): P(yes) against P(no), and the two log-probabilities it came
    from (of the answer's first token being ``yes`` or ``Yes``, and ``no`` or ``No``)."""

    model: str
    scores: list[float]
    logits: list[tuple[float, float]]
    prompt_tokens: int


def relevance_messages(
    query: str, document: str, instruction: str | None = None, prompt: str = "judge"
) -> list[dict[str, str]]:
    """The chat that asks whether ``document`` answers ``query``, in the ``prompt`` style
    (:data:`RERANK_PROMPTS`); with ``examples``, a client's ``instruction`` is the system message."""
    if prompt == "examples":
        def ask(question: str, text: str) -> str:
            return f"Question: {question}\nText: {text}\nDoes the text answer the question? Answer yes or no."

        messages = [{"role": "system", "content": instruction}] if instruction else []
        for shown_query, shown_document, answer in EXAMPLES:
            messages += [{"role": "user", "content": ask(shown_query, shown_document)},
                         {"role": "assistant", "content": answer}]  # fmt: skip
        return [*messages, {"role": "user", "content": ask(query, document)}]
    user = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}]


def answer_ids(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The first tokens of ``yes`` and of ``no`` as an answer starts, each in both spellings a
    chat model writes (``yes``, ``Yes``), without repeats."""
    def firsts(*words: str) -> list[int]:
        ids = [tokenizer.encode(word, add_special_tokens=False)[:1] for word in words]
        return list(dict.fromkeys(first[0] for first in ids if first))

    yes, no = firsts("yes", "Yes"), firsts("no", "No")
    if not yes or not no or set(yes) & set(no):
        raise ValueError("this tokenizer cannot tell 'yes' from 'no' by their first tokens")
    return yes, no


def probability(yes: float, no: float) -> float:
    """P(yes) among {yes, no}, from their log-probabilities (or logits): the logistic of the
    difference."""
    return 0.5 * (1.0 + math.tanh((yes - no) / 2))


@attrs.frozen
class ScoringWork:
    """A scoring job's work (:class:`~mlxr_core.engine.jobs.EngineJob`): a value, not a closure,
    so the ranks serving together can be sent it (:mod:`mlxr_core.engine.lockstep`)."""

    model: str
    inputs: list[list[int]]
    yes: list[int]
    no: list[int]
    chunk: int

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[None, None, Scores]:
        logits = yield from score_parts(models[self.model], self.inputs, yes=self.yes, no=self.no, chunk=self.chunk)
        scores = [probability(y, n) for y, n in logits]
        return Scores(self.model, scores, logits, sum(len(ids) for ids in self.inputs))


def score_parts(
    loaded: LoadedModel, inputs: list[list[int]], *, yes: list[int], no: list[int], chunk: int
) -> Generator[None, None, list[tuple[float, float]]]:
    """After each token list, the next token's log-probability of being one of ``yes``, and of
    being one of ``no``: a forward pass at a time (yields after each)."""
    out: list[tuple[float, float] | None] = [None] * len(inputs)
    ids = mx.array([*yes, *no])
    split = len(yes)
    for part, batch in enumerate(plan_batches([len(ids) for ids in inputs], chunk)):
        if part:
            yield
        if len(inputs[batch[0]]) > chunk:
            out[batch[0]] = yield from _score_long(loaded, inputs[batch[0]], ids, split, chunk)
            continue
        width = max(len(inputs[i]) for i in batch)
        rows = mx.array([inputs[i] + [0] * (width - len(inputs[i])) for i in batch], dtype=mx.int32)
        last = mx.array([len(inputs[i]) - 1 for i in batch])
        logits = loaded.model(rows)
        picked = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        for i, pair in zip(batch, _answers(picked, ids, split), strict=True):
            out[i] = pair
    return [value for value in out if value is not None]


def _answers(logits: mx.array, ids: mx.array, split: int) -> list[tuple[float, float]]:
    """``[B, V]`` next-token logits -> per row, log P(one of the first ``split`` of ``ids``) and
    log P(one of the rest)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = logprobs[:, ids]
    yes = mx.logsumexp(chosen[:, :split], axis=-1)
    no = mx.logsumexp(chosen[:, split:], axis=-1)
    return list(zip(yes.tolist(), no.tolist(), strict=True))  # type: ignore[arg-type]


def _score_long(
    loaded: LoadedModel, tokens: list[int], ids: mx.array, split: int, chunk: int
) -> Generator[None, None, tuple[float, float]]:
    cache = loaded.make_cache()
    logits = None
    for start in range(0, len(tokens), chunk):
        if start:
            yield
        logits = loaded.model(mx.array([tokens[start : start + chunk]], dtype=mx.int32), cache=cache)
        mx.eval(logits)
    assert logits is not None
    return _answers(logits[:, -1], ids, split)[0]
