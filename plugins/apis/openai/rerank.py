"""Retrieval and token routes in the shapes retrieval stacks and vLLM's clients send: the
``rerank`` entry of ``apis:`` (on by default), answering OpenAI-shaped errors.

- ``POST /v1/rerank`` and ``/rerank`` (Jina's and Cohere's shape: ``query``, ``documents``,
  ``top_n``, ``return_documents``): documents by relevance, best first.
- ``POST /v1/score`` and ``/score`` (vLLM's: ``text_1`` against each of ``text_2``).
- ``POST /tokenize`` and ``/detokenize`` (vLLM's: a prompt or chat messages to ids, ids to text;
  ids outside the model's vocabulary decode to nothing).
  A text of more tokens than the model's context length is refused (400), found from a head of
  it: an answer holds at most ``max_model_len`` ids.

A relevance score is a causal LM's probability of ``yes`` against ``no`` as the next token after
the chat that asks whether the document answers the query (the Qwen3-Reranker method,
:mod:`mlxr_core.engine.scoring`); the prompts are rendered with the model's chat template and
scored on the engine thread in batches, between generation steps.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any

from litestar import Request, Router, post
from litestar.params import JSONBody
from msgspec import Meta, Struct

from mlxr_core.chat.prompt import encode_chat
from mlxr_core.chat.tools import model_config_of
from mlxr_core.engine.client import EngineClient
from mlxr_core.engine.scoring import relevance_messages
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    loaded_model,
    prepare_in_thread,
    ready_engine,
    unless_disconnected,
)
from mlxr_core.http.openapi import documented
from mlxr_plugins.apis.openai.errors import EXCEPTION_HANDLERS
from mlxr_plugins.apis.openai.schemas import ErrorBody

#: Documents (or ``text_2`` entries) one request may score.
MAX_DOCUMENTS = 1024


class Document(Struct, forbid_unknown_fields=False):
    text: str


#: Documents (or ``text_2`` entries) a request scores: one at least, :data:`MAX_DOCUMENTS` at most.
DOCUMENTS = {"minItems": 1, "maxItems": MAX_DOCUMENTS}


class RerankRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    query: str
    documents: Annotated[list[str | Document], Meta(extra_json_schema=DOCUMENTS)]
    top_n: Annotated[int, Meta(extra_json_schema={"minimum": 1})] | None = None
    return_documents: bool = True
    #: What relevance means here (Qwen3-Reranker's instruction); a default when left out.
    instruction: str | None = None


class RerankResult(Struct):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankUsage(Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    """``text_1``: one text, or as many as ``text_2`` (a rule between two lengths, which JSON
    schema cannot state: a 400 naming ``text_1``)."""

    model: str
    text_1: str | Annotated[list[str], Meta(extra_json_schema=DOCUMENTS)]
    text_2: str | Annotated[list[str], Meta(extra_json_schema=DOCUMENTS)]
    instruction: str | None = None


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    model: str
    data: list[ScoreData]
    usage: RerankUsage
    object: str = "list"


class TokenizeFields(Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


#: A ``/tokenize`` body: ``prompt`` or ``messages``, exactly one of them.
TokenizeRequest = Annotated[TokenizeFields, Meta(extra_json_schema={"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
]})]  # fmt: skip


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    #: Ids outside the model's vocabulary decode to nothing.
    tokens: list[Annotated[int, Meta(extra_json_schema={"minimum": 0})]]


class DetokenizeResponse(Struct):
    prompt: str


def relevance_ids(
    engine: EngineClient, model: str, pairs: list[tuple[str, str]], instruction: str | None, prompt: str = "judge"
) -> list[list[int]]:
    """Each (query, document) pair's scoring prompt (``models[].rerank_prompt``), rendered and
    tokenized (a worker thread)."""
    info = engine.model(model)
    return [encode_chat(info, relevance_messages(query, doc, instruction, prompt)) for query, doc in pairs]


async def scores_of(
    ctx: ServerContext, request: Request[Any, Any, Any], model: str, pairs: list[tuple[str, str]], instruction: str | None
) -> tuple[list[float], int]:
    """P(relevant) of each pair, and the prompt tokens read."""
    if not pairs:
        raise RequestError("nothing to score: send at least one document", field="documents")
    if len(pairs) > MAX_DOCUMENTS:
        raise RequestError(f"at most {MAX_DOCUMENTS} documents a request, got {len(pairs)}", field="documents")
    engine = ready_engine(ctx)
    info = await loaded_model(ctx, model)  # an unknown model is a 404 before any templating
    configured = model_config_of(ctx, info)
    prompt = configured.rerank_prompt if configured else "judge"
    ids = await prepare_in_thread(ctx, request, functools.partial(relevance_ids, engine, model, pairs, instruction, prompt))
    scored = await unless_disconnected(request, engine.score_async(model, ids))
    return scored.scores, scored.prompt_tokens


ERRORS = documented(error=ErrorBody)


def make_router(ctx: ServerContext) -> Router:
    """The rerank, score, tokenize and detokenize routes (the ``rerank`` entry of ``apis:``)."""

    @post(["/v1/rerank", "/rerank"], status_code=200, operation_class=ERRORS)
    async def rerank(data: JSONBody[RerankRequest], request: Request[Any, Any, Any]) -> RerankResponse:
        body = data
        texts = [doc if isinstance(doc, str) else doc.text for doc in body.documents]
        if body.top_n is not None and body.top_n < 1:
            raise RequestError("top_n must be at least 1", field="top_n")
        scores, tokens = await scores_of(ctx, request, body.model, [(body.query, t) for t in texts], body.instruction)
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n or len(texts)]
        results = [
            RerankResult(i, scores[i], Document(texts[i]) if body.return_documents else None) for i in ranked
        ]
        return RerankResponse(f"rerank-{uuid.uuid4().hex}", body.model, results, RerankUsage(tokens, tokens))

    @post(["/v1/score", "/score"], status_code=200, operation_class=ERRORS)
    async def score(data: JSONBody[ScoreRequest], request: Request[Any, Any, Any]) -> ScoreResponse:
        body = data
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise RequestError("text_1 must be one text or as many as text_2", field="text_1")
        scores, tokens = await scores_of(ctx, request, body.model, list(zip(firsts, seconds, strict=True)), body.instruction)
        items = [ScoreData(i, value) for i, value in enumerate(scores)]
        return ScoreResponse(f"score-{uuid.uuid4().hex}", body.model, items, RerankUsage(tokens, tokens))

    @post("/tokenize", status_code=200, operation_class=ERRORS)
    async def tokenize(data: JSONBody[TokenizeRequest], request: Request[Any, Any, Any]) -> TokenizeResponse:
        body = data
        engine = ready_engine(ctx)
        info = await loaded_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send either prompt or messages", field="prompt")
        if body.messages is not None:
            render = functools.partial(info.tokenizer.apply_chat_template, body.messages,
                                       add_generation_prompt=body.add_generation_prompt)  # fmt: skip
            text, special = await prepare_in_thread(ctx, request, render), False
        else:
            text, special = body.prompt or "", body.add_special_tokens
        encode = functools.partial(engine.encode, body.model, text, add_special_tokens=special)
        ids = await prepare_in_thread(ctx, request, encode)
        strs = [info.tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(len(ids), info.context_length, ids, strs)

    @post("/detokenize", status_code=200, operation_class=ERRORS)
    async def detokenize(data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
        body = data
        info = await loaded_model(ctx, body.model)
        if any(token < 0 for token in body.tokens):
            raise RequestError("token ids must not be negative", field="tokens")
        vocab = info.tokenizer.vocab_size
        known = [token for token in body.tokens if token < vocab]  # others decode to nothing
        return DetokenizeResponse(info.tokenizer.decode(known, skip_special_tokens=False))

    return Router(
        path="/", route_handlers=[rerank, score, tokenize, detokenize],
        exception_handlers=EXCEPTION_HANDLERS, tags=["rerank"],
    )  # fmt: skip
