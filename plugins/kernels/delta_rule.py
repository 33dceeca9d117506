"""The gated delta rule in a few matmuls per chunk: the ``mlx_fast`` backend of ``gated_delta``.

The op (see ``mlxr_core.kernels``) is a recurrence over positions: per value head a ``Dk x Dv``
state ``S`` decays by ``exp(g_t)``, is corrected towards ``v_t`` along ``k_t`` (the delta rule) and
read with ``q_t``. Run step by step, as the reference does, a prompt of ``L`` positions is ``L``
dependent rounds of small ops. Here:

- one position (decode) is one step, a handful of batched ops over every head, no Python loop;
- longer inputs go by chunks of :data:`CHUNK` positions in the WY / UT-transform form of
  Gated DeltaNet (Yang et al., 2024). Within a chunk, with ``G_t`` the cumulative log decay from the
  chunk's start, ``D[t, s] = exp(G_t - G_s)`` for ``s <= t`` (0 above) and ``S0`` the state before
  the chunk, the written values ``u_t = beta_t (v_t - (decayed state)^T k_t)`` solve the unit lower
  triangular system ``(I + A) U = beta V - diag(beta exp(G)) K S0`` with
  ``A = diag(beta) (K K^T * D)`` strictly below the diagonal. So, with ``T = (I + A)^-1``:
  ``U = T (beta V) - T (beta exp(G) K) S0``; the outputs are ``exp(G) Q S0 + (Q K^T * D) U`` and
  the next state ``exp(G_last) S0 + (exp(G_last - G) K)^T U``. Everything but the state's hand-off
  from chunk to chunk (4 matmuls each) is computed for all chunks at once, and ``T`` comes from
  :func:`unit_lower_inverse` (block doubling in matmuls: ``mx.linalg`` solvers run on the CPU only).
  Every exponent is of a sum of ``g <= 0``, so nothing overflows; a decay that underflows is 0.

Measured on the project's 2-core x86-64 CPU (MLX 0.32.4 with the OpenBLAS mlxr preloads, float32,
B=1, Hk=4, Hv=8, Dk=Dv=128; ``mx.eval`` of out and state per call, median of 20 (decode) or 5
(prompt) after a warm-up; the ranges span runs)::

    python bench/kernels/gated_delta.py

    B=1 L=512 (from zeros):    reference 84-90 ms, mlx_fast 12.5 ms
    B=1 L=1 (onto a state):    reference 0.16-0.18 ms, mlx_fast 0.14 ms

Chunks of 32 were as fast there, 128 slower (18 ms). The chunked form lives on matmuls: with MLX's
bundled reference BLAS (``MLXR_BLAS=off``) the prompt took 93 ms, slower than the reference's 81.
On MLX's CUDA backend float32 matmuls round like TF32, so this form drifts from the reference by
~5e-4 of the state's scale over 512 positions there (H100); ``cuda_delta`` stays float32
throughout and is faster on CUDA (its docstring has the figures).
"""

from __future__ import annotations

import mlx.core as mx

#: Positions per chunk: larger chunks mean fewer sequential hand-offs but O(CHUNK^2) work per
#: position in the intra-chunk products; 64 is the size of the reference implementations.
CHUNK = 64


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One step for one position, else the chunked form; float32 inside, out in v's dtype."""
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    S = mx.zeros((B, Hv, Dk, Dv), dtype=mx.float32) if state is None else state.astype(mx.float32)
    # Value head h = j * r + i is served by key head j: heads are grouped as [Hk, r] and q/k
    # broadcast over r, never repeated.
    S = S.reshape(B, Hk, Hv // Hk, Dk, Dv)
    if L == 1:
        out, S = _step(q, k, v, g, beta, S)
    else:
        out, S = _chunked(q, k, v, g, beta, S)
    return out.astype(v.dtype), S.reshape(B, Hv, Dk, Dv)


def _step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """One position: S ``[B, Hk, r, Dk, Dv]``; returns out ``[B, 1, Hv, Dv]`` (float32) and S."""
    B, _, Hk, Dk = k.shape
    r, Dv = S.shape[2], S.shape[-1]
    k_row = k.astype(mx.float32).reshape(B, Hk, 1, 1, Dk)
    q_row = q.astype(mx.float32).reshape(B, Hk, 1, 1, Dk)
    S = S * mx.exp(g.astype(mx.float32)).reshape(B, Hk, r, 1, 1)
    remembered = k_row @ S  # S^T k as a row: [B, Hk, r, 1, Dv]
    values = v.astype(mx.float32).reshape(B, Hk, r, 1, Dv)
    delta = beta.astype(mx.float32).reshape(B, Hk, r, 1, 1) * (values - remembered)
    S = S + k_row.swapaxes(-1, -2) * delta  # outer(k, delta)
    return (q_row @ S).reshape(B, 1, Hk * r, Dv), S


def _chunked(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """Several positions by chunks (module docstring): S ``[B, Hk, r, Dk, Dv]``; returns out
    ``[B, L, Hv, Dv]`` (float32) and the final S."""
    B, L, Hk, _ = k.shape
    r, Dv = S.shape[2], S.shape[-1]
    # Chunks of CHUNK positions, or one of the next power of two for a short input (the inverse
    # halves blocks); the padding has k = v = beta = 0 and g = 0, so it leaves the state alone.
    C = CHUNK if L >= CHUNK else 1 << (L - 1).bit_length()
    n = -(-L // C)
    pad = n * C - L

    def chunks(x: mx.array, heads: tuple[int, int]) -> mx.array:
        """[B, L, H, *rest] -> float32 [B, *heads, n, C, *rest], zero-padded along L."""
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = mx.moveaxis(x, 1, 2)  # [B, H, L + pad, *rest]
        return x.reshape(B, *heads, n, C, *x.shape[3:])

    queries, keys = chunks(q, (Hk, 1)), chunks(k, (Hk, 1))  # [B, Hk, 1, n, C, Dk]
    values = chunks(v, (Hk, r))  # [B, Hk, r, n, C, Dv]
    log_decay, rate = chunks(g, (Hk, r)), chunks(beta, (Hk, r))  # [B, Hk, r, n, C]

    G = mx.cumsum(log_decay, axis=-1)  # log decay from the chunk's start, position included
    position = mx.arange(C)
    causal = position[:, None] >= position[None, :]  # [t, s]: s <= t
    # D[t, s] = exp(G_t - G_s) on and below the diagonal, 0 above (masked before the exp: above
    # the diagonal the exponent is positive and could overflow).
    D = mx.exp(mx.where(causal, G[..., :, None] - G[..., None, :], -mx.inf))
    strictly_lower = position[:, None] > position[None, :]
    A = mx.where(strictly_lower, rate[..., :, None] * (keys @ keys.swapaxes(-1, -2)) * D, 0.0)
    T = unit_lower_inverse(A)  # [B, Hk, r, n, C, C]
    written = T @ (rate[..., None] * values)  # U for a zero initial state
    reads = T @ ((rate * mx.exp(G))[..., None] * keys)  # U = written - reads @ S0
    scores = (queries @ keys.swapaxes(-1, -2)) * D
    decayed_queries = mx.exp(G)[..., None] * queries
    decayed_keys = mx.exp(G[..., -1:] - G)[..., None] * keys
    chunk_decay = mx.exp(G[..., -1])[..., None, None]  # [B, Hk, r, n, 1, 1]

    outputs = []
    for i in range(n):
        U = written[..., i, :, :] - reads[..., i, :, :] @ S
        outputs.append(decayed_queries[..., i, :, :] @ S + scores[..., i, :, :] @ U)
        S = chunk_decay[..., i, :, :] * S + decayed_keys[..., i, :, :].swapaxes(-1, -2) @ U
    out = mx.stack(outputs, axis=3).reshape(B, Hk * r, n * C, Dv)[:, :, :L]
    return out.swapaxes(1, 2), S


def unit_lower_inverse(A: mx.array) -> mx.array:
    """``(I + A)^-1`` for ``A`` ``[..., C, C]`` strictly lower triangular, ``C`` a power of two.

    Block doubling: from the inverses of the diagonal blocks of size ``b`` (1 to start), those of
    size ``2b`` are ``[[T11, 0], [-T22 A21 T11, T22]]`` (block forward substitution), for all
    blocks at once: ``log2 C`` rounds of two batched matmuls instead of ``C`` sequential rows.
    """
    C = A.shape[-1]
    lead = A.shape[:-2]
    inverse = mx.ones((*lead, C, 1, 1), dtype=A.dtype)  # the diagonal 1x1 blocks
    size = 1
    while size < C:
        pairs = C // (2 * size)
        # The diagonal blocks of size 2 * size, [..., pairs, 2 * size, 2 * size]; A21 is the
        # lower left quarter of each.
        blocks = A.reshape(*lead, pairs, 2 * size, pairs, 2 * size)
        blocks = mx.moveaxis(mx.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        below = blocks[..., size:, :size]
        halves = inverse.reshape(*lead, pairs, 2, size, size)
        upper, lower = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -(lower @ below @ upper)
        inverse = mx.concatenate(
            [
                mx.concatenate([upper, mx.zeros_like(upper)], axis=-1),
                mx.concatenate([corner, lower], axis=-1),
            ],
            axis=-2,
        )
        size *= 2
    return inverse.reshape(*lead, C, C)

