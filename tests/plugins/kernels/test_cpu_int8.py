"""``cpu_int8``: the native packed matmul with its input rounded to int8 per 32-element block.
Checked against the reference backend on the rounded input (the rounding is the backend's
definition; the arithmetic after it must be exact to float32 sums), a row's result independent of
the rows beside it, and its selection (opt-in, refused with a reason on a CPU without integer dot
products)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from test_cpu_native import smollm2

from mlxr_core.config.schema import ModelConfig
from mlxr_core.kernels import KernelContext, bind_kernels
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.kernels import cpu_int8, cpu_native, native, reference

SHAPES = {"head_dim": 64, "n_heads": 4, "n_kv_heads": 2}


@pytest.fixture(scope="module")
def module(module):
    """The native module (conftest.py), where this CPU has the int8 tiles."""
    if not module.int8_decode():
        pytest.skip(f"this CPU has no AVX-512 VNNI (the native kernels' SIMD: {module.isa()})")
    return module


def rounded(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x`` [..., K] as the kernel rounds it (per 32-element block, scale max |x| / 127), in
    numpy, and the block scales."""
    blocks = np.array(x.astype(mx.float32)).reshape(*x.shape[:-1], -1, 32)
    scale = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse)
    assert np.abs(q).max() <= 127
    return mx.array((q * scale).reshape(x.shape)), mx.array(scale)


def expected(x, w, scales, biases, group_size, bits):
    """The reference product of the rounded input with the weight's integer part, plus the exact
    input's bias term (the kernel keeps that one in float32)."""
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    kwargs = {"transpose": True, "group_size": group_size, "bits": bits}
    scaled = reference.quantized_matmul(rounded(x)[0], w, scales, mx.zeros_like(biases), **kwargs)
    bias_term = x.astype(mx.float32) @ mx.repeat(biases, group_size, axis=1).T
    return scaled + bias_term


def packed(N: int, K: int, bits: int, group_size: int, dtype=mx.float32, seed: int = 0):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((N, K)), group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def assert_close(got: mx.array, want: mx.array, atol: float = 1e-5) -> None:
    got_np, want_np = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = np.abs(want_np).max()
    np.testing.assert_allclose(got_np / scale, want_np / scale, atol=atol)


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 37])
# K: whole 128-element chunks, and 1-2 blocks after them.
@pytest.mark.parametrize(
    "K,group_size", [(K, g) for K in (128, 576, 640, 1536) for g in (32, 64, 128) if K % g == 0]
)
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_decode_rows_match_the_reference_on_the_rounded_input(module, bits, group_size, K, rows, scale_dtype):
    if bits not in module.int8_bits():
        pytest.skip(f"{bits}-bit weights keep float inputs on this CPU (int8 for {module.int8_bits()})")
    N = 203  # not a multiple of the 4-row tiles
    w, scales, biases = packed(N, K, bits, group_size, scale_dtype)
    x = mx.random.normal((rows, K)) * mx.linspace(0.01, 4, K)  # blocks of different ranges
    got = cpu_int8.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert_close(got, expected(x, w, scales, biases, group_size, bits))
    # and it is not the float path's result: the rounding shows
    float_path = cpu_native.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert not np.allclose(np.array(got), np.array(float_path), rtol=0, atol=1e-6)


def test_a_block_of_zeros_is_no_division_by_zero(module):
    w, scales, biases = packed(64, 256, 4, 32)
    x = mx.random.normal((1, 256))
    x[:, 32:64] = 0  # scale 0
    kwargs = {"transpose": True, "group_size": 32, "bits": 4}
    assert_close(cpu_int8.quantized_matmul(x, w, scales, biases, **kwargs), expected(x, w, scales, biases, 32, 4))


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_a_row_gets_the_same_result_in_any_call(module, bits):
    """A row's output does not depend on the other rows of its call, to the last bit: a decode
    step's rows (fewer than int8_amx_rows()) alone or together; a prompt's rows (AMX's tiles where
    the CPU has them) whatever rows share their call and wherever they sit in it."""
    w, scales, biases = packed(203, 576, bits, 32)
    kwargs = {"transpose": True, "group_size": 32, "bits": bits}
    few = module.int8_amx_rows() - 1
    rows = mx.random.normal((few, 576))
    together = np.array(cpu_int8.quantized_matmul(rows, w, scales, biases, **kwargs))
    alone = np.concatenate([np.array(cpu_int8.quantized_matmul(rows[i : i + 1], w, scales, biases, **kwargs))
                            for i in range(few)])
    np.testing.assert_array_equal(together, alone)
    assert_close(mx.array(together), expected(rows, w, scales, biases, 32, bits))

    prompt = mx.random.normal((40, 576))
    whole = np.array(cpu_int8.quantized_matmul(prompt, w, scales, biases, **kwargs))
    order = np.random.default_rng(0).permutation(40)
    shuffled = np.array(cpu_int8.quantized_matmul(prompt[mx.array(order)], w, scales, biases, **kwargs))
    np.testing.assert_array_equal(shuffled, whole[order])
    part = np.array(cpu_int8.quantized_matmul(prompt[5:25], w, scales, biases, **kwargs))
    np.testing.assert_array_equal(part, whole[5:25])
    assert_close(mx.array(whole), expected(prompt, w, scales, biases, 32, bits))


def test_other_widths_keep_the_float_path(module):
    w, scales, biases = packed(64, 256, 6, 32)
    x = mx.random.normal((1, 256))
    kwargs = {"transpose": True, "group_size": 32, "bits": 6}
    got = cpu_int8.quantized_matmul(x, w, scales, biases, **kwargs)
    np.testing.assert_array_equal(np.array(got), np.array(cpu_native.quantized_matmul(x, w, scales, biases, **kwargs)))


@pytest.mark.parametrize("rows", [1, 20], ids=["decode", "prompt"])
def test_gather_form_rounds_each_row(module, rows):
    E, N, K = 4, 40, 256
    w, scales, biases = packed(E * N, K, 4, 32)
    w, scales, biases = (a.reshape(E, N, -1) for a in (w, scales, biases))
    x = mx.random.normal((3, 1, rows, K))
    indices = mx.array([[2, 0], [1, 3], [3, 3]], dtype=mx.uint32)
    got = cpu_int8.gather_matmul(x, w, scales, biases, indices=indices, group_size=32, bits=4)
    for b in range(3):
        for j in range(2):
            e = int(indices[b, j])
            want = expected(x[b, 0], w[e], scales[e], biases[e], 32, 4)
            assert_close(got[b, j], want)


def test_the_default_here_and_keeps_weights_packed(module):
    registries = load_plugins().registries
    chosen = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES)
    assert chosen.chosen["quantized_matmul"] == "cpu_int8" and chosen.chosen["gather_matmul"] == "cpu_int8"
    assert chosen.keeps_packed
    floats = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES, choices={"quantized_matmul": "cpu_native"})
    assert floats.chosen["quantized_matmul"] == "cpu_native"


def test_auto_takes_it_where_the_cpu_has_vnni_and_says_why(monkeypatch, caplog):
    """The fastest path with the measured accuracy is the default: auto ranks cpu_int8 first and
    logs its reason; a CPU without VNNI falls to cpu_native (the test above covers the real CPU)."""
    from mlxr_core.kernels import select_kernel

    class Vnni:
        def int8_decode(self) -> bool:
            return True

    native_backend = SimpleNamespace(quantized_matmul_kernel=SimpleNamespace(supports=lambda ctx: []))
    monkeypatch.setattr(cpu_int8, "cpu_native", native_backend)
    monkeypatch.setattr(native, "load", lambda: (Vnni(), ""))
    ctx = KernelContext(op="quantized_matmul", device="cpu", platform="cpu", dtype="float32", shapes=SHAPES)
    with caplog.at_level("INFO", logger="mlxr_core.kernels"):
        name, _ = select_kernel(load_plugins().registries.kernels, ctx, "auto")
    assert name == "cpu_int8" and "auto chose cpu_int8: the default where the CPU has AVX-512 VNNI" in caplog.text


def test_a_cpu_without_integer_dot_products_is_a_reason(monkeypatch):
    class NoVnni:
        def int8_decode(self) -> bool:
            return False

        def isa(self) -> str:
            return "avx2"

    native_backend = SimpleNamespace(quantized_matmul_kernel=SimpleNamespace(supports=lambda ctx: []))
    monkeypatch.setattr(cpu_int8, "cpu_native", native_backend)
    monkeypatch.setattr(native, "load", lambda: (NoVnni(), ""))
    ctx = KernelContext(op="quantized_matmul", device="cpu", platform="cpu", dtype="float32")
    reasons = cpu_int8.quantized_matmul_kernel.supports(ctx)
    assert reasons and "AVX-512 VNNI" in reasons[0]


#: llama.cpp's margin between its top two tokens from which the int8 path must pick its top one (see
#: test_gemma3_reference.INT8_MARGIN): SmolLM2's French prompt is 0.44 apart there.
INT8_MARGIN = 0.5


def test_smollm2_decode_steps_with_int8_inputs_answer_like_llama_cpp(module):
    """SmolLM2 Q4_1 served with cpu_int8 (llama.cpp rounds its inputs alike, to Q8_1): each prompt
    but its last token prefilled, the last one decoded by the compiled step; the top token is
    llama.cpp's wherever llama.cpp's own top two are INT8_MARGIN apart, and the top 5 overlap."""
    path, prompts = smollm2()
    choices = {"quantized_matmul": "cpu_int8", "gather_matmul": "cpu_int8"}
    loaded = load_model(ModelConfig(path=str(path), dtype="float32"), load_plugins().registries, kernel_choices=choices)
    assert loaded.kernels.chosen["quantized_matmul"] == "cpu_int8" and loaded.compiled_decode is not None
    for prompt in prompts:
        caches = loaded.make_cache()
        loaded.model(mx.array([prompt["ids"][:-1]]), cache=caches)
        logits = np.array(loaded.decode(mx.array([prompt["ids"][-1]]), caches)[0])
        their_ids = [token for token, _ in prompt["q4_1"]]
        their_logits = [logit for _, logit in prompt["q4_1"]]
        assert len(set(np.argsort(-logits)[:5].tolist()) & set(their_ids[:5])) >= 3, prompt["name"]
        if their_logits[0] - their_logits[1] >= INT8_MARGIN:
            assert int(logits.argmax()) == their_ids[0], prompt["name"]
