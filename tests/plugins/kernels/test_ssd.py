"""The ``ssd`` op (Mamba-2's selective state space recurrence): the reference backend against
transformers 5.25's torch forms of it (its chunked scan and its one-token state update, an
independent implementation), and the ``mlx_fast`` chunked backend against the reference through
the parity cases (decode onto a state, a short prompt, a prompt across a chunk boundary)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.testing.kernel_check import check_kernel_parity, ssd_inputs
from mlxr_plugins.kernels import reference, ssd


def test_the_reference_is_transformers_mamba2_scan():
    torch = pytest.importorskip("torch", reason="the comparison needs torch (CPU)")
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    B, L, H, P, N, G = 2, 21, 4, 8, 16, 2
    rng = np.random.default_rng(0)
    x, Bm, Cm = rng.normal(size=(B, L, H, P)), rng.normal(size=(B, L, G, N)), rng.normal(size=(B, L, G, N))
    dt_raw, A = rng.normal(size=(B, L, H)) - 1.0, -rng.uniform(0.5, 3.0, H)
    state = rng.normal(size=(B, H, P, N))
    t = {name: torch.tensor(value, dtype=torch.float32)
         for name, value in dict(x=x, B=Bm, C=Cm, dt=dt_raw, A=A, state=state).items()}  # fmt: skip
    zeros = torch.zeros(H)
    out_hf, state_hf = hf.mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=8, D=zeros,
                                            dt_bias=zeros, dt_softplus=True, initial_states=t["state"],
                                            return_final_states=True)

    dt = np.log1p(np.exp(dt_raw))  # softplus
    repeat = lambda a: mx.array(np.repeat(a, H // G, axis=2), dtype=mx.float32)  # noqa: E731
    args = (repeat(Cm), repeat(Bm), mx.array(x, dtype=mx.float32), mx.array(dt * A, dtype=mx.float32),
            mx.array(dt, dtype=mx.float32), mx.array(state, dtype=mx.float32))
    out, final = reference.ssd(*args)
    np.testing.assert_allclose(np.array(out), out_hf.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(final), state_hf.numpy(), atol=1e-4, rtol=1e-4)

    # one position: transformers' state update (the decode path)
    step_state = t["state"].clone()
    step_out = hf.mamba2_selective_state_update(
        step_state, t["x"][:, 0], t["dt"][:, 0, :, None].expand(-1, -1, P), t["A"][:, None, None].expand(-1, P, N),
        t["B"][:, 0], t["C"][:, 0], dt_bias=torch.zeros(H, P), dt_softplus=True)
    one, after = reference.ssd(*(a[:, :1] for a in args[:5]), args[5])
    np.testing.assert_allclose(np.array(one[:, 0]), step_out.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(after), step_state.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "mlx_fast"])
def test_the_conformance_check_covers_ssd(backend):
    from mlxr_core.plugins import load_plugins

    report = check_kernel_parity(load_plugins().registries.kernels, "ssd", backend, dtypes=("float32", "bfloat16"))
    assert report.ran and not report.skipped


def test_chunks_carry_the_state_across_boundaries(monkeypatch):
    args = ssd_inputs(B=1, L=40, H=2, P=8, N=16, seed=3)
    whole = reference.ssd(*args)
    monkeypatch.setattr(ssd, "CHUNK", 16)  # three chunks, the last one short
    for got, want in zip(ssd.ssd(*args), whole, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
