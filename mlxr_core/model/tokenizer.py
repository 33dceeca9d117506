"""The tokenizer contract every tokenizer backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, special tokens and chat formatting for one model."""

    #: Number of ids the model's embedding table has rows for (may exceed the vocabulary).
    vocab_size: int
    bos_token_id: int | None
    #: Every id that ends generation (``eos``, ``eot``, ``<|im_end|>`` ...).
    eos_token_ids: frozenset[int]
    bos_token: str | None
    eos_token: str | None
    #: Whether ``encode(..., add_special_tokens=True)`` prepends BOS.
    add_bos: bool
    chat_template: str | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template (sandboxed Jinja2).

        Raise :class:`mlxr_core.errors.RequestError` when the template rejects the messages
        or the model has no template.
        """
        ...


class TokenizerBackend(Protocol):
    """Builds tokenizers of one kind; registered through ``mlxr_register_tokenizers``."""

    def build(self, data: dict[str, Any], *, chat_template: str | None) -> Tokenizer:
        """Build a tokenizer from a :class:`~mlxr_core.model.checkpoint.TokenizerSpec`'s data."""
        ...


class ChatTemplating:
    """``apply_chat_template`` for tokenizers that keep ``chat_template``, ``bos_token`` and
    ``eos_token`` attributes: renders with the sandboxed Jinja2 environment."""

    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template; RequestError if it has none."""
        from mlxr_core.errors import RequestError
        from mlxr_core.model.chat_template import render_chat_template

        if self.chat_template is None:
            raise RequestError(
                "this model has no chat template; send a raw prompt to a completion endpoint",
                param="messages",
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )
