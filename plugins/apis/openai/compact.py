"""``POST /v1/responses/compact`` (``client.responses.compact``): a long conversation summarized
by the model into what OpenAI's compaction returns: the conversation's user messages as they
were, then one ``compaction`` item holding the summary. A client sends those items back as the
next request's input (Codex does), where the compaction item reads as an assistant turn holding
the summary; the compaction is also stored like a response, so ``previous_response_id`` may name it.

The summary is the model's answer to :data:`COMPACT_PROMPT` after the conversation (its
reasoning, if it thinks, left out). ``encrypted_content`` is opaque to clients; here it is the
summary's text, base64-encoded behind :data:`PREFIX`, not encrypted (there is nothing to hide
from the client that sent the conversation) but signed (:class:`CompactionSeal`, HMAC-SHA256
with ``server.compaction_secret``, or a random secret per start): the summary reads to the model
as its own earlier turn, so an item a client wrote or altered is a 400 naming it, not a way to put
words in the model's mouth.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import time
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from mlxr_core.chat.parsing import Text
from mlxr_core.chat.tools import model_parsers, prepare_chat
from mlxr_core.engine.request import GenerationRequest
from mlxr_core.errors import RequestError
from mlxr_core.http.access import key_owner
from mlxr_core.http.frontend import (
    cap_max_tokens,
    collect,
    loaded_model,
    prepare_in_thread,
    ready_engine,
    room_for,
    submit,
)
from mlxr_core.http.images import load_images
from mlxr_core.http.requests import sampling_params
from mlxr_plugins.apis.openai import responses_schemas as r
from mlxr_plugins.apis.openai.store import Stored

if TYPE_CHECKING:
    from mlxr_core.http.context import ServerContext
    from mlxr_plugins.apis.openai.responses import Responses

#: What the model is asked after the conversation.
COMPACT_PROMPT = (
    "Summarize the conversation above so that the work can go on from your summary alone: the "
    "user's task and requests, decisions made, the files, names, commands and facts involved, "
    "what is done and what is left to do. Write only the summary."
)
#: Tokens a summary may take.
COMPACT_MAX_TOKENS = 1024
#: How a compaction item's ``encrypted_content`` starts: then the summary and its signature, each
#: base64, joined by :data:`SEPARATOR`.
PREFIX = "mlxr-compaction-v2:"
SEPARATOR = "."
#: How the summary reads to the model in a later request (an assistant turn).
SUMMARY_HEADING = "Summary of the conversation so far:\n\n"


class CompactionSeal:
    """Signs the compaction items a server makes and checks those sent back (HMAC-SHA256 over
    the prefix and the encoded summary, compared in constant time)."""

    def __init__(self, key: bytes | str):
        self._key = key.encode() if isinstance(key, str) else key

    def _signature(self, payload: str) -> str:
        digest = hmac.new(self._key, (PREFIX + payload).encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode()

    def encode(self, summary: str) -> str:
        """``summary`` as a compaction item's ``encrypted_content``."""
        payload = base64.b64encode(summary.encode()).decode()
        return PREFIX + payload + SEPARATOR + self._signature(payload)

    def decode(self, content: str | None, param: str) -> str:
        """The summary in a compaction item's ``encrypted_content``: a 400 naming ``param`` for
        one this server did not sign (forged, altered, from another server or an earlier start
        without ``server.compaction_secret``)."""
        payload, _, signature = (content or "").removeprefix(PREFIX).rpartition(SEPARATOR)
        if not content or not content.startswith(PREFIX) or not hmac.compare_digest(
            signature.encode(), self._signature(payload).encode()
        ):
            raise RequestError(
                f"{param} is not a compaction item this server made, or it was altered: its signature does not "
                "match (send the items /v1/responses/compact returned as they were; an item made before a restart "
                "needs server.compaction_secret set)",
                field=param,
            )
        try:
            return base64.b64decode(payload, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):  # signed by this server, so never; kept strict
            raise RequestError(f"{param}: the compaction item's content is damaged", field=param) from None


def compaction_seal(ctx: ServerContext) -> CompactionSeal:
    """The seal of the server ``ctx`` serves (its :attr:`~ServerContext.compaction_key`)."""
    return CompactionSeal(ctx.compaction_key)


def summary_message(summary: str) -> dict[str, Any]:
    """The chat turn a compaction item becomes."""
    return {"role": "assistant", "content": SUMMARY_HEADING + summary}


def _user_items(history: list[dict[str, Any]]) -> list[r.UserMessageItem]:
    items = []
    for message in history:
        if message["role"] != "user":
            continue
        content = message["content"]
        if isinstance(content, str):
            parts = [{"type": "input_text", "text": content}]
        else:
            parts = [{"type": "input_image", "image_url": part["image_url"], "detail": "auto"} if part.get("type") == "image"
                     else {"type": "input_text", "text": part.get("text", "")} for part in content]  # fmt: skip
        items.append(r.UserMessageItem(f"msg_{uuid.uuid4().hex}", parts))
    return items


async def compact(api: Responses, body: r.CompactRequest, request: Any) -> r.CompactedResponse:
    """Summarize ``body``'s conversation; store and return the compaction."""
    from mlxr_plugins.apis.openai.responses import (
        _history_images,
        _without_image_data,
        input_messages,
    )

    ctx = api.ctx
    owner = key_owner(request)
    previous = await api._previous(body.previous_response_id, owner)
    inputs = _history_images(previous.messages) if previous else []
    seal = compaction_seal(ctx)
    messages, listed = input_messages(body.input, inputs, seal) if body.input else ([], [])
    history = (previous.messages if previous else []) + messages
    if not history:
        raise RequestError("there is nothing to compact: send input or previous_response_id", field="input")
    chat = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    chat.append({"role": "user", "content": COMPACT_PROMPT})
    engine = ready_engine(ctx)
    info = await loaded_model(ctx, body.model)
    images = await load_images(ctx.config.server, info, inputs)
    render = functools.partial(prepare_chat, info, model_parsers(ctx, info), _without_image_data(chat), images=images)
    setup = await prepare_in_thread(ctx, request, render)
    params = sampling_params(ctx)
    params.max_tokens = cap_max_tokens(ctx, room_for(engine, body.model, setup.prompt_ids, COMPACT_MAX_TOKENS))
    handle = submit(ctx, GenerationRequest(body.model, setup.prompt_ids, params, keep_special=setup.keep_special,
                                           images=images))  # fmt: skip
    reply = await collect(ctx, handle, request)
    reader = setup.reader()
    pieces = reader.feed(reply.text) + reader.finish()
    summary = "".join(piece.text for piece in pieces if isinstance(piece, Text) and piece.kind == "content").strip()
    usage = reply.finished.usage
    compacted = r.CompactedResponse(
        id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()),
        output=[*_user_items(history), r.CompactionItem(f"cmp_{uuid.uuid4().hex}", seal.encode(summary))],
        usage=r.ResponseUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                              r.InputTokensDetails(usage.cached_tokens)),
    )  # fmt: skip
    if api.store is not None:
        kept = [message for message in history if message["role"] == "user"] + [summary_message(summary)]
        stored = Stored(compacted.id, body.model, msgspec.to_builtins(compacted), listed, kept, owner)
        await anyio.to_thread.run_sync(api.store.put, stored)
    return compacted
