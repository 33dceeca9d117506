"""Decode steps as compiled graphs between the attention layers' caches.

A one-token decode step of a small model is bound by the host, not the device: building the step's
graph op by op in Python and launching each op as its own kernel takes longer than the device needs
for the weights (Llama-3.2-1B shape on an H100: ~1 ms building and ~1.5 ms launching per token,
against ~1 ms of weight reads; see ``bench/decode_profile.py``). ``mx.compile`` replays a traced
graph from C++ and fuses its elementwise ops, which cuts both.

What cannot be compiled is the attention over the cache: the cache grows every step (a new shape,
so a new trace) and is updated in place. So the step is cut at each layer's attention. Between two
attentions, everything is one compiled function of fixed shapes (``[B, 1, hidden]``): the previous
layer's output projection, residuals, norms and MLP, then this layer's norm, projections and RoPE.
Its inputs are the running hidden state, the previous attention's output and the rotary offset (an
array, so a new position is not a new trace); each is traced once per batch size. The cache update,
the window mask and the attention kernel run eagerly between them, through the same methods the
eager forward pass calls, so both paths compute the same graph.

An architecture offers this by giving its decoder blocks the three methods of :class:`DecodeBlock`
(the eager ``__call__`` is their composition):

- ``attention_inputs(x, offset) -> (queries, keys, values)``, each ``[B, heads, L, head_dim]``,
  queries and keys rotated at ``offset``;
- ``attention(queries, keys, values, mask, cache) -> out``: the cache update and the attention
  kernel, as few ops as can be (``out`` is whatever ``after_attention`` takes: the built-in
  blocks pass ``[B, heads, L, head_dim]`` and merge the heads after);
- ``after_attention(x, out) -> [B, L, hidden]``: the rest of the block;

and the module (as built) ``embed(inputs)``, ``final_norm(h)`` and ``lm_logits(h)``, with ``layers``.

Optionally, the residual add that ends each block is fused with the norm that follows it (one
``add_rms_norm`` kernel instead of an add and a norm: a one-token step on a GPU pays per kernel
and per primitive). A module offers this with every block's ``after_attention_parts(x, out) ->
(residual, delta)`` (``after_attention`` is their sum) and ``add_attention_inputs(residual, delta,
offset) -> (h, queries, keys, values)`` (``h = residual + delta``, then ``attention_inputs`` of it),
and the module's ``add_final_norm(residual, delta)`` (``final_norm`` of the sum).
:func:`unsupported` names what a module lacks; the loader then keeps the eager step. A module may
also have the methods and still compute something else in its forward pass (a subclass that
overrides ``__call__`` to scale the logits, say): the loader runs one step both ways on the real
weights (:func:`disagreement`) and keeps the eager step, with a warning, when they differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

#: The methods of :class:`DecodeBlock` and :class:`DecodeModel`, named when a module lacks them.
BLOCK_METHODS = ("attention_inputs", "attention", "after_attention")
MODEL_METHODS = ("embed", "final_norm", "lm_logits")


class DecodeBlock(Protocol):
    """What a compiled decode step needs from each decoder block (see the module)."""

    def attention_inputs(
        self, x: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Queries and keys rotated at ``offset``, and values, as ``[B, heads, L, head_dim]``."""
        ...

    def attention(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any, cache: Any
    ) -> mx.array:
        """The cache update and the attention kernel (run eagerly, between compiled graphs)."""
        ...

    def after_attention(self, x: mx.array, out: mx.array) -> mx.array:
        """The rest of the block: ``[B, L, hidden]``."""
        ...


class ResidualFusingBlock(DecodeBlock, Protocol):
    """A :class:`DecodeBlock` whose residual add can be fused with the next norm."""

    def after_attention_parts(self, x: mx.array, out: mx.array) -> tuple[mx.array, mx.array]:
        """The block's output as ``(residual, delta)``; ``after_attention`` is their sum."""
        ...

    def add_attention_inputs(
        self, residual: mx.array, delta: mx.array, offset: int | mx.array
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``h = residual + delta`` and ``attention_inputs`` of ``h``, as ``(h, q, k, v)``."""
        ...


class DecodeModel(Protocol):
    """What a compiled decode step needs from the module as built."""

    @property
    def layers(self) -> list[Any]: ...

    def embed(self, inputs: mx.array) -> mx.array:
        """``[B, L]`` ids -> ``[B, L, hidden]``."""
        ...

    def final_norm(self, h: mx.array) -> mx.array:
        """The norm after the last block."""
        ...

    def lm_logits(self, h: mx.array) -> mx.array:
        """Logits from final (normed) hidden states."""
        ...


class ResidualFusingModel(DecodeModel, Protocol):
    """A :class:`DecodeModel` whose final norm takes the last block's output in parts."""

    def add_final_norm(self, residual: mx.array, delta: mx.array) -> mx.array:
        """``final_norm(residual + delta)``."""
        ...


def eager_step(
    model: nn.Module, tokens: mx.array, caches: list[Any], mask: mx.array | None = None, shift: mx.array | None = None
) -> mx.array:
    """One decode step through the module's forward pass: ``[B]`` tokens -> ``[B, vocab]`` logits.
    ``shift`` (``[B]``) moves each row's rotary position from its cache position (M-RoPE's
    delta after images, :mod:`mlxr_core.model.layers.mrope`)."""
    at = {} if shift is None else {"positions": caches[0].offset + shift}
    logits: mx.array = model(tokens[:, None], cache=caches, mask=mask, **at)[:, -1, :]
    return logits


#: Each protocol's methods. Conformance is checked on them directly, not with ``isinstance``: a
#: runtime-checkable protocol caches its answer per class, which a class patched later would defeat.
PROTOCOL_METHODS: dict[type, tuple[str, ...]] = {
    DecodeModel: MODEL_METHODS,
    DecodeBlock: BLOCK_METHODS,
    ResidualFusingModel: (*MODEL_METHODS, "add_final_norm"),
    ResidualFusingBlock: (*BLOCK_METHODS, "after_attention_parts", "add_attention_inputs"),
}


def lacking(obj: Any, protocol: type) -> list[str]:
    """The methods of ``protocol`` (one of :data:`PROTOCOL_METHODS`) that ``obj`` lacks."""
    return [name for name in PROTOCOL_METHODS[protocol] if not callable(getattr(obj, name, None))]


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode through :class:`CompiledDecode`, or None when it can: the
    methods of :class:`DecodeModel` and of its blocks' :class:`DecodeBlock` that it lacks."""
    missing = lacking(model, DecodeModel)
    layers = getattr(model, "layers", None)
    if not layers:
        missing.append("layers")
    else:
        missing += [
            f"layers[].{name}"
            for name in BLOCK_METHODS
            if any(name in lacking(layer, DecodeBlock) for layer in layers)
        ]
    return f"the module lacks {', '.join(missing)}" if missing else None


def residuals_fusable(model: nn.Module) -> bool:
    """Whether ``model`` is a :class:`ResidualFusingModel` whose blocks are all
    :class:`ResidualFusingBlock` (see the module)."""
    layers = getattr(model, "layers", None) or []
    return not lacking(model, ResidualFusingModel) and not any(
        lacking(layer, ResidualFusingBlock) for layer in layers
    )


class CompiledDecode:
    """``decode(tokens [B], caches, mask) -> logits [B, vocab]`` of one decode step, compiled
    between attentions (see the module). ``caches`` are the model's per-layer caches (one
    ``KVCache`` each, or the engine's ``BatchKVCache``), advanced in place as by a forward pass;
    ``mask`` is the batch's padding mask or None."""

    def __init__(self, model: nn.Module):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"cannot compile the decode step: {reason}")
        self.layers: list[Any] = list(model.layers)  # type: ignore[attr-defined]
        first, last = self.layers[0], self.layers[-1]
        module: Any = model

        def enter(tokens: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
            h = module.embed(tokens[:, None])
            return (h, *first.attention_inputs(h, offset))

        #: Whether every block's residual add is fused with the norm after it (see the module).
        self.residuals_fused = residuals_fusable(model)
        fused = self.residuals_fused

        def between(done: Any, following: Any) -> Callable[..., tuple[mx.array, ...]]:
            def step(h: mx.array, out: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
                if fused:
                    residual, delta = done.after_attention_parts(h, out)
                    return following.add_attention_inputs(residual, delta, offset)  # type: ignore[no-any-return]
                h = done.after_attention(h, out)
                return (h, *following.attention_inputs(h, offset))

            return step

        def leave(h: mx.array, out: mx.array) -> mx.array:
            if fused:
                normed = module.add_final_norm(*last.after_attention_parts(h, out))
            else:
                normed = module.final_norm(last.after_attention(h, out))
            logits: mx.array = module.lm_logits(normed)
            return logits[:, -1, :]

        self._enter = mx.compile(enter)
        self._between = [mx.compile(between(a, b)) for a, b in itertools.pairwise(self.layers)]
        self._leave = mx.compile(leave)

    def __call__(
        self, tokens: mx.array, caches: list[Any], mask: mx.array | None = None, shift: mx.array | None = None
    ) -> mx.array:
        offset = caches[0].offset if shift is None else caches[0].offset + shift
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        h, queries, keys, values = self._enter(tokens, offset)
        for index, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            out = layer.attention(queries, keys, values, mask, cache)
            if index < len(self._between):
                h, queries, keys, values = self._between[index](h, out, offset)
        return self._leave(h, out)

    def warm(self, batch_sizes: Iterable[int], make_cache: Callable[[], list[Any]]) -> None:
        """Trace the step for each of ``batch_sizes`` rows, with one rotary offset for all rows
        and with one per row, by running it once on fresh caches (a trace per input shape: see
        the module)."""
        for rows in batch_sizes:
            tokens = mx.zeros((rows,), dtype=mx.int32)
            for shift in (None, mx.zeros((rows,), dtype=mx.int32)):
                mx.eval(self(tokens, make_cache(), None, shift))


def disagreement(model: nn.Module, make_cache: Callable[[], list[Any]], compiled: CompiledDecode) -> str | None:
    """Why ``compiled`` does not compute ``model``'s decode step, or None when it does: one step
    after a 3-token prefill, both ways, on the model's own weights; their logits must agree to
    rounding (1% of the largest logit). Traces the compiled functions for one row on the way."""
    prompt = mx.array([[1, 2, 3]], dtype=mx.int32)
    token = mx.array([4], dtype=mx.int32)
    caches = [make_cache(), make_cache()]
    for cache in caches:
        model(prompt, cache=cache)
    eager = eager_step(model, token, caches[0]).astype(mx.float32)
    mine = compiled(token, caches[1]).astype(mx.float32)
    if mine.shape != eager.shape:
        return f"logits of shape {tuple(mine.shape)}, the forward pass gives {tuple(eager.shape)}"
    worst = float(mx.abs(mine - eager).max().item())  # type: ignore[arg-type]
    scale = float(mx.abs(eager).max().item())  # type: ignore[arg-type]
    if not worst <= 1e-2 * max(scale, 1.0):  # also catches NaN
        return f"logits differ from the forward pass's by up to {worst:.3g} (largest logit {scale:.3g})"
    return None
