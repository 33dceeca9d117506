"""``mlxr bench`` end to end on a tiny GGUF written by the test: the report's shape, never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxr_core.cli.bench import synthetic_prompt
from mlxr_core.cli.main import main


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", quant="q4_1")


def bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """Run ``mlxr bench ARGV`` and return its JSON report."""
    status = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    report: dict = json.loads(out)
    return report


def test_report_has_every_figure(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = bench([str(tiny_path), "--prompt-tokens", "12", "--gen-tokens", "5", "--repeat", "2"], capsys)

    assert report["model"] == str(tiny_path)
    assert report["format"] == "gguf" and report["model_type"] == "llama"
    assert report["device"] in {"cpu", "gpu"} and report["backend"] in {"cpu", "cuda", "metal"}
    assert report["dtype"] in {"float32", "bfloat16"}
    assert report["quantization"] == "auto" and report["weights"] in {"quantized", "dense"}
    assert report["prefix_cache"] is False
    assert set(report["kernels"]) >= {"attention", "rms_norm", "rope"}
    assert report["decode_step"] == "compiled"  # the default, and the llama graph allows it
    assert report["prompt_tokens"] == 12 and report["gen_tokens"] == 5 and report["repeat"] == 2
    for field in ("prompt_tps", "decode_tps", "ttft_s", "peak_memory_bytes", "model_bytes"):
        assert report[field] > 0, field
    assert len(report["runs"]) == 2
    assert all(run[f] > 0 for run in report["runs"] for f in ("prompt_tps", "decode_tps", "ttft_s"))
    assert "concurrent" not in report


def test_concurrency_reports_the_aggregate(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = bench(
        [str(tiny_path), "--prompt-tokens", "8", "--gen-tokens", "4", "--repeat", "1", "--concurrency", "3"],
        capsys,
    )

    concurrent = report["concurrent"]
    assert concurrent["streams"] == 3 and concurrent["engine_max_batch_size"] >= 1
    assert concurrent["generated_tokens"] == 3 * 4
    assert isinstance(concurrent["interleaved"], bool)
    for field in (
        "wall_s", "throughput_tps", "aggregate_decode_tps", "ttft_s_mean", "ttft_s_max", "peak_memory_bytes"
    ):
        assert concurrent[field] > 0, field
    (run,) = concurrent["runs"]
    assert len(run["per_stream_decode_tps"]) == 3


def test_streams_overlap_when_the_engine_batches(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [str(tiny_path), "--prompt-tokens", "8", "--gen-tokens", "16", "--repeat", "1", "--concurrency", "2"]
    assert bench([*common, "--max-batch-size", "2"], capsys)["concurrent"]["interleaved"] is True
    assert bench([*common, "--max-batch-size", "1"], capsys)["concurrent"]["interleaved"] is False


def test_weights_follow_the_quantization_policy(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [str(tiny_path), "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1"]
    kept = bench([*common, "--quantization", "keep"], capsys)
    dense = bench([*common, "--quantization", "dequantize"], capsys)
    assert kept["weights"] == "quantized" and dense["weights"] == "dense"
    assert dense["model_bytes"] > kept["model_bytes"]


def test_kernel_choice_reaches_the_engine(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = bench(
        [str(tiny_path), "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1",
         "--kernels", "attention=reference", "rope=reference", "--dtype", "float32"],
        capsys,
    )
    assert report["kernels"]["attention"] == "reference" and report["kernels"]["rope"] == "reference"
    assert report["dtype"] == "float32"


def test_an_unknown_kernel_backend_fails_with_its_name(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", str(tiny_path), "--kernels", "attention=nope", "--gen-tokens", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "mlxr: error:" in err and "nope" in err and "Traceback" not in err


def test_a_prompt_longer_than_the_context_is_refused(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", str(tiny_path), "--prompt-tokens", "600", "--gen-tokens", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "maximum context length is 512" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--gen-tokens", "1"],
        ["--prompt-tokens", "0"],
        ["--repeat", "0"],
        ["--concurrency", "0"],
        ["--kernels", "attention"],
        ["--dtype", "float64"],
        ["--quantization", "int3"],
        ["--max-batch-size", "0"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "model.gguf", *argv]) == 2
    assert "usage: mlxr bench" in capsys.readouterr().err


def test_synthetic_prompt_is_exact_and_ordinary(tiny_path: Path) -> None:
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    tokenizer = load_model(ModelConfig(path=str(tiny_path)), load_plugins().registries).tokenizer
    for length in (1, 7, 64, 300):
        ids = synthetic_prompt(tokenizer, length)
        assert len(ids) == length
        assert not set(ids) & tokenizer.eos_token_ids
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
    first, second = synthetic_prompt(tokenizer, 32), synthetic_prompt(tokenizer, 32, offset=7)
    assert first != second and len(second) == 32
