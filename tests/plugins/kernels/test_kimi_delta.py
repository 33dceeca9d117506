"""The ``kimi_delta`` op (Kimi delta attention's recurrence: a decay per key channel): the
reference against transformers' KDA (its recurrent and chunked torch forms), ``mlx_fast``'s
chunked form against the reference (decays strong enough that scaling keys by ``exp(-G)`` would
overflow float32), the conformance check's cases, and the op's binding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.kernels import OPS, bind_kernels
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.kernel_check import check_kernel_parity, kimi_delta_inputs
from mlxr_plugins.kernels import kimi_delta, mlx_fast, reference


def close(actual: mx.array, expected: mx.array, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    np.testing.assert_allclose(np.array(actual.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                               atol=atol, rtol=rtol)


def test_reference_matches_transformers_kda():
    """transformers normalizes and scales q/k itself (``use_qk_l2norm_in_kernel``); ours gets them
    normalized and scaled as the op's contract says."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    B, L, H, D = 1, 70, 2, 16
    rng = np.random.default_rng(0)
    raw_q, raw_k = rng.standard_normal((2, B, L, H, D)).astype(np.float32)
    v = rng.standard_normal((B, L, H, D)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (B, L, H, D)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (B, L, H)).astype(np.float32)
    state = rng.standard_normal((B, H, D, D)).astype(np.float32)

    def l2norm(x: np.ndarray) -> np.ndarray:  # transformers' (FLA's) l2norm, eps inside the root
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    ours, our_state = reference.kimi_delta(mx.array(l2norm(raw_q) * D**-0.5), mx.array(l2norm(raw_k)),
                                           mx.array(v), mx.array(g), mx.array(beta), mx.array(state))
    args = [torch.from_numpy(a) for a in (raw_q, raw_k, v, g, beta)]
    for rule in (hf.recurrent_kimi_delta_attention, hf.chunk_kimi_delta_attention):
        theirs, their_state = rule(*args, initial_state=torch.from_numpy(state), output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(np.array(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(our_state), their_state.numpy(), atol=1e-4, rtol=1e-4)


def test_reference_decays_each_key_channel_on_its_own():
    """A channel with decay 0 keeps its row of the state; one with a huge decay forgets it."""
    q, k, v, g, beta, state = kimi_delta_inputs(B=1, L=1, H=1, Dk=2, Dv=3)
    g = mx.array([[[[0.0, -1e4]]]])
    _, after = reference.kimi_delta(q, mx.zeros_like(k), v, g, beta, state)  # k = 0: no correction
    close(after[0, 0, 0], state[0, 0, 0])
    close(after[0, 0, 1], mx.zeros(3))


@pytest.mark.parametrize("L", [1, 3, 8, 9, 70])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay", [0.5, 40.0], ids=["mild", "strong"])
def test_mlx_fast_parity(L, with_state, decay):
    args = kimi_delta_inputs(B=2, L=L, H=2, Dk=32, Dv=16, with_state=with_state, seed=L, decay=decay)
    expected_out, expected_state = reference.kimi_delta(*args)
    out, state = mlx_fast.kimi_delta_kernel.op(*args)
    assert out.shape == expected_out.shape and state.shape == expected_state.shape
    assert np.isfinite(np.array(out)).all()
    close(out, expected_out)
    close(state, expected_state)


def test_mlx_fast_groups_chunks_under_its_budget(monkeypatch):
    """Pairwise decays formed a few chunks at a time give what they give all at once."""
    args = kimi_delta_inputs(B=1, L=40, H=2, Dk=16, Dv=8, seed=3)
    whole = kimi_delta.kimi_delta(*args)
    monkeypatch.setattr(kimi_delta, "GROUP", 2 * 2 * kimi_delta.CHUNK**2 * 16)  # two chunks a group
    for got, want in zip(kimi_delta.kimi_delta(*args), whole, strict=True):
        close(got, want, atol=1e-6, rtol=1e-6)


def test_heads_that_differ_are_refused():
    q, k, v, g, beta, _ = kimi_delta_inputs(H=2)
    for op in (reference.kimi_delta, mlx_fast.kimi_delta_kernel.op):
        with pytest.raises(ValueError, match="heads"):
            op(q, k, v[:, :, :1], g, beta)
        with pytest.raises(ValueError, match="channels"):
            op(q, k, v, g[..., :1], beta)


@pytest.mark.parametrize("backend", ["reference", "mlx_fast"])
def test_the_conformance_check_covers_kimi_delta(backend):
    report = check_kernel_parity(load_plugins().registries.kernels, "kimi_delta", backend,
                                 dtypes=("float32", "bfloat16"))
    assert report.ran and not report.skipped


def test_kimi_delta_is_an_op_bound_for_every_model():
    assert "kimi_delta" in OPS
    registries = load_plugins().registries
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes={})
    assert kernels.chosen["kimi_delta"] == "mlx_fast" and kernels.kimi_delta is kimi_delta.kimi_delta
    chosen = bind_kernels(registries.kernels, dtype="float32", shapes={}, choices={"kimi_delta": "reference"})
    assert chosen.kimi_delta is reference.kimi_delta
