"""``POST /v1/decisions`` (``client.decisions.create``): 1 to 400 questions about one input, each
a predicate (is this statement about the input true?), a choice among given options, or a score
on given ordered levels.

The input is rendered once as the conversation every question follows; its tokens are prefilled
once (a request of its own, whose prompt is the part every question's prompt shares) and stored in
the prefix cache. Every question is then answered by one engine job
(:mod:`mlxr_core.engine.option_scoring`) that forks each question from that prefix-cache entry, so
only its question is prefilled, and scores each of its options (``yes``/``no``, the choices'
values, the levels' labels) by all of its tokens as a choice-constrained decode reads them: at each
point where options part (``1`` and ``10`` after ``1``: ``0`` or the end), the model's
probability of each way on, normalized over the ways the options allow; they add up to 1 over the
options. The answer is the option they rank first, which is what a greedy decode constrained to
the options (``Constraint("choice")``) gives reading each option as the tokenizer writes it; no
generation row runs. A score's ``score`` is the expected level index (0 for the first level)
under those probabilities. ``usage`` counts the input's prefill once, each question's prompt as
cached up to the input, and the chosen options' tokens as output.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from litestar import Request, Response, post
from litestar.params import JSONBody
from msgspec import Meta, Struct

from mlxr_core.chat.tools import constraints_supported, model_parsers, prepare_chat
from mlxr_core.engine.option_scoring import common_prefix, probabilities
from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest
from mlxr_core.errors import ContextLengthExceeded, RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    json_response,
    loaded_model,
    prepare_in_thread,
    ready_engine,
    submit,
    tracked_events,
    unless_disconnected,
)
from mlxr_core.http.openapi import documented
from mlxr_core.http.requests import sampling_params
from mlxr_plugins.apis.openai import responses_schemas as r
from mlxr_plugins.apis.openai.schemas import ErrorBody, when

#: Questions one request may ask (OpenAI's bound).
MAX_QUESTIONS = 400


class ChoiceOption(Struct, forbid_unknown_fields=False):
    value: str | bool
    description: str | None = None


class ScoreLevel(Struct, forbid_unknown_fields=False):
    label: Annotated[str, Meta(min_length=1)]
    description: str | None = None


class QuestionFields(Struct, forbid_unknown_fields=False):
    type: Literal["predicate", "choice", "score"]
    instructions: Annotated[str, Meta(min_length=1)] | Annotated[list[r.ContentPart], Meta(min_length=1)]
    name: str | None = None
    choices: Annotated[list[ChoiceOption], Meta(min_length=2, max_length=255)] | None = None
    levels: Annotated[list[ScoreLevel], Meta(min_length=2)] | None = None


#: A question: a choice needs its choices, a score its levels.
Question = Annotated[QuestionFields, Meta(extra_json_schema={"allOf": [
    when("type", "choice", {"required": ["choices"], "properties": {"choices": {"type": "array"}}}),
    when("type", "score", {"required": ["levels"], "properties": {"levels": {"type": "array"}}}),
]})]  # fmt: skip


class DecisionRequest(Struct, forbid_unknown_fields=False):
    model: str
    input: str | Annotated[list[r.Item], Meta(min_length=1)]
    questions: Annotated[list[Question], Meta(min_length=1, max_length=MAX_QUESTIONS)]
    prompt_cache_key: str | None = None


def options_of(question: QuestionFields, param: str) -> tuple[list[str], list[Any]]:
    """A question's answers as the model writes them, and as the reply gives them (a choice's
    typed value, a level's index)."""
    if question.type == "predicate":
        return ["yes", "no"], [True, False]
    if question.type == "choice":
        if not question.choices:
            raise RequestError("a choice question needs choices (2 to 255)", field=f"{param}.choices")
        texts = [("true" if c.value else "false") if isinstance(c.value, bool) else c.value for c in question.choices]
        keys = [(type(c.value), c.value) for c in question.choices]
        if len(set(keys)) != len(keys):
            raise RequestError("choices must be unique", field=f"{param}.choices")
        if len(set(texts)) != len(texts) or not all(texts):
            raise RequestError("choices must read differently and not be empty", field=f"{param}.choices")
        return texts, [c.value for c in question.choices]
    if not question.levels:
        raise RequestError("a score question needs levels (2 or more)", field=f"{param}.levels")
    labels = [level.label for level in question.levels]
    if len(set(labels)) != len(labels):
        raise RequestError("levels must have distinct labels", field=f"{param}.levels")
    return labels, list(range(len(labels)))


def question_text(question: QuestionFields, options: list[str], param: str) -> str:
    instructions = question.instructions
    if not isinstance(instructions, str):
        instructions = "\n".join(part.text or "" for part in instructions if part.type in r.TEXT_PARTS)
    if not instructions:
        raise RequestError("a question needs instructions", field=f"{param}.instructions")
    if question.type == "predicate":
        return f"Is the following statement about the conversation above true?\n{instructions}\nAnswer yes or no."
    if question.type == "choice":
        descriptions = [choice.description for choice in question.choices or []]
    else:
        descriptions = [level.description for level in question.levels or []]
    lines = [f"- {text}" + (f": {about}" if about else "") for text, about in zip(options, descriptions, strict=True)]
    return f"{instructions}\nAnswer with exactly one of:\n" + "\n".join(lines)


def answer(question: QuestionFields, values: list[Any], labels: list[str], chosen: int | None, probabilities: list[float]) -> dict[str, Any]:
    """One answer in the SDK's shape (a refusal where the model's text matched no option)."""
    if chosen is None:
        return {"type": "refusal", "name": question.name}
    if question.type == "predicate":
        return {"type": "predicate", "name": question.name, "probability": probabilities[0]}
    confidence = probabilities[chosen]
    if question.type == "choice":
        return {"type": "choice", "name": question.name, "choice": values[chosen], "confidence": confidence,
                "probabilities": [{"value": v, "probability": p} for v, p in zip(values, probabilities, strict=True)]}  # fmt: skip
    return {"type": "score", "name": question.name, "score": sum(i * p for i, p in enumerate(probabilities)),
            "confidence": confidence, "probabilities": [
                {"label": label, "value": i, "probability": p} for i, (label, p) in enumerate(zip(labels, probabilities, strict=True))]}  # fmt: skip


async def run_row(ctx: ServerContext, generation: GenerationRequest) -> tuple[str, Finished]:
    """One row's text and how it finished."""
    text = ""
    handle = submit(ctx, generation)
    async for event in tracked_events(ctx, handle):
        if isinstance(event, Delta):
            text += event.text
        elif isinstance(event, Failed):
            raise event.error
        else:
            return text, event
    raise RequestError("the request ended without an answer")


#: Prompt tokens of all of one request's questions together (each question's row holds the input's
#: ids): a bound on what one request makes the server hold before any row runs.
MAX_DECISION_TOKENS = 4_000_000


async def decide(ctx: ServerContext, body: DecisionRequest, request: Request[Any, Any, Any]) -> dict[str, Any]:
    from mlxr_plugins.apis.openai.compact import compaction_seal
    from mlxr_plugins.apis.openai.responses import input_messages

    if not constraints_supported(ctx, "choice"):
        raise RequestError("decisions need a sampler plugin that enforces choices (structured output)", field="questions")
    images: list[Any] = []
    messages, _ = input_messages(body.input, images, compaction_seal(ctx))
    if images:
        raise RequestError("decisions take text input here; images are not supported", field="input")
    asked = []
    for i, question in enumerate(body.questions):
        param = f"questions[{i}]"
        options, values = options_of(question, param)
        asked.append((question, options, values, question_text(question, options, param)))
    ready_engine(ctx)
    info = await loaded_model(ctx, body.model)
    parsers = model_parsers(ctx, info)

    def render() -> tuple[list[Any], list[int]]:
        setups = []
        for _, options, _, text in asked:
            try:
                setup = prepare_chat(info, parsers, [*messages, {"role": "user", "content": text}])
            except ContextLengthExceeded as exc:  # the input's text is past the context
                raise ContextLengthExceeded(exc.message, field="input") from None
            # The first question's prompt bounds them all: one past the context, or too many ids
            # for every question to hold its own copy of, is refused before the rest are rendered.
            if len(setup.prompt_ids) > info.context_length:
                raise ContextLengthExceeded(
                    f"the input and a question take {len(setup.prompt_ids)} tokens, more than this model's "
                    f"context length ({info.context_length}); shorten the input", field="input")  # fmt: skip
            if len(setup.prompt_ids) * len(asked) > MAX_DECISION_TOKENS:
                raise RequestError(
                    f"{len(asked)} questions over an input of {len(setup.prompt_ids)} tokens are more than one "
                    f"request may ask ({MAX_DECISION_TOKENS:,} prompt tokens over all questions); ask fewer "
                    "questions or shorten the input", field="questions")  # fmt: skip
            setups.append((setup, [info.tokenizer.encode(option, add_special_tokens=False) for option in options]))
        return setups, common_prefix([setup.prompt_ids for setup, _ in setups])

    setups, shared = await prepare_in_thread(ctx, request, render)
    usage = {"input": 0, "output": 0, "cached": 0, "written": 0}
    if len(setups) > 1 and len(shared) >= 16:  # prefill the input once, for every question to fork from
        warm = sampling_params(ctx, max_tokens=1, temperature=0.0)
        _, finished = await run_row(ctx, GenerationRequest(body.model, shared, warm))
        usage["input"] += finished.usage.prompt_tokens - finished.usage.cached_tokens
        usage["cached"] += finished.usage.cached_tokens
        usage["written"] += finished.usage.cache_written_tokens
    # Every question is answered from the option scoring job: it forks each question from the
    # input's prefix-cache entry, runs only the question's own tokens, and reads each option's
    # probability where the options part. The answer is the option the scores rank first (what a
    # choice-constrained greedy decode of the option as the tokenizer writes it gives), so no
    # generation row runs.
    prompts = [setup.prompt_ids for setup, _ in setups]
    scoring = ready_engine(ctx).option_scores_async(body.model, prompts, [option_ids for _, option_ids in setups])
    scored = asyncio.ensure_future(scoring)
    try:  # a client that leaves stops the scoring
        result = await unless_disconnected(request, scored)
    except BaseException:
        scored.cancel()
        raise
    asked_tokens = sum(map(len, prompts))
    usage["input"] += result.prefilled
    usage["cached"] += asked_tokens - result.prefilled
    answers = []
    for (question, options, values, _), (_, option_ids), scores in zip(asked, setups, result.scores, strict=True):
        chances = probabilities(scores)
        chosen = max(range(len(chances)), key=chances.__getitem__)
        usage["output"] += len(option_ids[chosen])  # the answer's tokens, as the tokenizer writes it
        answers.append(answer(question, values, options, chosen, chances))
    total_in = usage["input"] + usage["cached"]
    return {
        "answers": answers, "model": body.model,
        "usage": {"input_tokens": total_in, "output_tokens": usage["output"], "total_tokens": total_in + usage["output"],
                  "input_tokens_details": {"cached_tokens": usage["cached"], "cache_write_tokens": usage["written"]},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }  # fmt: skip


class Usage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class Decision(Struct):
    """Answers in question order (each a predicate, choice, score or refusal), the model, usage."""

    answers: list[dict[str, Any]]
    model: str
    usage: Usage


def decision_routes(ctx: ServerContext, paths: Any) -> list[Any]:
    """``POST /v1/decisions`` (and unprefixed)."""

    @post(paths("/decisions"), status_code=200, operation_class=documented(response=Decision, error=ErrorBody))
    async def decisions(data: JSONBody[DecisionRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return json_response(await decide(ctx, data, request))

    return [decisions]


