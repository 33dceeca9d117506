"""Loading under tensor parallelism: what each of 2 ranks reads from the checkpoint and its peak
memory, when it reads only its shares of the split tensors (now) and when it read the whole
checkpoint, built the whole model and then kept its shares (before).

Each rank loads in a fresh process, as rank 0 or 1 of 2 (a group that answers ``size()`` and
``rank()``: loading runs no collective, so no ranks are launched). Reported per model, rank and way:

- ``copied_from_file``: the bytes of the split tensors the format took out of the file
  (``metadata["shard_bytes"]``; before: the whole of them);
- ``mapped_from_file``: the file's pages this process touched through its mapping (``Rss`` of the
  mapping in ``/proc/self/smaps``; GGUF, whose reader maps the file), whole pages and folios;
- ``read_syscalls``: bytes read with ``read(2)`` during the load (``rchar``: MLX reads safetensors so);
- ``peak_rss`` and ``rss_before_load``: the process's peak resident memory after the load
  (``VmHWM``: ``ru_maxrss`` would carry over the parent's from before ``exec``), and its resident
  memory just before it (imports), so ``peak_rss - rss_before_load`` is the load's.

SmolLM2-135M's 9 query heads do not split across 2 ranks (its load is refused, as before), so the
models are random llamas of its shape with 8 query / 4 key-value heads (as ``distributed.py``):
a GGUF in SmolLM2's Q4_1 and a bfloat16 safetensors folder, with SmolLM2's 49,152-token embedding.

    python bench/tensor_parallel_load.py --out bench/results/tensor_parallel_load_smollm2-shape_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: SmolLM2-135M's shape with 8 query and 4 key-value heads (it has 9 and 3).
SHAPE = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 72, "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip


class Rank:
    """Rank ``index`` of 2, as far as loading asks."""

    def __init__(self, index: int):
        self.index = index

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self.index


def proc_figure(file: str, key: str) -> int:
    for line in Path(file).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise SystemExit(f"no {key} in {file}")


def mapped_bytes(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (pages it touched)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def worker(model: str, way: str, rank: int) -> dict[str, Any]:
    """Load ``model`` as ``rank`` of 2, ``way`` ``now`` or ``before``; the figures above."""
    import mlx.core as mx

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.model.tensor_parallel import shard_model
    from mlxr_core.plugins import load_plugins
    from mlxr_plugins.formats.gguf import checkpoint as gguf_checkpoint

    readers: list[Any] = []  # kept open so that their mappings show what the load touched
    opened = gguf_checkpoint.open_reader
    gguf_checkpoint.open_reader = lambda path: readers.append(opened(path)) or readers[-1]
    registries = load_plugins().registries
    config = ModelConfig(path=model, quantization="keep", compile_decode=False)
    rss_before = proc_figure("/proc/self/status", "VmRSS:") * 1024
    read_before = proc_figure("/proc/self/io", "rchar:")
    if way == "now":
        loaded = load_model(config, registries, tensor_group=Rank(rank))
        copied = loaded.metadata["shard_bytes"]
    else:  # as loading did before: the whole checkpoint and model, then this rank's shares
        loaded = load_model(config, registries)
        shard_model(loaded.model, Rank(rank), name=loaded.name)
        mx.eval(loaded.model.parameters())
        copied = None  # every split tensor whole: main() fills in what the shares' load counted
    path = Path(loaded.path)
    return {
        "copied_from_file": copied,
        "mapped_from_file": mapped_bytes(path) if path.is_file() else None,
        "read_syscalls": proc_figure("/proc/self/io", "rchar:") - read_before,
        "rss_before_load": rss_before,
        "peak_rss": proc_figure("/proc/self/status", "VmHWM:") * 1024,
        "resident_weights": loaded.nbytes,
    }


def run(model: Path, way: str, rank: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", way, "--rank", str(rank), "--model", str(model)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode:  # the worker's one line of output is its JSON; logs go to stderr
        raise SystemExit(f"{way} rank {rank} on {model} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def write_models(root: Path) -> dict[str, Path]:
    """The GGUF (Q4_1) and the bfloat16 safetensors folder of :data:`SHAPE`."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_decode import write_folders

    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(root / "smollm2-shape-q4_1.gguf", quant="q4_1", n_layers=30, hidden=576,
                                 heads=8, kv_heads=4, intermediate=1536, context_length=8192,
                                 tied_embeddings=True)  # fmt: skip
    folder = write_folders(root, SHAPE, names=("bf16",))["bf16"]
    return {"gguf q4_1": gguf, "safetensors bf16": folder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["now", "before"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.rank)))
        return
    results: dict[str, Any] = {}
    for name, model in write_models(Path(tempfile.mkdtemp())).items():
        results[name] = {f"{way} rank {rank}": run(model, way, rank) for way in ("before", "now") for rank in (0, 1)}
        for rank in (0, 1):
            whole = results[name][f"now rank {rank}"]["copied_from_file"]["whole"]
            results[name][f"before rank {rank}"]["copied_from_file"] = {"read": whole, "whole": whole}
        for key, figures in results[name].items():
            copied, mapped = figures["copied_from_file"], figures["mapped_from_file"]
            print(f"{name:17} {key:14} copied {copied['read']:>11,} of {copied['whole']:>11,}  "
                  f"mapped {'-' if mapped is None else f'{mapped:,}':>11}  read(2) {figures['read_syscalls']:>11,}  "
                  f"peak RSS {figures['peak_rss']:>12,} (before load {figures['rss_before_load']:,})")  # fmt: skip
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
