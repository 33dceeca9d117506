"""Corrupt, truncated and fuzzed GGUF and safetensors files: a ModelLoadError naming the file (and
the tensor where known), never a crash, never an allocation the file's size cannot justify.

Loads run in a child process (a crash there fails the test instead of killing the run); the child
reports, per file, the error and how much its peak resident memory grew while loading.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxr_core.testing.tiny import write_tiny_llama_gguf

pytest.importorskip("hypothesis")

#: Peak memory a load may add beyond a multiple of the file's size (dequantizing 8-bit blocks to
#: float32 takes ~4x the file): interpreter and allocator noise, far below any runaway allocation.
MEMORY_SLACK = 48 * 2**20
SIZE_FACTOR = 8

CHILD = textwrap.dedent(
    """
    import json, resource, sys, traceback
    from pathlib import Path
    from mlxr_core.errors import ModelLoadError
    from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat
    from mlxr_plugins.formats.safetensors.checkpoint import SafetensorsFormat

    FORMATS = {"gguf": GGUFFormat(), "safetensors": SafetensorsFormat()}

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def load(kind, path):
        before = peak()
        try:
            FORMATS[kind].load(Path(path))
            outcome = {"result": "loaded"}
        except ModelLoadError as exc:
            outcome = {"result": "error", "message": str(exc), "tensor": exc.tensor}
        except BaseException as exc:
            outcome = {"result": "unexpected", "message": "".join(traceback.format_exception(exc))}
        outcome["grew"] = peak() - before
        return outcome

    request = json.loads(sys.stdin.read())
    load(request["kind"], request["warmup"])  # imports and first-use allocations
    for path in request.get("paths", []):
        print(json.dumps({"path": path, **load(request["kind"], path)}), flush=True)
    flips = request.get("flips")
    if flips:
        from hypothesis import HealthCheck, given, settings, strategies as st

        good = Path(request["warmup"]).read_bytes()
        target = Path(flips["path"])

        @settings(max_examples=flips["examples"], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)),
                        min_size=1, max_size=8))
        def flip(changes):
            data = bytearray(good)
            for offset, mask in changes:
                data[offset] ^= mask
            target.write_bytes(bytes(data))
            print(json.dumps({"path": str(target), "flips": changes, **load(request["kind"], str(target))}), flush=True)

        flip()
    """
)


def run_child(kind: str, warmup: Path, paths: list[Path] = (), flips: dict[str, Any] | None = None) -> list[dict[str, Any]]:  # type: ignore[assignment]
    request = {"kind": kind, "warmup": str(warmup), "paths": [str(p) for p in paths], "flips": flips}
    process = subprocess.run(
        [sys.executable, "-c", CHILD], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, f"the loading process died ({process.returncode}):\n{process.stderr[-3000:]}"
    return [json.loads(line) for line in process.stdout.splitlines()]


def assert_clean_failures(outcomes: list[dict[str, Any]], *, allow_loaded: bool = False) -> None:
    for outcome in outcomes:
        path, size = outcome["path"], Path(outcome["path"]).stat().st_size
        if outcome["result"] == "loaded" and allow_loaded:
            continue
        assert outcome["result"] == "error", f"{path}: {outcome}"
        assert path in outcome["message"] or str(Path(path).parent) in outcome["message"]
        assert "Traceback" not in outcome["message"]
        assert outcome["grew"] <= SIZE_FACTOR * size + MEMORY_SLACK, outcome


# -- GGUF -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", quant="q8_0")


def tensor_info_offsets(path: Path, name: str) -> dict[str, int]:
    """Byte offsets of a tensor's header fields (dims, type, data offset) and of its data."""
    import gguf

    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    tensor = next(t for t in reader.tensors if t.name == name)
    parts = tensor.field.parts
    return {
        "dims": parts[3].ctypes.data - base,
        "type": parts[4].ctypes.data - base,
        "offset": parts[5].ctypes.data - base,
        "data": reader.data_offset + int(parts[5][0]),
    }


def data_end(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(path)
    return max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


def test_corrupt_gguf_headers_and_data_are_clean_errors(good_gguf: Path, tmp_path: Path) -> None:
    good = good_gguf.read_bytes()
    where = tensor_info_offsets(good_gguf, "blk.0.attn_q.weight")
    cases: dict[str, bytes] = {"bad_magic": b"GGUX" + good[4:]}

    def patched(offset: int, fmt: str, value: Any) -> bytes:
        data = bytearray(good)
        struct.pack_into(fmt, data, offset, value)
        return bytes(data)

    cases["tensor_count_huge"] = patched(8, "<Q", 2**62)
    cases["kv_count_huge"] = patched(16, "<Q", 2**62)
    cases["tensor_count_plus_one"] = patched(8, "<Q", struct.unpack_from("<Q", good, 8)[0] + 1)
    cases["huge_shape"] = patched(where["dims"] + 8, "<Q", 2**40)
    cases["offset_past_end"] = patched(where["offset"], "<Q", 2**40)
    cases["unknown_type"] = patched(where["type"], "<I", 999)
    nan = np.array([np.nan], np.float16).tobytes()
    cases["nan_scale"] = good[: where["data"]] + nan + good[where["data"] + 2 :]
    # Cuts anywhere before the end of the last tensor's data (what follows is alignment padding).
    for cut in np.unique(np.geomspace(1, data_end(good_gguf) - 1, 40).astype(int)):
        cases[f"truncated_{cut}"] = good[:cut]
    paths = []
    for name, data in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
        paths.append(tmp_path / f"{name}.gguf")

    outcomes = {Path(o["path"]).stem: o for o in run_child("gguf", good_gguf, paths)}
    assert len(outcomes) == len(cases)
    assert_clean_failures(list(outcomes.values()))
    for name in ("huge_shape", "offset_past_end", "unknown_type", "nan_scale"):
        assert outcomes[name]["tensor"] == "blk.0.attn_q.weight", outcomes[name]
    assert "non-finite" in outcomes["nan_scale"]["message"]


def test_random_byte_flips_in_a_gguf_never_crash(good_gguf: Path, tmp_path: Path) -> None:
    outcomes = run_child("gguf", good_gguf, flips={"path": str(tmp_path / "flipped.gguf"), "examples": 60})
    assert len(outcomes) >= 60
    # A flip inside a weight's bytes may still be a valid file; anything else must be a clean error.
    assert_clean_failures(outcomes, allow_loaded=True)
    assert any(o["result"] == "error" for o in outcomes)


# -- safetensors ----------------------------------------------------------------------------------


def write_folder(folder: Path, data: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(data)
    return folder / "model.safetensors"


@pytest.fixture(scope="module")
def good_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import mlx.core as mx

    folder = tmp_path_factory.mktemp("st") / "good"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = {"a": mx.ones((64, 64)), "b": mx.zeros((8,), dtype=mx.float16)}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder / "model.safetensors"


def test_corrupt_safetensors_are_clean_errors(good_safetensors: Path, tmp_path: Path) -> None:
    good = good_safetensors.read_bytes()
    (length,) = struct.unpack_from("<Q", good)
    header, body = json.loads(good[8 : 8 + length]), good[8 + length :]

    def with_entry(**changes: Any) -> bytes:
        edited = {**header, "a": {**header["a"], **changes}}
        text = json.dumps(edited).encode()
        return struct.pack("<Q", len(text)) + text + body

    a_start = 8 + length + header["a"]["data_offsets"][0]
    cases = {
        "header_length_huge": struct.pack("<Q", 2**62) + good[8:],
        "header_length_whole_file": struct.pack("<Q", len(good)) + good[8:],
        "header_not_json": struct.pack("<Q", 5) + b"{{{{{" + body,
        "huge_shape": with_entry(shape=[2**40, 2**20]),
        # 2**32 + 4096 float32s: wraps to 4096 in 32 bits, exactly the 16 KiB of data stored.
        "wrapping_shape": with_entry(shape=[2**32 + 4096]),
        "negative_shape": with_entry(shape=[-1, 64]),
        "string_shape": with_entry(shape="64x64"),
        "offset_past_end": with_entry(data_offsets=[0, 2**40]),
        "offsets_reversed": with_entry(data_offsets=[16, 0]),
        "unknown_dtype": with_entry(dtype="Q9"),
        "nan_values": good[:a_start] + np.array([np.nan], np.float32).tobytes() + good[a_start + 4 :],
    }
    for cut in np.unique(np.geomspace(1, len(good) - 1, 25).astype(int)):
        cases[f"truncated_{cut}"] = good[:cut]
    paths = [write_folder(tmp_path / name, data) for name, data in cases.items()]

    outcomes = {Path(o["path"]).parent.name: o for o in run_child("safetensors", good_safetensors, paths)}
    assert len(outcomes) == len(cases)
    assert_clean_failures(list(outcomes.values()))
    for name in ("huge_shape", "wrapping_shape", "negative_shape", "offset_past_end", "unknown_dtype", "nan_values"):
        assert outcomes[name]["tensor"] == "a", outcomes[name]


def test_random_byte_flips_in_safetensors_never_crash(good_safetensors: Path, tmp_path: Path) -> None:
    target = write_folder(tmp_path / "flipped", b"")
    outcomes = run_child("safetensors", good_safetensors, flips={"path": str(target), "examples": 60})
    assert len(outcomes) >= 60
    assert_clean_failures(outcomes, allow_loaded=True)
    assert any(o["result"] == "error" for o in outcomes)
