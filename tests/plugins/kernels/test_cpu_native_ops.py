"""The native CPU backend's norms, RoPE, attention and gated activation (``ops.cpp``) against the reference backend,
their fallbacks and refusals (the served model through them: test_cpu_native.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_plugins.kernels import cpu_native, mlx_fast, reference


def assert_close(got: mx.array, want: mx.array, atol: float = 1e-5) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 5, 64), (3, 40)])
def test_rms_norms_match_the_reference(module, shape):
    mx.random.seed(sum(shape))
    x, residual = mx.random.normal(shape) * 3, mx.random.normal(shape)
    weight = mx.random.normal(shape[-1:])
    assert_close(cpu_native.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    h, normed = cpu_native.add_rms_norm(x, residual, weight, 1e-5)
    want_h, want_normed = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(h, want_h)
    assert_close(normed, want_normed)
    strided = x.swapaxes(0, 1) if x.ndim == 3 else x[:, ::2]  # a view: read through its strides
    assert_close(cpu_native.rms_norm(strided, weight[: strided.shape[-1]], 1e-6),
                 reference.rms_norm(strided, weight[: strided.shape[-1]], 1e-6))


OFFSETS = {
    "int": 37,
    "array": mx.array(900, dtype=mx.int32),
    "int64": mx.array(5),
    "per_row": mx.array([3, 700], dtype=mx.int32),
}


@pytest.mark.parametrize("offset", OFFSETS, ids=str)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,T", [(64, 1), (48, 7)])
def test_rope_matches_the_reference(module, offset, traditional, dims, T):
    mx.random.seed(dims + T)
    x = mx.random.normal((2, 3, T, 64))
    kwargs = {"traditional": traditional, "scale": 0.5, "offset": OFFSETS[offset]}
    got = cpu_native.rope(x, dims, base=10000.0, **kwargs)
    assert_close(got, reference.rope(x, dims, base=10000.0, **kwargs), atol=1e-4)
    freqs = mx.random.uniform(1.0, 1000.0, (dims // 2,))
    got = cpu_native.rope(x, dims, base=None, freqs=freqs, **kwargs)
    assert_close(got, reference.rope(x, dims, base=None, freqs=freqs, **kwargs), atol=1e-4)


def test_rope_reads_a_split_of_fused_heads(module):
    """A decode step rotates queries and keys as one split of the fused projection's heads."""
    heads = mx.random.normal((2, 1, 15, 64)).transpose(0, 2, 1, 3)
    rotate, _ = mx.split(heads, [12], axis=1)
    kwargs = {"traditional": False, "base": 1e4, "scale": 1.0, "offset": 5}
    assert_close(cpu_native.rope(rotate, 64, **kwargs), reference.rope(rotate, 64, **kwargs), atol=1e-4)


def masks(B: int, H: int, L: int, S: int) -> dict[str, str | mx.array | None]:
    mx.random.seed(B * H + L + S)
    return {
        "none": None,
        "causal": "causal",
        "padding": mx.random.uniform(shape=(B, 1, 1, S)) > 0.3,
        "additive": mx.random.normal((L, S)),
        "per_head": mx.random.uniform(shape=(B, H, L, S)) > 0.5,
    }


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "additive", "per_head"])
# A prompt's shape (2, 8, 2, 64, 96) has enough work to split its groups over the kernels' threads;
# a decode step over a long cache with one key head (1, 4, 1, 1, 1030), its positions.
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S", [(1, 9, 3, 1, 160), (2, 4, 4, 5, 33), (1, 8, 2, 3, 3), (2, 8, 2, 64, 96), (1, 4, 1, 1, 1030)]
)
# Head sizes: values narrower than a vector block, Gemma 3's 256, and a block with a tail.
@pytest.mark.parametrize("D,Dv", [(64, 32), (256, 256), (48, 80)])
def test_attention_matches_the_reference_over_a_cache_view(module, mask, B, Hq, Hkv, L, S, D, Dv):
    mx.random.seed(B + Hq + L + S)
    # Keys and values as a cache hands them over: the first S positions of larger buffers.
    keys, values = mx.random.normal((B, Hkv, S + 40, D)), mx.random.normal((B, Hkv, S + 40, Dv))
    k, v = keys[:, :, :S], values[:, :, :S]
    q = mx.random.normal((B, Hq, L, D))
    m = masks(B, Hq, L, S)[mask]
    if isinstance(m, mx.array) and m.dtype == mx.bool_:
        m[..., -1] = True  # every query sees a key (else the softmax has nothing to weigh)
    got = cpu_native.attention(q, k, v, scale=0.125, mask=m)
    assert_close(got, reference.attention(q, k, v, scale=0.125, mask=m))


def test_attention_of_a_query_that_sees_no_key_is_zero(module):
    q, k, v = mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 4, 16)), mx.random.normal((1, 2, 4, 16))
    mask = mx.array([[[[True, True, False, False]], [[False] * 4]]])
    got = np.array(cpu_native.attention(q, k, v, scale=0.25, mask=mask))
    want = np.array(reference.attention(q[:, :1], k[:, :1], v[:, :1], scale=0.25, mask=mask[:, :1]))
    np.testing.assert_allclose(got[:, :1], want, rtol=1e-5, atol=1e-6)
    assert not got[:, 1].any()


#: dtype -> (atol, rtol) against the float32 reference: one rounding of the output, or two.
GATED_TOLERANCES = {mx.float32: (1e-6, 2e-6), mx.float16: (2.0**-12, 2.0**-10), mx.bfloat16: (2.0**-9, 2.0**-7)}


def gated_operands(shape, layout, dtype, seed):
    """gate (~N(0, 9)) and up in one of the layouts an MLP hands over."""
    keys = mx.random.split(mx.random.key(seed), 2)
    if layout == "halves":  # a fused gate_up projection's output, split: two strided views
        both = mx.random.normal((*shape[:-1], 2 * shape[-1]), key=keys[0]) * 3
        return mx.split(both.astype(dtype), 2, axis=-1)
    gate, up = mx.random.normal(shape, key=keys[0]) * 3, mx.random.normal(shape, key=keys[1])
    if layout == "transposed":  # neither last axis contiguous
        gate, up = mx.random.normal(shape[::-1], key=keys[0]).T * 3, mx.random.normal(shape[::-1], key=keys[1]).T
    return gate.astype(dtype), up.astype(dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize(("shape", "layout"), [
    ((1, 1, 576), "dense"),  # a decode row
    ((1, 1, 1536), "halves"),
    ((3, 7, 13), "dense"),  # an odd width: less than one SIMD vector
    ((2, 5, 1001), "halves"),
    ((6, 35), "transposed"),
    ((128, 1536), "halves"),  # a prompt's: split over the kernels' threads
])
def test_gated_activations_match_the_reference(module, activation, dtype, shape, layout):
    gate, up = gated_operands(shape, layout, dtype, seed=shape[-1])
    got = cpu_native.gated_activation(gate, up, activation=activation)
    want = reference.gated_activation(gate, up, activation=activation)
    assert got.shape == want.shape == shape and got.dtype == want.dtype == dtype
    atol, rtol = GATED_TOLERANCES[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=rtol, atol=atol)


def test_gated_activations_hold_over_float32_s_range(module):
    """The SIMD exp over the whole range where it matters, against float64: silu within a few ulp;
    GeGLU within its argument's float32 rounding (2y up to ~88 in exp(-2y): ~88 * 2^-24 relative
    in the tail, values under 1e-24 there); saturated values, infinity and NaN."""
    g = np.linspace(-120, 120, 480_001).astype(np.float32)
    x = g.astype(np.float64)
    y = np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)
    with np.errstate(over="ignore"):
        exact = {"silu": x / (1 + np.exp(-x)), "gelu_tanh": x / (1 + np.exp(-2 * y))}
    ones = mx.ones(g.shape)
    for activation, want in exact.items():
        got = np.array(cpu_native.gated_activation(mx.array(g), ones, activation=activation)).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=4e-7 if activation == "silu" else 1e-5, atol=1e-30)
    edges = mx.array([np.inf, 1e30, -1e30, 0.0, np.nan])
    for activation in ("silu", "gelu_tanh"):
        got = np.array(cpu_native.gated_activation(edges, mx.ones((5,)), activation=activation))
        assert got[0] == np.inf and got[1] == 1e30 and got[2] == 0 and got[3] == 0 and np.isnan(got[4])


def test_gated_activation_inside_a_compiled_graph(module):
    """As the compiled decode step runs it: inside mx.compile, on a fused projection's halves."""
    w = mx.random.normal((64, 2 * 96), key=mx.random.key(4)) * 0.3

    def mlp(x):
        gate, up = mx.split(x @ w, 2, axis=-1)
        return cpu_native.gated_activation(gate, up, activation="gelu_tanh").sum(-1)

    x = mx.random.normal((1, 1, 64), key=mx.random.key(5))
    want = reference.gated_activation(*mx.split(x @ w, 2, axis=-1), activation="gelu_tanh").sum(-1)
    np.testing.assert_allclose(np.array(mx.compile(mlp)(x)), np.array(want), rtol=1e-5, atol=1e-5)


def test_calls_they_do_not_cover_fall_back(module):
    """Half precision, sinks, a per-row rope over 3-D input: computed by mx.fast's paths."""
    q = mx.random.normal((1, 4, 1, 32)).astype(mx.bfloat16)
    k = v = mx.random.normal((1, 2, 6, 32)).astype(mx.bfloat16)
    got = cpu_native.attention(q, k, v, scale=0.2, mask="causal")
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, mlx_fast.attention(q, k, v, scale=0.2, mask="causal"))
    sinks = mx.zeros((4,))
    q32, k32, v32 = q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)
    assert_close(cpu_native.attention(q32, k32, v32, scale=0.2, sinks=sinks),
                 reference.attention(q32, k32, v32, scale=0.2, sinks=sinks))
    x = mx.random.normal((3, 5, 16)).astype(mx.float16)
    weight = mx.ones((16,), dtype=mx.float16)
    assert mx.array_equal(cpu_native.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5))
    gate, up = mx.random.normal((2, 16)), mx.random.normal((2, 16)).astype(mx.bfloat16)  # mixed dtypes
    assert mx.array_equal(cpu_native.gated_activation(gate, up, activation="silu"),
                          mlx_fast.gated_activation(gate, up, activation="silu"))
    x3 = mx.random.normal((3, 5, 16))
    kwargs = {"traditional": False, "base": 1e4, "scale": 1.0, "offset": 2}
    assert_close(cpu_native.rope(x3, 16, **kwargs), reference.rope(x3, 16, **kwargs), atol=1e-5)


def test_bad_operands_are_refused_by_name(module):
    q, k = mx.zeros((1, 4, 1, 16)), mx.zeros((1, 3, 5, 16))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        module.attention(q, k, k, 1.0, False)
    with pytest.raises(ValueError, match=r"broadcast to \[B, Hq, L, S\]"):
        module.attention(q, k[:, :2], k[:, :2], 1.0, False, mx.zeros((1, 1, 1, 4), dtype=mx.bool_))
    with pytest.raises(ValueError, match="one per row"):
        module.rope(q, 16, False, 1e4, 1.0, mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(ValueError, match="even dims"):
        module.rope(q, 15, False, 1e4, 1.0, mx.zeros((1,), dtype=mx.int32))
    with pytest.raises(ValueError, match="weight \\[H\\]"):
        module.rms_norm(mx.zeros((2, 8)), mx.ones((4,)), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        module.rms_norm(mx.zeros((2, 8), dtype=mx.float16), mx.ones((8,)), 1e-5)
    with pytest.raises(ValueError, match="'silu' or 'gelu_tanh', not 'relu'"):
        module.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 8)), "relu")
    with pytest.raises(ValueError, match="one shape"):
        module.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 4)), "silu")
    with pytest.raises(ValueError, match="one dtype"):
        module.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 8), dtype=mx.float16), "silu")
    with pytest.raises(ValueError, match="one dtype"):
        module.gated_activation(mx.zeros((2, 8), dtype=mx.int32), mx.zeros((2, 8), dtype=mx.int32), "silu")
    with pytest.raises(ValueError, match="'silu' or 'gelu_tanh'"):
        cpu_native.gated_activation(mx.zeros((2, 8)), mx.zeros((2, 8)), activation="relu")



@pytest.mark.parametrize("mask", ["none", "causal", "padding", "additive"])
@pytest.mark.parametrize("B,Hq,Hkv,L,start,C", [(1, 9, 3, 1, 40, 256), (2, 4, 2, 3, 0, 8), (2, 8, 2, 5, 11, 16)])
def test_attention_into_cache_writes_then_attends(module, mask, B, Hq, Hkv, L, start, C):
    """One primitive for a layer's cache write and attention: the buffers hold the new keys and
    values at ``start`` and nothing else changes; the output is attention over the first
    ``start + L`` positions."""
    mx.random.seed(B + L + start)
    k_cache, v_cache = mx.random.normal((B, Hkv, C, 64)), mx.random.normal((B, Hkv, C, 32))
    before_k, before_v = np.array(k_cache), np.array(v_cache)
    q = mx.random.normal((B, Hq, L, 64))
    k = mx.random.normal((B, L, Hkv, 64)).transpose(0, 2, 1, 3)  # strided, as a projection's heads
    v = mx.random.normal((B, Hkv, L, 32))
    S = start + L
    m = masks(B, Hq, L, S)[mask]
    if isinstance(m, mx.array) and m.dtype == mx.bool_:
        m[..., -1] = True
    out, keys, values = cpu_native.attention.into_cache(q, k, v, k_cache, v_cache, start, scale=0.125, mask=m)
    want_k, want_v = before_k.copy(), before_v.copy()
    want_k[:, :, start:S], want_v[:, :, start:S] = np.array(k), np.array(v)
    np.testing.assert_array_equal(np.array(keys), want_k)
    np.testing.assert_array_equal(np.array(values), want_v)
    want = reference.attention(q, mx.array(want_k[:, :, :S]), mx.array(want_v[:, :, :S]), scale=0.125, mask=m)
    assert_close(out, want)
    # k_cache was still held here: written into a copy, the original unchanged
    np.testing.assert_array_equal(np.array(k_cache), before_k)


def buffer_address(a: mx.array) -> int:
    """Where ``a``'s data lies (through the buffer protocol; the view is dropped at once, so it
    holds no reference that would stop MLX from donating the buffer)."""
    view = memoryview(a)
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    view.release()
    return int(address)


def test_attention_into_cache_writes_a_buffer_it_alone_holds_in_place(module):
    """A cache's buffer held by nothing else is donated: the same memory step after step (no copy
    per token: a 50 MB cache would be copied every step); one held elsewhere too is copied first,
    and the holder's contents stay as they were."""
    from mlxr_core.model.cache import KVCache

    cache, plain = KVCache(), KVCache()
    cache.step = plain.step = 4096
    addresses = []
    for _ in range(3):
        q, k, v = (mx.random.normal((1, n, 1, 64)) for n in (4, 2, 2))
        out = cache.write_and_attend(q, k, v, cpu_native.attention.into_cache, scale=0.125, mask=None)
        keys, values = plain.update_and_fetch(k, v)
        assert_close(out, reference.attention(q, keys, values, scale=0.125))
        mx.eval(out, cache.keys)
        addresses.append(buffer_address(cache.keys))
    assert cache.offset == plain.offset == 3 and len(set(addresses)) == 1
    np.testing.assert_array_equal(np.array(cache.keys[:, :, :3]), np.array(plain.keys[:, :, :3]))
    held = cache.keys
    before = np.array(held)
    q, k, v = (mx.random.normal((1, n, 1, 64)) for n in (4, 2, 2))
    mx.eval(cache.write_and_attend(q, k, v, cpu_native.attention.into_cache, scale=0.125, mask=None), cache.keys)
    assert buffer_address(cache.keys) != buffer_address(held)
    np.testing.assert_array_equal(np.array(held), before)
    np.testing.assert_array_equal(np.array(cache.keys[:, :, 3:4]), np.array(k))
