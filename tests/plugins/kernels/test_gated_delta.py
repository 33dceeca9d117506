"""The ``gated_delta`` op (Gated DeltaNet's recurrence): the reference against the math and against
transformers' Qwen3-Next, ``mlx_fast``'s chunked form against the reference, the fused ``cuda_delta``
and ``metal`` kernels (on their own hardware only), and the op's place in selection and
``mlxr kernels``.

Inputs as a layer hands them over: q and k L2-normalized per head, q scaled by ``Dk**-0.5``,
``g <= 0``, ``beta`` in (0, 1), states ~N(0, 1). Tolerances (``|x - reference| <= atol + rtol *
|reference|``): float32 1e-5 + 1e-4 (summation order only), but 2e-3 + 2e-3 for the chunked form
on MLX's CUDA backend, whose float32 matmuls round like TF32 (2.5e-4 off after 70 positions on an
H100); for float16/bfloat16 activations those of ``mlxr_core.testing.kernel_check`` (float32
inside, one rounding of the output).
"""

from __future__ import annotations

import json

import attrs
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.cli.main import main
from mlxr_core.kernels import OPS, KernelContext, KernelSet, bind_kernels, current_platform
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.kernel_check import TOLERANCES, check_kernel_parity, gated_delta_inputs
from mlxr_plugins.kernels import cuda_delta, delta_rule, metal, mlx_fast, reference

DEVICE, PLATFORM = current_platform()
#: How close mlx_fast's chunked form (matmuls) comes to the reference here: see the docstring.
CHUNKED_TOL = {"atol": 2e-3, "rtol": 2e-3} if PLATFORM == "cuda" else {"atol": 1e-5, "rtol": 1e-4}
SHAPES = {"head_dim": 64, "n_heads": 4, "n_kv_heads": 2, "rope_dims": 64, "masks": ("causal",)}


inputs = gated_delta_inputs


def close(actual: mx.array, expected: mx.array, *, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    np.testing.assert_allclose(
        np.array(actual.astype(mx.float32)), np.array(expected.astype(mx.float32)), atol=atol, rtol=rtol
    )


def naive(q, k, v, g, beta, state):
    """Head by head and step by step in float64, value head ``h`` reading key head ``h // r``."""
    q, k, v, g, beta = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v, g, beta))
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    S = np.zeros((B, Hv, Dk, Dv)) if state is None else np.array(state, dtype=np.float64)
    out = np.zeros((B, L, Hv, Dv))
    for b in range(B):
        for h in range(Hv):
            for t in range(L):
                S[b, h] *= np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - S[b, h].T @ k[b, t, h // r])
                S[b, h] += np.outer(k[b, t, h // r], delta)
                out[b, t, h] = S[b, h].T @ q[b, t, h // r]
    return out, S


# --------------------------------------------------------------------------------------------
# the reference


@pytest.mark.parametrize("heads", [(2, 2), (1, 3), (2, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_reference_is_the_math(heads, with_state):
    args = inputs(B=2, L=6, Hk=heads[0], Hv=heads[1], Dk=8, Dv=4, with_state=with_state)
    out, state = reference.gated_delta(*args)
    expected_out, expected_state = naive(*args)
    assert out.shape == (2, 6, heads[1], 4) and state.shape == (2, heads[1], 8, 4)
    assert out.dtype == state.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), expected_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(state), expected_state, atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers_qwen3_next():
    """Transformers' recurrent and chunked torch versions normalize and scale q/k themselves
    (``use_qk_l2norm_in_kernel``); ours gets them normalized and scaled as its contract says.
    They get q/k already repeated per value head (``np.repeat`` is ``repeat_interleave``): older
    transformers releases take one key head per value head only."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    B, L, Hk, Hv, D = 1, 70, 2, 4, 16
    rng = np.random.default_rng(0)
    raw_q, raw_k = rng.standard_normal((2, B, L, Hk, D)).astype(np.float32)
    v = rng.standard_normal((B, L, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (B, L, Hv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (B, L, Hv)).astype(np.float32)
    state = rng.standard_normal((B, Hv, D, D)).astype(np.float32)

    def l2norm(x: np.ndarray) -> np.ndarray:  # transformers' l2norm, eps inside the root
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    ours, our_state = reference.gated_delta(
        mx.array(l2norm(raw_q) * D**-0.5), mx.array(l2norm(raw_k)), mx.array(v), mx.array(g),
        mx.array(beta), mx.array(state),
    )
    grouped = (np.repeat(raw_q, Hv // Hk, axis=2), np.repeat(raw_k, Hv // Hk, axis=2))
    args = [torch.from_numpy(a) for a in (*grouped, v, g, beta)]
    for rule in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        theirs, their_state = rule(*args, initial_state=torch.from_numpy(state),
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(np.array(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(our_state), their_state.numpy(), atol=1e-4, rtol=1e-4)


def test_reference_rejects_heads_that_do_not_group():
    q, k, v, g, beta, _ = inputs(Hk=2, Hv=3)
    with pytest.raises(ValueError, match="multiple"):
        reference.gated_delta(q, k, v, g, beta)
    with pytest.raises(ValueError, match="multiple"):
        mlx_fast.gated_delta_kernel.op(q, k, v, g, beta)


# --------------------------------------------------------------------------------------------
# mlx_fast: one step for decode, chunks of matmuls for prompts


@pytest.mark.parametrize("L", [1, 5, 64, 100, 200])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["Hv=Hk", "Hv=2Hk"])
def test_mlx_fast_parity(L, with_state, heads):
    args = inputs(B=2, L=L, Hk=heads[0], Hv=heads[1], Dk=64, Dv=32, with_state=with_state, seed=L)
    expected_out, expected_state = reference.gated_delta(*args)
    out, state = mlx_fast.gated_delta_kernel.op(*args)
    assert out.shape == expected_out.shape and state.shape == expected_state.shape
    assert out.dtype == mx.float32 and state.dtype == mx.float32
    close(out, expected_out, **CHUNKED_TOL)
    close(state, expected_state, **CHUNKED_TOL)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_mlx_fast_parity_in_half_precision(dtype):
    args = inputs(L=70, Hk=2, Hv=4, dtype=dtype)
    expected_out, expected_state = reference.gated_delta(*args)
    out, state = mlx_fast.gated_delta_kernel.op(*args)
    assert out.dtype == dtype and state.dtype == mx.float32
    atol, rtol = TOLERANCES["gated_delta"][str(dtype).rpartition(".")[2]]
    close(out, expected_out, atol=atol, rtol=rtol)
    close(state, expected_state, **CHUNKED_TOL)


def test_a_prompt_in_pieces_is_the_prompt_at_once():
    """The state carries the recurrence: 150 positions in one call or as 70 + 1 + 79."""
    q, k, v, g, beta, state = inputs(L=150, Hk=1, Hv=2)
    whole, whole_state = delta_rule.gated_delta(q, k, v, g, beta, state)
    pieces, carried = [], state
    for start, stop in ((0, 70), (70, 71), (71, 150)):
        out, carried = delta_rule.gated_delta(
            q[:, start:stop], k[:, start:stop], v[:, start:stop], g[:, start:stop],
            beta[:, start:stop], carried,
        )
        pieces.append(out)
    close(mx.concatenate(pieces, axis=1), whole, **CHUNKED_TOL)
    close(carried, whole_state, **CHUNKED_TOL)


def test_strong_decay_and_nearly_equal_keys_stay_finite_and_exact():
    """Decays that underflow within a chunk and keys nearly alike (beta near 1): the triangular
    system is at its worst, the exponentials at their smallest."""
    q, _, v, _, _, state = inputs(L=130, Hk=1, Hv=2, Dk=32, Dv=16)
    base = mx.random.normal((1, 1, 1, 32), key=mx.random.key(1))
    k = base + 0.05 * mx.random.normal((1, 130, 1, 32), key=mx.random.key(2))
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
    g = -30.0 * mx.random.uniform(shape=(1, 130, 2), key=mx.random.key(3))
    beta = mx.full((1, 130, 2), 0.999)
    out, last = mlx_fast.gated_delta_kernel.op(q, k, v, g, beta, state)
    expected_out, expected_state = reference.gated_delta(q, k, v, g, beta, state)
    assert bool(mx.isfinite(out).all())
    close(out, expected_out, **CHUNKED_TOL)
    close(last, expected_state, **CHUNKED_TOL)


@pytest.mark.parametrize("C", [1, 2, 8, 64])
def test_unit_lower_inverse(C):
    """Checked in float64 (an mx matmul would round like TF32 on CUDA); entries of A about the
    size the chunked form meets (beta times cosines of normalized keys times decays)."""
    A = mx.tril(mx.random.normal((3, C, C), key=mx.random.key(C)), k=-1) * 0.1
    product = (np.eye(C) + np.array(A, dtype=np.float64)) @ np.array(delta_rule.unit_lower_inverse(A))
    np.testing.assert_allclose(product, np.broadcast_to(np.eye(C), (3, C, C)), atol=CHUNKED_TOL["atol"])


# --------------------------------------------------------------------------------------------
# cuda_delta and metal: what they take, what they hand on, and (on their hardware) parity


def ctx(platform: str, dtype: str = "bfloat16", **shapes) -> KernelContext:
    device = "cpu" if platform == "cpu" else "gpu"
    return KernelContext(op="gated_delta", device=device, platform=platform, dtype=dtype, shapes=shapes)


QWEN = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}
CUDA_REASON = " ".join(cuda_delta.gated_delta_kernel.supports(ctx(PLATFORM, **QWEN)))
METAL_REASON = " ".join(metal.gated_delta_kernel.supports(ctx(PLATFORM, **QWEN)))


@pytest.mark.parametrize("backend, platform, needs", [
    (cuda_delta.gated_delta_kernel, "cuda", "needs MLX's CUDA backend"),
    (metal.gated_delta_kernel, "metal", "needs Apple Silicon Metal"),
])
def test_fused_backends_say_which_machines_and_head_dims_they_take(backend, platform, needs):
    assert backend.supports(ctx(platform, **QWEN)) == []
    assert backend.supports(ctx(platform)) == []  # no such layers given: nothing to refuse
    for dims in ({"linear_key_head_dim": 64, "linear_value_head_dim": 256},
                 {"linear_key_head_dim": 256, "linear_value_head_dim": 64}):
        assert backend.supports(ctx(platform, **dims)) == []
    assert "key head dim 96" in " ".join(backend.supports(
        ctx(platform, linear_key_head_dim=96, linear_value_head_dim=128)))
    assert "value head dim 48" in " ".join(backend.supports(
        ctx(platform, linear_key_head_dim=128, linear_value_head_dim=48)))
    assert "= 1024)" in " ".join(backend.supports(  # 128 columns x 8 threads: too many registers
        ctx(platform, linear_key_head_dim=256, linear_value_head_dim=128)))
    reasons = backend.supports(ctx("cpu", "float64", **QWEN))
    assert reasons[0].startswith(needs) and "float64" in reasons[1]
    assert "UNTESTED" in metal.gated_delta_kernel.summary


@pytest.mark.parametrize("module", [cuda_delta, metal], ids=["cuda", "metal"])
def test_fused_backends_hand_other_shapes_to_the_chunked_form(module):
    """These calls never reach a kernel, so they run on any machine."""
    for args in (inputs(L=3, Dk=32, Dv=32), inputs(L=3, Dk=64, Dv=48)):
        got, expected = module.gated_delta(*args), delta_rule.gated_delta(*args)
        close(got[0], expected[0], atol=0, rtol=0)
        close(got[1], expected[1], atol=0, rtol=0)
    q, k, v, *_ = inputs(Dk=64, Dv=64)
    assert "dtypes differ" in cuda_delta.call_reason(q, k, v.astype(mx.float16))
    assert cuda_delta.call_reason(q, k, v) is None


FUSED_CASES = [
    # (B, L, Hk, Hv, Dk, Dv, with_state)
    (2, 1, 2, 4, 128, 128, True),  # decode, Qwen3-Next's heads of 128
    (1, 1, 4, 4, 64, 64, False),
    (1, 7, 2, 4, 128, 128, False),
    (2, 100, 1, 2, 64, 256, True),
    (1, 33, 2, 2, 256, 64, True),
]


def fused_parity(module, dtype: mx.Dtype, case: tuple) -> None:
    B, L, Hk, Hv, Dk, Dv, with_state = case
    args = inputs(B, L, Hk, Hv, Dk, Dv, with_state=with_state, dtype=dtype, seed=L)
    assert cuda_delta.call_reason(*args[:3]) is None  # the metal twin takes the same shapes
    out, state = module.gated_delta(*args)
    expected_out, expected_state = reference.gated_delta(*args)
    assert out.dtype == dtype and state.dtype == mx.float32
    atol, rtol = TOLERANCES["gated_delta"][str(dtype).rpartition(".")[2]]
    close(out, expected_out, atol=atol, rtol=rtol)
    close(state, expected_state, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(bool(CUDA_REASON), reason=CUDA_REASON or "runs")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_cuda_gated_delta_parity(dtype, case):
    fused_parity(cuda_delta, dtype, case)


@pytest.mark.skipif(bool(METAL_REASON), reason=METAL_REASON or "runs")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_metal_gated_delta_parity(dtype, case):
    fused_parity(metal, dtype, case)


@pytest.mark.parametrize("backend", ["reference", "mlx_fast", "cuda_delta", "metal"])
def test_the_conformance_check_covers_gated_delta(backend):
    """``check_kernel_parity`` has cases for the op: what runs here passes, the rest is reported."""
    report = check_kernel_parity(load_plugins().registries.kernels, "gated_delta", backend,
                                 dtypes=("float32", "bfloat16"))
    runs_here = {"cuda_delta": not CUDA_REASON, "metal": not METAL_REASON}.get(backend, True)
    assert bool(report.ran) == runs_here
    if backend in ("reference", "mlx_fast"):
        assert not report.skipped
    else:  # refused off their platform, and for key head dim 32 everywhere
        assert any("key head dim 32" in " ".join(r) or "needs" in " ".join(r)
                   for r in report.skipped.values())


# --------------------------------------------------------------------------------------------
# the op among the others


def test_gated_delta_is_an_op_bound_for_every_model():
    assert "gated_delta" in OPS and "gated_delta" in attrs.fields_dict(KernelSet)
    registries = load_plugins().registries
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes={**SHAPES, **QWEN})
    assert kernels.chosen["gated_delta"] == {"cpu": "mlx_fast", "cuda": "cuda_delta"}.get(
        PLATFORM, "mlx_fast")
    if PLATFORM == "cpu":
        assert kernels.gated_delta is delta_rule.gated_delta
    chosen = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES,
                          choices={"gated_delta": "reference"})
    assert chosen.gated_delta is reference.gated_delta


def test_mlxr_kernels_lists_gated_delta(capsys):
    assert main(["kernels", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["backends"] if r["op"] == "gated_delta"]
    assert [r["backend"] for r in rows] == ["cuda_delta", "mlx_fast", "metal", "reference"]
    assert sum(r["auto"] for r in rows) == 1
    by_name = {r["backend"]: r for r in rows}
    assert by_name["mlx_fast"]["supported"] and by_name["reference"]["supported"]
    if PLATFORM != "cuda":
        assert by_name["cuda_delta"]["reasons"][0].startswith("needs MLX's CUDA backend")
    assert "UNTESTED" in by_name["metal"]["summary"]
