"""A semantic fuzzer of the model loaders: valid files whose metadata holds absurd values.

Each case is a well-formed file (a GGUF that parses, a ``config.json`` that is JSON) in which the
metadata keys the loaders read take values no model has: zero, negative, huge, fractional,
non-finite, strings, lists, objects. :func:`gguf_cases` and :func:`config_cases` enumerate one
key at a time over :data:`ABSURD`, then seeded pairs of keys; :func:`write_case` writes one;
:func:`load_in_child` loads many in one child process through the whole pipeline (format,
architecture, tokenizer, weights, one forward pass), which reports per file whether it loaded
(with finite logits), failed with a :class:`~mlxr_core.errors.ModelLoadError` (naming what), or
failed otherwise, and how far its peak memory grew; :func:`problems` judges the outcomes. A child
that dies names the file it was loading.

The CI runs a deterministic slice (``tests/plugins/formats/test_semantic_fuzz.py``); the long
run is ``python bench/fuzz_loaders.py --cases 2000``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from mlxr_core.testing.tiny import add_value

#: Values no checkpoint should hold for a number, a name or a list the loaders read.
ABSURD: tuple[Any, ...] = (
    0, -1, 1, 3, 2**31 - 1, 2**40, 10**12, 2.5, -2.5, 1e-30, 1e30, math.nan, math.inf, -math.inf,
    "64", "", True, [], [0], [1.5, 2.5], {"a": 1}, None,
)
#: The GGUF metadata keys the reader takes values from (without the ``{arch}.`` prefix), and
#: tokenizer keys.
GGUF_KEYS = (
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scale_linear", "expert_count",
    "expert_used_count", "expert_feed_forward_length",
)
GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.model", "general.architecture",
)
#: The ``config.json`` keys the safetensors format and the architectures read.
CONFIG_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "max_position_embeddings", "sliding_window",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
    "torch_dtype", "quantization", "quantization_config", "hidden_act",
)
#: Peak memory a load may add beyond twice the file: the interpreter's and allocator's noise.
MEMORY_SLACK = 64 * 2**20


@attrs.frozen
class Case:
    """One fuzzed file: its kind (``gguf`` or ``config``) and the keys changed, with their values."""

    kind: str
    changes: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        text = "+".join(f"{key}={value!r}" for key, value in self.changes)
        return "".join(c if c.isalnum() or c in "._=+-" else "_" for c in text)[:120]


def gguf_cases(arch: str = "llama") -> Iterator[Case]:
    """Every GGUF key the reader reads, one at a time, set to every value GGUF can hold."""
    keys = [f"{arch}.{key}" for key in GGUF_KEYS] + list(GGUF_TOKENIZER_KEYS)
    for key in keys:
        for value in ABSURD:
            if value is None or isinstance(value, dict) or (isinstance(value, list) and not value):
                continue  # not GGUF values
            yield Case("gguf", ((key, value),))


def config_cases() -> Iterator[Case]:
    """Every ``config.json`` key the loaders read, one at a time, set to every absurd value."""
    for key in CONFIG_KEYS:
        for value in ABSURD:
            yield Case("config", ((key, value),))


def paired_cases(seed: int, count: int, arch: str = "llama") -> Iterator[Case]:
    """``count`` cases changing two keys at once (one file kind each), drawn with ``seed``."""
    rng = random.Random(seed)
    singles = [*gguf_cases(arch), *config_cases()]
    made = 0
    while made < count:
        first = rng.choice(singles)
        second = rng.choice([case for case in singles if case.kind == first.kind])
        if first.changes[0][0] != second.changes[0][0]:
            yield Case(first.kind, first.changes + second.changes)
            made += 1


def all_cases(count: int, seed: int = 0) -> list[Case]:
    """Every single-key case, then seeded pairs up to ``count`` cases (at least the singles)."""
    singles = [*gguf_cases(), *config_cases()]
    return singles + list(paired_cases(seed, max(0, count - len(singles))))


def spread(cases: list[Case], count: int) -> list[Case]:
    """``count`` cases spread evenly over ``cases`` (the same ones every run)."""
    if count >= len(cases):
        return cases
    step = len(cases) / count
    return [cases[int(i * step)] for i in range(count)]


def warmups(good_gguf: Path, good_folder: Path, root: Path) -> list[Path]:
    """The good files, and one whose model type no architecture has (its error imports the
    architecture fallbacks and lists their model types)."""
    unknown = write_case(Case("config", (("model_type", "no_such_model"),)), good_gguf, good_folder, root / "warm-unknown")
    return [good_gguf, good_folder, unknown]


def write_case(case: Case, good_gguf: Path, good_folder: Path, target: Path) -> Path:
    """The file (GGUF) or folder (``config.json`` and its weights) of ``case``, under ``target``."""
    if case.kind == "gguf":
        return rewrite_gguf(good_gguf, target.with_suffix(".gguf"), dict(case.changes))
    shutil.copytree(good_folder, target)
    config = json.loads((good_folder / "config.json").read_text())
    for key, value in case.changes:
        config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


def rewrite_gguf(
    source: Path, target: Path, metadata: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """``source`` with metadata keys set (the GGUF type picked from the Python value: bools,
    signed or unsigned 32/64-bit ints, float32, strings, arrays) and float32 tensors added or
    replaced."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=None)  # type: ignore[arg-type]
    changes = dict(metadata or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in changes:
            continue
        value, kind = field.contents(), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for key, value in changes.items():
        add_value(writer, key, value)
    replaced = dict(tensors or {})
    for tensor in reader.tensors:
        if tensor.name not in replaced:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    for name, array in replaced.items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


CHILD = textwrap.dedent(
    """
    import json, resource, sys, traceback
    import mlx.core as mx
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.errors import MlxrError, ModelLoadError
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def load(path, forward):
        before = peak()
        try:
            loaded = load_model(ModelConfig(path=path), registries)
            outcome = {"result": "loaded"}
            if forward:
                logits = loaded.model(mx.array([[1, 2]], dtype=mx.int32))
                if not bool(mx.all(mx.isfinite(logits))):
                    outcome = {"result": "garbage", "message": "non-finite logits"}
        except ModelLoadError as exc:
            outcome = {"result": "error", "message": str(exc), "key": exc.key, "tensor": exc.tensor}
        except MlxrError as exc:  # e.g. an architecture nobody implements: says which, lists the rest
            outcome = {"result": "error", "message": str(exc), "key": "model_type", "tensor": None}
        except BaseException as exc:
            outcome = {"result": "unexpected", "message": "".join(traceback.format_exception(exc))}
        return {**outcome, "grew": peak() - before}

    request = json.loads(sys.stdin.read())
    for path in request["warmups"]:  # what the first of each kind of load imports
        load(path, True)
    for path in request["paths"]:
        print(json.dumps({"path": path, "started": True}), flush=True)
        print(json.dumps({"path": path, **load(path, request["forward"])}), flush=True)
    """
)


def load_in_child(
    warmups: list[Path], paths: list[Path], *, forward: bool = False, timeout: float = 600
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Outcomes per path of loading each in one child process (after ``warmups``, which set the
    memory baseline: what the first load of each kind imports is not the file's), and, when the
    child died, which path it died on and how."""
    request = {"warmups": [str(w) for w in warmups], "paths": [str(path) for path in paths], "forward": forward}
    process = subprocess.run(
        [sys.executable, "-c", CHILD], input=json.dumps(request), capture_output=True, text=True, timeout=timeout
    )
    outcomes: dict[str, dict[str, Any]] = {}
    last = None
    for line in process.stdout.splitlines():
        record = json.loads(line)
        if record.pop("started", False):
            last = record["path"]
        else:
            outcomes[record["path"]] = record
    death = None
    if process.returncode != 0:
        death = f"the loading process died ({process.returncode}) on {last}:\n{process.stderr[-2000:]}"
    return outcomes, death


def problems(cases: dict[Path, Case], outcomes: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong in ``outcomes``: an internal error, non-finite logits from a model that
    loaded, an error that names neither a key nor a tensor or not the file, a load whose peak
    memory grew past twice the file (plus :data:`MEMORY_SLACK`)."""
    found = []
    for path, case in cases.items():
        outcome = outcomes.get(str(path))
        if outcome is None:
            found.append(f"{case.name}: no outcome")
            continue
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        if outcome["result"] in ("unexpected", "garbage"):
            found.append(f"{case.name}: {outcome['result']}: {outcome['message'][-600:]}")
        elif outcome["result"] == "error" and (
            not (outcome.get("key") or outcome.get("tensor")) or str(path) not in outcome["message"]
        ):
            found.append(f"{case.name}: an error naming no key, tensor or file: {outcome['message']}")
        if outcome["grew"] > 2 * size + MEMORY_SLACK:
            found.append(f"{case.name}: peak memory grew by {outcome['grew']} bytes for a file of {size}")
    return found
