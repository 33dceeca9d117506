"""One path from a conversation to prompt ids: render, image tokens, length check, encode."""

from __future__ import annotations

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
