"""``Attention.weights``: the softmax a layer's attention applies, against torch's, with grouped
key heads and the bottom-right causal mask."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.model.layers import Attention
from mlxr_plugins.kernels.reference import attention as reference_attention

torch = pytest.importorskip("torch", reason="the reference is torch's softmax")


@pytest.mark.parametrize(("mask", "L", "S"), [(None, 3, 11), ("causal", 4, 9), ("causal", 5, 5)])
@pytest.mark.parametrize("heads", [None, [3, 0]])
def test_weights_equal_torch_softmax(mask: str | None, L: int, S: int, heads: list[int] | None) -> None:
    kernels: Any = SimpleNamespace(attention=reference_attention)
    layer = Attention(32, 4, 2, 8, kernels=kernels, rotary=lambda x, offset: x)
    rng = np.random.default_rng(L * S)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 4, L, 8), (1, 2, S, 8), (1, 2, S, 8)))
    got = layer.weights(mx.array(q), mx.array(k), mask, heads=heads)
    scores = torch.tensor(q) @ torch.tensor(k).repeat_interleave(2, dim=1).transpose(-1, -2) * 8**-0.5
    if mask == "causal":  # query i sees keys 0 .. S - L + i
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not(), float("-inf"))
    want = torch.softmax(scores, dim=-1).numpy()
    if heads is not None:  # only those query heads, in that order
        np.testing.assert_allclose(np.array(got), want[:, heads], atol=1e-6)
        return
    np.testing.assert_allclose(np.array(got), want, atol=1e-6)
    # The weights are the ones the kernel applies to the values.
    out = reference_attention(mx.array(q), mx.array(k), mx.array(v), scale=layer.scale, mask=mask)
    values = np.repeat(v, 2, axis=1)
    np.testing.assert_allclose(np.array(out), np.array(got) @ values, atol=1e-5)


def test_other_masks_are_refused() -> None:
    kernels: Any = SimpleNamespace(attention=reference_attention)
    layer = Attention(16, 2, 2, 8, kernels=kernels, rotary=lambda x, offset: x)
    with pytest.raises(ValueError, match="causal"):
        layer.weights(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 3, 8)), "sliding")
