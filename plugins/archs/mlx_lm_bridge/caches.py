"""mlxr's caches as mlx-lm's layers take them, and a check that a bridged graph batches.

mlx-lm's models take no mask: they build one from the cache (``create_attention_mask`` calls
``cache.make_mask``). :func:`views` hands mlx-lm each of mlxr's key/value caches as a
:class:`CacheView`, the same cache with mlx-lm's ``make_mask``, which hides a batch row's left
padding and the keys outside a sliding window. A recurrent layer's state (mlx-lm's
``ArraysCache``: a convolution's last inputs, an SSM state) is mlxr's
:class:`~mlxr_core.model.cache.StateCache`, which has the surface mlx-lm's layers use. :func:`cache_layout` reads which layers have windows
or recurrent state from the caches mlx-lm would make, and refuses the other kinds (a list of
caches per layer, chunked or quantized caches). :func:`batch_problem` decodes two prompts as the
engine does, to catch a graph that ignores the padding mask.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.cache import BatchKVCache, BatchStateCache, KVCache, StateCache, batch_mask


@attrs.frozen
class CacheLayout:
    """The caches an mlx-lm model takes: per entry, the attention window its layer masks to
    (None: full attention), and for a recurrent layer the number of arrays its state holds
    (0: keys and values)."""

    windows: tuple[int | None, ...]
    slots: tuple[int, ...]


def cache_layout(model: nn.Module, model_type: str) -> CacheLayout:
    """The windows and recurrent states of the caches mlx-lm makes for ``model``; raises
    ModelLoadError when one is of another kind (several caches per layer, chunks, quantized keys)."""
    from mlx_lm.models import cache as mlx_cache

    windows: list[int | None] = []
    slots: list[int] = []
    refused: Counter[str] = Counter()
    caches = mlx_cache.make_prompt_cache(model)
    for cache in caches:
        if type(cache) is mlx_cache.KVCache:
            windows.append(None)
        elif type(cache) is mlx_cache.RotatingKVCache and cache.keep == 0:
            windows.append(int(cache.max_size))
        elif type(cache) is mlx_cache.ArraysCache:
            windows.append(None)
            slots.append(len(cache.cache))
            continue
        else:
            refused[type(cache).__name__] += 1
        slots.append(0)
    if refused:
        kinds = ", ".join(f"{count} {name}" for name, count in sorted(refused.items()))
        raise ModelLoadError(
            f"mlx-lm's {model_type} keeps its state in {sum(refused.values())} of its "
            f"{len(caches)} layer caches in a kind mlxr's engine cannot batch ({kinds}: several "
            "caches per layer, chunked or quantized state; it batches keys and values and "
            "recurrent arrays), so the mlx-lm bridge cannot serve this model type (a native "
            "architecture would)"
        )
    return CacheLayout(tuple(windows), tuple(slots))


class CacheView:
    """An mlxr cache as mlx-lm's layers use one: its ``offset``, ``update_and_fetch`` and
    ``state`` (anything else read through), and mlx-lm's ``make_mask``."""

    __slots__ = ("cache", "window")

    def __init__(self, cache: KVCache | BatchKVCache, window: int | None):
        self.cache = cache
        self.window = window

    @property
    def offset(self) -> int | mx.array:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys, values)

    @property
    def state(self) -> list[mx.array]:
        return self.cache.state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The mask for ``N`` new positions as mlx-lm's caches give it: None or ``"causal"`` where
        nothing is hidden, else a boolean array (``[B, 1, N, S]`` for a padded batch) hiding each
        row's left padding and, in a window layer, the keys ``window`` or more positions back."""
        from mlx_lm.models.base import create_causal_mask

        window = window_size or self.window
        cache = self.cache
        if isinstance(cache, BatchKVCache):
            held = cache.length
            padding = mx.array(cache.left_padding) if cache.padded else None
        else:
            held, padding = int(cache.offset), None
        if padding is None and (window is None or held + N <= window):
            if N == 1:
                return None
            if not return_array:
                return "causal"
        mask: mx.array = create_causal_mask(N, held, window_size=window, left_padding=padding)
        return mask


@functools.cache
def state_view_class() -> type:
    """A class of mlx-lm's ``ArraysCache`` whose instances hand every item and attribute to an
    mlxr state cache: mlx-lm's Mamba writes its state back only into an ``ArraysCache``
    (``isinstance``), so a state cache handed over as it is kept none after the prompt."""
    from mlx_lm.models.cache import ArraysCache

    class StateView(ArraysCache):  # type: ignore[misc]  # mlx-lm is untyped
        __slots__ = ("_state",)

        def __init__(self, state: StateCache | BatchStateCache):
            object.__setattr__(self, "_state", state)

        def __getitem__(self, index: int) -> Any:
            return object.__getattribute__(self, "_state")[index]

        def __setitem__(self, index: int, value: Any) -> None:
            object.__getattribute__(self, "_state")[index] = value

        def __getattribute__(self, name: str) -> Any:
            if name in ("__class__", "__getitem__", "__setitem__"):
                return object.__getattribute__(self, name)
            return getattr(object.__getattribute__(self, "_state"), name)

    return StateView


def views(model: nn.Module, cache: list[Any] | None) -> list[Any] | None:
    """``cache`` (mlxr's, one per entry of ``model.cache_layout``) as mlx-lm's layers take it:
    key/value caches viewed, recurrent states as ``ArraysCache`` views."""
    if cache is None:
        return None
    windows = model.cache_layout.windows
    return [
        None if layer is None else CacheView(layer, window) if layer.attends else state_view_class()(layer)
        for layer, window in zip(cache, windows, strict=True)
    ]


def make_caches(layout: CacheLayout, state_bytes: tuple[int, ...] | None = None) -> list[Any]:
    """Fresh mlxr caches for ``layout``: a :class:`KVCache` per key/value entry, a
    :class:`StateCache` per recurrent one (``state_bytes``: what each held after a token)."""
    hints = state_bytes or (0,) * len(layout.slots)
    return [StateCache(n, hint) if n else KVCache() for n, hint in zip(layout.slots, hints, strict=True)]


#: How far a batched row's logits may stray, relative to their largest: from the same row with
#: other padding (the same graph: only a mask that fails lets it matter), and in float32 from the
#: row decoded alone (rounding; half precision rounds a batch's sums differently, and a mixture of
#: experts may then route a token otherwise, so there only the padding check runs).
PADDING_TOLERANCE = 1e-4
SOLO_TOLERANCE = 1e-3
#: What a model that does not batch cannot have.
UNBATCHED = "so the mlx-lm bridge cannot serve it (the engine decodes every model in batches)"
#: Two prompts of different lengths (token ids every vocabulary has).
PROBE_PROMPTS = ([1, 2, 3, 4, 5, 6], [7, 3])


def batch_problem(model: nn.Module, make_cache: Callable[[], list[Any]]) -> str | None:
    """What goes wrong when ``model`` (its caches from ``make_cache``) decodes
    :data:`PROBE_PROMPTS` as the engine does (each
    prefilled alone, then one step as a left-padded batch), or None: the step raises, the short
    row's output changes with what its padding holds (the padding mask is not applied as mlx-lm's
    batch caches give it), or, in float32, a row's logits differ from its own decoded alone."""
    solo, rows = [], []
    try:
        for ids in PROBE_PROMPTS:
            cache = make_cache()
            model(mx.array([ids[:-1]]), cache=cache)
            rows.append([layer.to_batch() for layer in cache])
            solo.append(model(mx.array([ids[-1:]]), cache=cache)[0, -1])
        mx.eval(solo, [layer.state for row in rows for layer in row])
    except Exception as exc:  # the dtype or device, say: nothing the bridge can help
        return f"fails to decode a prompt: {type(exc).__name__}: {exc}"
    try:
        for layer, other in zip(rows[0], rows[1], strict=True):
            layer.extend(other)
        tokens = mx.array([ids[-1:] for ids in PROBE_PROMPTS])
        noisy = _noisy(rows[0])  # before the first pass advances the recurrent states
        batched = [model(tokens, cache=batch, mask=batch_mask(batch))[:, -1] for batch in (rows[0], noisy)]
        mx.eval(batched)
    except Exception as exc:
        return f"fails on a left-padded batch ({type(exc).__name__}: {exc}), {UNBATCHED}"
    dtype = batched[0].dtype
    alone, zeros, noise = (np.array(x.astype(mx.float32)) for x in (mx.stack(solo), *batched))
    scale = float(np.abs(alone).max()) or 1.0
    worst = float(np.abs(noise - zeros).max())
    if not worst <= PADDING_TOLERANCE * scale:
        return (
            f"lets a batch row attend to its left padding (its logits move by {worst:.3g} of "
            f"{scale:.3g} with what the padding holds): its attention does not take the padding "
            f"mask, {UNBATCHED}"
        )
    worst = float(np.abs(zeros - alone).max())
    if dtype == mx.float32 and not worst <= SOLO_TOLERANCE * scale:
        return (
            f"gives a row of a left-padded batch other logits than the row alone (off by "
            f"{worst:.3g} of {scale:.3g}), {UNBATCHED}"
        )
    return None


def _noisy(batch: list[Any]) -> list[Any]:
    """Copies of ``batch``'s caches, the key/value ones with random values instead of zeros in
    their padding positions (recurrent states, which have no padding, copied as they are: the
    first pass replaced the originals' arrays)."""
    out: list[Any] = []
    for layer in batch:
        if isinstance(layer, BatchStateCache):
            out.append(BatchStateCache(list(layer.arrays), list(layer.positions), layer.template))
            continue
        padding = mx.array(layer.left_padding)[:, None, None, None]
        hidden = mx.arange(layer.keys.shape[2])[None, None, :, None] < padding
        keys, values = (
            mx.where(hidden, 8.0 * mx.random.normal(x.shape, key=mx.random.key(0)).astype(x.dtype), x)
            for x in (layer.keys, layer.values)
        )
        out.append(BatchKVCache(keys, values, list(layer.left_padding), layer.length))
    return out
