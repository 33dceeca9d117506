"""Mamba-2's SSD recurrence by chunks in its quadratic form: the ``mlx_fast`` backend of ``ssd``.

The op (see ``mlxr_core.kernels``): per head ``S = exp(g_t) S + beta_t v_t k_t^T; out_t = S q_t``.
One position is one step of batched ops. A longer input goes by chunks of :data:`CHUNK`
positions: with ``G_t`` the cumulative log decay from the chunk's start, the outputs are
``exp(G_t) S0 q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) beta_s v_s`` (the pairwise decays
masked before the exp, so nothing overflows) and the next state
``exp(G_T) S0 + sum_s exp(G_T - G_s) beta_s v_s k_s^T``.
"""

from __future__ import annotations

import math

import mlx.core as mx

#: Positions per chunk of the quadratic form: ``[B, H, CHUNK, CHUNK]`` decays at once.
CHUNK = 64


def ssd(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """One step for one position, else by chunks (module docstring). ``S = exp(g) S + beta v k^T;
    out = S q`` per head: ``q`` (C) and ``k`` (B) ``[B, L, H, N]``,
    ``v`` (x) ``[B, L, H, P]``, ``g`` (log decay) and ``beta`` (dt) ``[B, L, H]``, ``state``
    ``[B, H, P, N]`` float32 (zeros when None). Returns ``out`` ``[B, L, H, P]`` (v's dtype) and
    the final state; float32 inside."""
    Bsz, L, H, N = k.shape
    dtype = v.dtype
    P = v.shape[-1]
    S = mx.zeros((Bsz, H, P, N), dtype=mx.float32) if state is None else state.astype(mx.float32)
    q, k, v = (a.astype(mx.float32).transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, H, L, *]
    g, beta = g.astype(mx.float32).transpose(0, 2, 1), beta.astype(mx.float32).transpose(0, 2, 1)
    outs = []
    for start in range(0, L, CHUNK):
        end = min(start + CHUNK, L)
        out, S = _chunk(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], g[:, :, start:end],
                        beta[:, :, start:end], S)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.transpose(0, 2, 1, 3).astype(dtype), S


def _chunk(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """One chunk ``[B, H, T, *]`` from state ``S``: ``G_t`` the cumulative log decay, ``out_t =
    exp(G_t) S q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) beta_s v_s``; the next state
    ``exp(G_T) S + sum_s exp(G_T - G_s) beta_s v_s k_s^T``."""
    T = g.shape[-1]
    G = mx.cumsum(g, axis=-1)  # [B, H, T]
    if T == 1:
        S = mx.exp(g)[..., None] * S + (beta[..., None] * v).swapaxes(-1, -2) @ k
        return q @ S.swapaxes(-1, -2), S
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    # masked before the exp: above the diagonal the difference is positive and could overflow
    decay = mx.exp(mx.where(causal, G[..., :, None] - G[..., None, :], -math.inf))  # [B, H, T, T]
    scores = (q @ k.swapaxes(-1, -2)) * decay * beta[..., None, :]
    out = scores @ v + mx.exp(G)[..., None] * (q @ S.swapaxes(-1, -2))
    weights = (mx.exp(G[..., -1:] - G) * beta)[..., None]  # [B, H, T, 1]
    S = mx.exp(G[..., -1])[..., None, None] * S + (weights * v).swapaxes(-1, -2) @ k
    return out, S
