"""mlxr's caches as mlx-lm's layers take them, and a check that a bridged graph batches.

mlx-lm's models take no mask: they build one from the cache (``create_attention_mask`` calls
``cache.make_mask``). :func:`views` hands mlx-lm each of mlxr's caches as a :class:`CacheView`, the
same cache with mlx-lm's ``make_mask``, which hides a batch row's left padding and the keys outside
a sliding window. :func:`cache_layout` reads which layers have windows from the caches mlx-lm
would make, and refuses caches that hold anything but keys and values. :func:`batch_problem`
decodes two prompts as the engine does, to catch a graph that ignores the padding mask.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.cache import BatchKVCache, KVCache


@attrs.frozen
class CacheLayout:
    """The caches an mlx-lm model takes: per entry, the attention window its layer masks to
    (None: full attention)."""

    windows: tuple[int | None, ...]


def cache_layout(model: nn.Module, model_type: str) -> CacheLayout:
    """The windows of the caches mlx-lm makes for ``model``; raises ModelLoadError when one holds
    anything but keys and values (recurrent state, chunks, quantized keys)."""
    from mlx_lm.models import cache as mlx_cache

    windows: list[int | None] = []
    refused: Counter[str] = Counter()
    caches = mlx_cache.make_prompt_cache(model)
    for cache in caches:
        if type(cache) is mlx_cache.KVCache:
            windows.append(None)
        elif type(cache) is mlx_cache.RotatingKVCache and cache.keep == 0:
            windows.append(int(cache.max_size))
        else:
            refused[type(cache).__name__] += 1
    if refused:
        kinds = ", ".join(f"{count} {name}" for name, count in sorted(refused.items()))
        raise ModelLoadError(
            f"mlx-lm's {model_type} keeps state other than keys and values in {sum(refused.values())} "
            f"of its {len(caches)} layer caches ({kinds}: recurrent, chunked or quantized state); "
            "mlxr's engine batches key/value caches only, so the mlx-lm bridge cannot serve this "
            "model type (a native architecture would)"
        )
    return CacheLayout(tuple(windows))


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


def views(model: nn.Module, cache: list[Any] | None) -> list[CacheView | None] | None:
    """``cache`` (mlxr's, one per entry of ``model.cache_layout``) as mlx-lm's layers take it."""
    if cache is None:
        return None
    windows = model.cache_layout.windows
    return [
        None if layer is None else CacheView(layer, window)
        for layer, window in zip(cache, windows, strict=True)
    ]


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
            rows.append([BatchKVCache.from_cache(layer) for layer in cache])
            solo.append(model(mx.array([ids[-1:]]), cache=cache)[0, -1])
        mx.eval(solo, [layer.state for row in rows for layer in row])
    except Exception as exc:  # the dtype or device, say: nothing the bridge can help
        return f"fails to decode a prompt: {type(exc).__name__}: {exc}"
    try:
        for layer, other in zip(rows[0], rows[1], strict=True):
            layer.extend(other)
        tokens = mx.array([ids[-1:] for ids in PROBE_PROMPTS])
        batched = [model(tokens, cache=batch, mask=batch[0].mask())[:, -1] for batch in (rows[0], _noisy(rows[0]))]
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


def _noisy(batch: list[BatchKVCache]) -> list[BatchKVCache]:
    """Copies of ``batch``'s caches whose padding positions hold random values instead of zeros."""
    out = []
    for layer in batch:
        padding = mx.array(layer.left_padding)[:, None, None, None]
        hidden = mx.arange(layer.keys.shape[2])[None, None, :, None] < padding
        keys, values = (
            mx.where(hidden, 8.0 * mx.random.normal(x.shape, key=mx.random.key(0)).astype(x.dtype), x)
            for x in (layer.keys, layer.values)
        )
        out.append(BatchKVCache(keys, values, list(layer.left_padding), layer.length))
    return out
