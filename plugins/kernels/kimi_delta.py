"""The Kimi delta rule in a few matmuls per chunk: the ``mlx_fast`` backend of ``kimi_delta``.

The op (see ``mlxr_core.kernels``) is the gated delta rule of :mod:`.delta_rule` with a decay per
key channel: ``S = diag(exp(g_t)) S`` before each correction. One position (decode) is one step
of batched ops. Longer inputs go by chunks of :data:`CHUNK` positions in the same WY form as
``gated_delta``, with ``G_t`` ``[Dk]`` the cumulative log decay of each channel from the chunk's
start: the pairwise decays are per channel, ``D[t, s, d] = exp(G_t[d] - G_s[d])`` for ``s <= t``,
so the products of keys ``A[t, s] = beta_t sum_d k_t[d] k_s[d] D[t, s, d]`` (and of queries and
keys) are formed from the ``[C, C, Dk]`` decays instead of one matmul. They are formed directly
(every exponent a sum of ``g <= 0``, masked before the exp: nothing overflows, whatever the
gate), not by scaling keys by ``exp(-G)``, which overflows in float32 for decays past ~88 a chunk.
That costs ``C * Dk`` per position, so chunks are small (8) and go :data:`GROUP` elements of
decays at a time. With ``T = (I + A)^-1`` (:func:`.delta_rule.unit_lower_inverse`) and ``S0`` the
state before a chunk: ``U = T (beta V) - T (beta exp(G) * K) S0``; the outputs
``(exp(G) * Q) S0 + (Q K^T . D) U``; the next state ``exp(G_last) * S0 + (exp(G_last - G) * K)^T U``.
"""

from __future__ import annotations

import mlx.core as mx

from mlxr_plugins.kernels.delta_rule import unit_lower_inverse

#: Positions per chunk: the pairwise decays cost ``CHUNK * Dk`` per position. On the project's
#: 2-core CPU (OpenBLAS, float32, B=1, L=512, H=8, Dk=Dv=128, one run each after a warm-up):
#: chunks of 8 0.51 s, 16 0.92 s, 32 1.65 s; the reference 2.3 s. ``bench/kernels/kimi_delta.py``
#: measures against the reference in one run (bench/results/kimi_delta_cpu.txt: 2.0x at L=512).
CHUNK = 8
#: Elements of pairwise decays (``[B, H, chunks, C, C, Dk]``) formed at once: 64 MiB of float32.
GROUP = 1 << 24


def kimi_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One step for one position, else the chunked form; float32 inside, out in v's dtype."""
    B, L, H, Dk = k.shape
    if v.shape[2] != H or g.shape[2:] != (H, Dk):
        raise ValueError(f"v {v.shape} and g {g.shape} must have the {H} heads of k (and g its {Dk} channels)")
    S = mx.zeros((B, H, Dk, v.shape[-1]), dtype=mx.float32) if state is None else state.astype(mx.float32)
    out, S = (_step if L == 1 else _chunked)(q, k, v, g, beta, S)
    return out.astype(v.dtype), S


def _step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """One position: S ``[B, H, Dk, Dv]``; returns out ``[B, 1, H, Dv]`` (float32) and S."""
    B, _, H, Dk = k.shape
    Dv = S.shape[-1]
    k_row = k.astype(mx.float32).reshape(B, H, 1, Dk)
    S = S * mx.exp(g.astype(mx.float32)).reshape(B, H, Dk, 1)
    delta = beta.astype(mx.float32).reshape(B, H, 1, 1) * (v.astype(mx.float32).reshape(B, H, 1, Dv) - k_row @ S)
    S = S + k_row.swapaxes(-1, -2) * delta  # outer(k, delta)
    return (q.astype(mx.float32).reshape(B, H, 1, Dk) @ S).reshape(B, 1, H, Dv), S


def _chunked(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """Several positions by chunks (module docstring): S ``[B, H, Dk, Dv]``; returns out
    ``[B, L, H, Dv]`` (float32) and the final S."""
    B, L, H, Dk = k.shape
    Dv = S.shape[-1]
    # Chunks of CHUNK positions, or one of the next power of two for a short input (the inverse
    # halves blocks); the padding has k = v = beta = 0 and g = 0, so it leaves the state alone.
    C = CHUNK if L >= CHUNK else 1 << (L - 1).bit_length()
    n = -(-L // C)
    pad = n * C - L

    def chunks(x: mx.array) -> mx.array:
        """[B, L, H, *rest] -> float32 [B, H, n, C, *rest], zero-padded along L."""
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = mx.moveaxis(x, 1, 2)
        return x.reshape(B, H, n, C, *x.shape[3:])

    queries, keys, values, rate = chunks(q), chunks(k), chunks(v), chunks(beta)
    G = mx.cumsum(chunks(g), axis=-2)  # [B, H, n, C, Dk]: log decay from the chunk's start
    position = mx.arange(C)
    causal = (position[:, None] >= position[None, :])[..., None]  # [t, s, 1]: s <= t
    strictly_lower = position[:, None] > position[None, :]
    per_group = max(1, GROUP // max(1, B * H * C * C * Dk))
    outputs = []
    for first in range(0, n, per_group):
        part = slice(first, min(n, first + per_group))
        Q, K, V, beta_part, Gp = queries[:, :, part], keys[:, :, part], values[:, :, part], rate[:, :, part], G[:, :, part]
        # D[t, s, d] = exp(G_t - G_s) on and below the diagonal, 0 above (masked before the exp).
        D = mx.exp(mx.where(causal, Gp[..., :, None, :] - Gp[..., None, :, :], -mx.inf))
        decayed_pairs = D * K[..., None, :, :]  # [.., t, s, Dk]: k_s decayed to t
        A = mx.where(strictly_lower, beta_part[..., :, None] * (decayed_pairs * K[..., :, None, :]).sum(-1), 0.0)
        scores = (decayed_pairs * Q[..., :, None, :]).sum(-1)
        T = unit_lower_inverse(A)
        written = T @ (beta_part[..., None] * V)  # U for a zero initial state
        reads = T @ (beta_part[..., None] * mx.exp(Gp) * K)  # U = written - reads @ S0
        decayed_queries = mx.exp(Gp) * Q
        decayed_keys = mx.exp(Gp[..., -1:, :] - Gp) * K
        chunk_decay = mx.exp(Gp[..., -1, :])[..., None]  # [B, H, chunks, Dk, 1]
        for i in range(part.stop - part.start):
            U = written[:, :, i] - reads[:, :, i] @ S
            outputs.append(decayed_queries[:, :, i] @ S + scores[:, :, i] @ U)
            S = chunk_decay[:, :, i] * S + decayed_keys[:, :, i].swapaxes(-1, -2) @ U
    out = mx.stack(outputs, axis=2).reshape(B, H, n * C, Dv)[:, :, :L]
    return out.swapaxes(1, 2), S
