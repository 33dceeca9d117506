"""Tensor parallelism across 2 ranks of the ring backend on loopback, against transformers.

``tensor_parallel_worker.py`` runs under ``mlx.launch``: each rank loads the tiny Hugging Face
folders with its share of the heads and MLP columns (:mod:`mlxr_core.model.tensor_parallel`), and
their logits (a full forward pass, and cached decoding through the compiled step with its
all-reduces) are compared with the logits transformers computed on the same files
(``tests/fixtures/tiny_hf/reference.json``; ATOL as in ``test_hf_reference.py``). A tiny GGUF with
packed 4-bit weights kept packed is split and compared with itself whole. mlx-lm's 4-bit folder has
32 input columns per output projection in groups of 32, which cannot be split in two: a refusal
naming the reason.
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


@pytest.mark.slow
def test_two_ranks_match_transformers_and_refuse_what_cannot_split(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    command = [*mlx_launch(2, free_ports(2)), sys.executable, str(WORKER), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["size"] == 2
    for folder in ("llama", "qwen2", "qwen3", "gemma3"):
        figures = results[folder]
        assert figures["compiled"], folder
        for path in ("full", "cached"):
            worst, argmax = figures[path]
            assert worst < ATOL and argmax, (folder, path, worst)
    refusal = results["llama_mlx_q4"]["refused"]
    assert "cannot be split across ranks" in refusal and "whole groups of 32" in refusal
    assert "distributed.tensor_parallel" in refusal
    packed = results["q4_0"]
    assert packed["layer"] != "Linear" and packed["difference"] < 1e-4
