"""Tensor and pipeline parallelism across 2 ranks of the ring backend on loopback, against
transformers (and mlx-lm for its 4-bit folder).

``tensor_parallel_worker.py`` runs under ``mlx.launch``: each rank loads the tiny Hugging Face
folders with its share of the heads and MLP columns (:mod:`mlxr_core.model.tensor_parallel`), then
with its share of the layers (:mod:`mlxr_core.model.pipeline`); their logits (a full forward pass,
and cached decoding one token at a time: the compiled step with its all-reduces under tensor
parallelism, send/recv and all_gather under pipeline) are compared with the logits the reference
computed on the same files (``tests/fixtures/tiny_hf/reference.json``; ATOL as in
``test_hf_reference.py``). A tiny GGUF with packed 4-bit weights kept packed is split by heads and
compared with itself whole. What cannot be split is refused, naming the reason: mlx-lm's 4-bit
folder by heads (32 input columns per output projection in groups of 32 do not halve), Gemma 3's
3 layers into 2 stages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxr_core.testing.distributed import free_ports, mlx_launch

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
ATOL = 1e-4


def assert_close(figures: dict, *, compiled: bool) -> None:
    assert figures["compiled"] is compiled
    for path in ("full", "cached"):
        worst, argmax = figures[path]
        assert worst < ATOL and argmax, (path, worst)


@pytest.mark.slow
def test_two_ranks_match_the_reference_and_refuse_what_cannot_split(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    command = [*mlx_launch(2, free_ports(2)), sys.executable, str(WORKER), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["size"] == 2
    tensor, pipeline = results["tensor"], results["pipeline"]
    for folder in ("llama", "qwen2", "qwen3", "gemma3"):
        assert_close(tensor[folder], compiled=True)
    for folder in ("llama", "qwen2", "qwen3", "llama_mlx_q4"):
        assert_close(pipeline[folder], compiled=False)
        assert pipeline[folder]["layers"] == 1  # of 2
    refusal = tensor["llama_mlx_q4"]["refused"]
    assert "distributed.tensor_parallel" in refusal and "whole groups of 32" in refusal
    refusal = pipeline["gemma3"]["refused"]
    assert "distributed.pipeline_parallel" in refusal and "3 layers do not divide evenly" in refusal
    packed = results["q4_0"]
    assert packed["layer"] != "Linear" and packed["difference"] < 1e-4
