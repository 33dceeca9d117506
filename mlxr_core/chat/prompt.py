"""One path from a conversation to prompt ids: render, image tokens, length check, encode."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxr_core.engine.admission import ModelInfo
    from mlxr_core.engine.request import PromptImage


def render_prompt(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    *,
    template_kwargs: dict[str, Any] | None = None,
    prefill: str = "",
    images: Sequence[PromptImage] = (),
) -> tuple[str, list[int]]:
    """``messages`` rendered with ``info``'s chat template (and ``template_kwargs``, its variables)
    and tokenized: the prompt text and ids.

    ``prefill`` is text the reply continues (appended after the generation prompt). With
    ``images`` (the request's, loaded, in the order of their markers), each image marker the
    template writes becomes that image's tokens. A prompt longer than the context is refused
    (:meth:`ModelInfo.encode`) before it is tokenized whole. Most templates write BOS themselves;
    it is added for a model that wants one where they don't.
    """
    tokenizer = info.tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {})) + prefill
    if images and info.image_tokens is not None:
        prompt = info.image_tokens.expand_for(prompt, [image.pixels for image in images])
    ids = info.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return prompt, ids


def encode_chat(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    *,
    template_kwargs: dict[str, Any] | None = None,
    images: Sequence[PromptImage] = (),
) -> list[int]:
    """The prompt ids of ``messages`` (:func:`render_prompt`), for callers that need no text."""
    return render_prompt(info, messages, template_kwargs=template_kwargs, images=images)[1]


#: The roles whose text :func:`without_volatile_spans` edits.
SYSTEM_ROLES = ("system", "developer")


def without_volatile_spans(messages: list[dict[str, Any]], patterns: Sequence[re.Pattern[str]]) -> list[dict[str, Any]]:
    """``messages`` with each match of ``patterns`` removed from the system (and developer) turns'
    text, or only the match's groups where the pattern has any (``engine.prefix_cache.
    volatile_spans``): spans that change on every request and mean nothing to the model, removed
    before tokenizing so the prompt's ids, and hence its cached prefix, do not change with them."""
    if not patterns:
        return messages
    edited = []
    for message in messages:
        content = message.get("content")
        if message.get("role") in SYSTEM_ROLES and isinstance(content, str):
            message = {**message, "content": remove_spans(content, patterns)}
        elif message.get("role") in SYSTEM_ROLES and isinstance(content, list):
            parts = [
                {**part, "text": remove_spans(part["text"], patterns)}
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                for part in content
            ]  # fmt: skip
            message = {**message, "content": parts}
        edited.append(message)
    return edited


def remove_spans(text: str, patterns: Sequence[re.Pattern[str]]) -> str:
    """``text`` without the matches of ``patterns`` (a pattern with groups: without its groups),
    in one pass over the text per pattern (not one copy of it per match)."""
    for pattern in patterns:
        spans = []
        for match in pattern.finditer(text):
            if pattern.groups:
                spans += [match.span(g) for g in range(1, pattern.groups + 1) if match.start(g) >= 0]
            else:
                spans.append(match.span())
        if not spans:
            continue
        kept, at = [], 0
        for start, end in sorted(spans):
            if start >= at:
                kept.append(text[at:start])
            at = max(at, end)
        kept.append(text[at:])
        text = "".join(kept)
    return text
