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

Without launching processes, a rank's load (a group that only answers ``size()`` and ``rank()``)
is compared with the whole model loaded and then split: the same arrays, bit for bit, for
safetensors folders and GGUF files (plain and packed), though the other rank's share of every
split tensor is overwritten with NaN in the files (a load that read it would refuse the file);
and of the tensors it splits the rank took half the bytes from the file. A model whose heads do
not divide is refused before a byte of its weights is read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxr_core.config.schema import ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import Shard
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_core.model.tensor_parallel import shard_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.distributed import free_ports, mlx_launch
from mlxr_core.testing.tiny import write_tiny_llama_gguf
from mlxr_plugins.formats.safetensors.checkpoint import NUMPY_DTYPES, check_header

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
TINY_HF = Path(__file__).parents[2] / "fixtures" / "tiny_hf"
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


@attrs.frozen
class Rank:
    """Rank ``index`` of 2, as far as loading asks (no collective runs)."""

    index: int

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self.index


@pytest.fixture(scope="module")
def registries() -> Any:
    return load_plugins().registries


def load(path: Path, registries: Any, group: Rank | None) -> LoadedModel:
    config = ModelConfig(path=str(path), quantization="keep", compile_decode=False, fuse_projections=False)
    return load_model(config, registries, tensor_group=group)


def split_after_loading(path: Path, registries: Any, group: Rank) -> dict[str, mx.array]:
    """The parameters as loading split them before this change: the whole model, then its shares."""
    whole = load(path, registries, None)
    shard_model(whole.model, group, name=whole.name)
    return dict(tree_flatten(whole.model.parameters()))


def assert_same_parameters(split: LoadedModel, expected: dict[str, mx.array]) -> None:
    loaded = dict(tree_flatten(split.model.parameters()))
    assert loaded.keys() == expected.keys()
    for key, array in loaded.items():
        assert array.dtype == expected[key].dtype and array.shape == expected[key].shape, key
        assert mx.array_equal(array, expected[key]).item(), key


#: Llama's split layers, by their tensor names in either format: rows (query, key, value heads;
#: gate and up columns) or input columns (output and down projections).
SPLIT = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
    "attn_q": 0, "attn_k": 0, "attn_v": 0, "ffn_gate": 0, "ffn_up": 0, "attn_output": 1, "ffn_down": 1,
}  # fmt: skip


def poison(data: np.ndarray, name: str, rank: int, block_bytes: int = 1) -> int:
    """Overwrite the share of ``rank`` of a split tensor's ``data`` (a writable view of the file)
    with all-ones bytes (NaN in every float type, and in a ggml block's scale); returns the bytes
    overwritten. ``block_bytes``: a row's raw bytes are cut at whole blocks of this size."""
    layer = name.split(".")[-2]
    axis = SPLIT.get(layer)
    if axis is None or data.ndim <= axis:
        return 0
    raw = data.view(np.uint8)
    scale = raw.shape[-1] // data.shape[-1] if axis == 1 else 1  # bytes per element of a row
    unit = max(block_bytes, scale) if axis == 1 else 1
    for start, stop in Shard(axis, 2, rank).ranges(raw.shape[axis] // unit):
        if axis == 0:
            raw[start:stop] = 0xFF
        else:
            raw[:, start * unit : stop * unit] = 0xFF
    return int(raw.nbytes // 2)


def poisoned_folder(folder: Path, into: Path, rank: int) -> Path:
    """A copy of a safetensors folder with ``rank``'s share of each split tensor overwritten."""
    shutil.copytree(folder, into)
    for file in into.glob("*.safetensors"):
        header, start = check_header(file)
        for name, entry in header.items():
            if name != "__metadata__":
                begin = entry["data_offsets"][0]
                data = np.memmap(file, dtype=NUMPY_DTYPES[entry["dtype"]], mode="r+", offset=start + begin,
                                 shape=tuple(entry["shape"]))  # fmt: skip
                poison(data, name, rank)
                data.flush()
    return into


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("folder", ["llama", "qwen2", "gemma3"])
def test_a_rank_reads_its_share_of_a_safetensors_folder(folder: str, rank: int, registries: Any, tmp_path: Path) -> None:
    path = poisoned_folder(TINY_HF / folder, tmp_path / folder, 1 - rank)
    split = load(path, registries, Rank(rank))
    assert_same_parameters(split, split_after_loading(TINY_HF / folder, registries, Rank(rank)))
    shares = split.metadata["shard_bytes"]
    assert shares["whole"] > split.nbytes / 2 and shares["read"] * 2 == shares["whole"]
    with pytest.raises(ModelLoadError, match="non-finite"):
        load(path, registries, None)  # the poison is there for a load that reads it


@pytest.mark.parametrize("quant", ["f32", "bf16", "q8_0", "q4_0"])
def test_a_rank_reads_its_share_of_a_gguf(quant: str, tmp_path: Path, registries: Any) -> None:
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", quant=quant)
    for rank in (0, 1):
        poisoned = tmp_path / f"poisoned-{rank}.gguf"
        shutil.copyfile(path, poisoned)
        writable = gguf.GGUFReader(poisoned, "r+")
        overwritten = sum(poison(tensor.data, tensor.name, 1 - rank, gguf.GGML_QUANT_SIZES[tensor.tensor_type][1])
                          for tensor in writable.tensors)  # fmt: skip
        writable.data.flush()
        del writable
        assert overwritten

        split = load(poisoned, registries, Rank(rank))
        assert_same_parameters(split, split_after_loading(path, registries, Rank(rank)))
        shares = split.metadata["shard_bytes"]
        assert shares["read"] * 2 == shares["whole"] == 2 * overwritten
        with pytest.raises(ModelLoadError, match="non-finite"):
            load(poisoned, registries, None)


def test_a_model_that_does_not_split_is_refused_before_its_weights_are_read(tmp_path: Path, registries: Any) -> None:
    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", kv_heads=1)
    writable = gguf.GGUFReader(path, "r+")
    for tensor in writable.tensors:
        tensor.data.view(np.uint8)[...] = 0xFF  # NaN: a load that read any weight would refuse the file
    writable.data.flush()
    del writable
    with pytest.raises(ModelLoadError, match="4 query heads and 1 key/value heads do not divide"):
        load(path, registries, Rank(0))
