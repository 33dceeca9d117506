"""The decoder stack and the causal LM on top of it, as every built-in family composes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import MlxrError
from mlxr_core.model.layers.norms import LayerNorm, RMSNorm


class LayerTaps:
    """The residual stream entering chosen layers (``states[i]``: layer ``i``'s input, the
    output of layer ``i - 1``; ``0``: the embeddings), recorded by one pass of
    :meth:`DecoderModel.run_layers` (EAGLE-3's auxiliary hidden states)."""

    def __init__(self, layers: Sequence[int]):
        self.layers = frozenset(layers)
        self.states: dict[int, mx.array] = {}

    def record(self, index: int, h: mx.array) -> None:
        if index in self.layers:
            self.states[index] = h


class DecoderModel(nn.Module):
    """``embed_tokens``, ``layers`` and the final ``norm`` (Hugging Face's ``model.*``):
    ``[B, L]`` ids -> final normed hidden states ``[B, L, hidden]``, under a causal mask unless
    one is given. ``embed_scale`` multiplies the embeddings (Gemma: ``sqrt(hidden)``). Given
    ``embeddings [B, L, hidden]`` (image embeddings merged in, :mod:`mlxr_core.model.vision`),
    it runs from those instead of embedding ``inputs``; given ``positions`` (M-RoPE's
    ``[3, B, L]``, :mod:`mlxr_core.model.layers.mrope`), every layer rotates by those instead of
    its cache's next positions."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        layers: Sequence[nn.Module],
        norm: RMSNorm | LayerNorm,
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.layers = list(layers)
        self.norm = norm
        self.embed_scale = embed_scale
        #: Set around one pass by :meth:`CausalLM.forward_hidden`: the layers' inputs it records.
        self.taps: LayerTaps | None = None

    def embed(self, inputs: mx.array) -> mx.array:
        """``[B, L]`` token ids -> ``[B, L, hidden]``."""
        h: mx.array = self.embed_tokens(inputs)
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, dtype=h.dtype)
        return h

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        h = self.embed(inputs) if embeddings is None else embeddings
        normed: mx.array = self.norm(self.run_layers(h, cache, mask, positions))
        return normed

    def run_layers(
        self,
        h: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        positions: mx.array | None = None,
        added: Sequence[mx.array] = (),
    ) -> mx.array:
        """The layers over ``h [B, L, hidden]`` (before the final norm); ``added[i]`` is added to
        layer ``i``'s output (Qwen3-VL's DeepStack features)."""
        if mask is None and h.shape[1] > 1:
            mask = "causal"
        layer_caches = cache if cache is not None else [None] * len(self.layers)
        at = {} if positions is None else {"positions": positions}
        taps = self.taps
        for index, (layer, layer_cache) in enumerate(zip(self.layers, layer_caches, strict=True)):
            if taps is not None:
                taps.record(index, h)
            h = layer(h, mask, layer_cache, **at)
            if index < len(added):
                h = h + added[index]
        return h


class CausalLM(nn.Module):
    """``model(inputs [B, L], cache=...) -> logits [B, L, vocab]``: a :class:`DecoderModel`
    (``model``) and its LM head (``lm_head``, or the embedding matrix when ``tied``), with the
    pieces a compiled decode step calls (:meth:`embed`, :meth:`final_norm`,
    :meth:`add_final_norm`, :meth:`lm_logits`, :attr:`layers`). ``softcap`` caps the logits at
    ``softcap * tanh(logits / softcap)`` (Gemma)."""

    def __init__(self, model: DecoderModel, *, tied: bool, softcap: float | None = None):
        super().__init__()
        self.model = model
        self.tied = tied
        self.softcap = softcap
        if not tied:
            hidden = model.embed_tokens.weight.shape[1]
            self.lm_head = nn.Linear(hidden, model.embed_tokens.weight.shape[0], bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        at = {} if positions is None else {"positions": positions}
        return self.lm_logits(self.model(inputs, cache, mask, embeddings, **at))

    def embed(self, inputs: mx.array) -> mx.array:
        return self.model.embed(inputs)

    def final_norm(self, h: mx.array) -> mx.array:
        normed: mx.array = self.model.norm(h)
        return normed

    def add_final_norm(self, residual: mx.array, delta: mx.array) -> mx.array:
        """:meth:`final_norm` of ``residual + delta`` (the last block's output in parts), the add
        and the norm in one ``add_rms_norm`` kernel."""
        _, normed = self.model.norm.add_and_norm(delta, residual)
        return normed

    def lm_logits(self, h: mx.array) -> mx.array:
        """Logits from final (normed) hidden states."""
        head: Any = self.model.embed_tokens.as_linear if self.tied else self.lm_head
        logits: mx.array = head(h)
        if self.softcap:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def layers(self) -> list[Any]:
        return self.model.layers

    def forward_hidden(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        mask: str | mx.array | None = None,
        layers: Sequence[int] = (),
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """The backbone's output (after the final norm, before the LM head) and the residual
        stream entering each of ``layers`` (:class:`LayerTaps`), from one pass. Raises
        :class:`MlxrError` where the model's own layer loop records none of them."""
        if not layers:
            return self.model(inputs, cache, mask), {}
        taps = self.model.taps = LayerTaps(layers)
        try:
            hidden: mx.array = self.model(inputs, cache, mask)
        finally:
            self.model.taps = None
        missing = sorted(taps.layers - taps.states.keys())
        if missing:
            raise MlxrError(f"{type(self).__name__} records no hidden states of layers {missing} (its layers "
                            f"run outside DecoderModel.run_layers, or it has {len(self.layers)} layers)")  # fmt: skip
        return hidden, taps.states

    def hidden_states(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """The backbone's output: after the final norm, before the LM head (and soft-capping)."""
        return self.model(inputs, cache)
