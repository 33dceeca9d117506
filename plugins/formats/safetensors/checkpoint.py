"""Read a Hugging Face or mlx-lm folder into a :class:`~mlxr_core.model.checkpoint.Checkpoint`.

A folder holds ``config.json`` (read tolerantly), the weights as ``model.safetensors`` or as shards
listed in ``model.safetensors.index.json``, optionally ``generation_config.json`` (end-of-sequence
ids, default sampling) and the tokenizer files. MLX reads the safetensors files itself
(``mx.load``, each tensor when it is first evaluated); tensor names are kept exactly as stored.
Under tensor parallelism a split tensor is read as this process's share alone, from a read-only
mapping of its bytes (:func:`read_share`).

mlx-lm's quantized folders store each quantized module as a packed ``weight`` (uint32) with
``scales`` and ``biases``, and describe the packing in ``config.json``'s ``quantization`` block:
``group_size``, ``bits`` (and ``mode``) by default, overridden per module path by a dict or by
``false`` for a module left in float. Each packed module becomes one :class:`QuantSpec`.

Hugging Face's MXFP4 folders (gpt-oss: ``quantization_config.quant_method`` ``mxfp4``) store packed
tensors as ``*_blocks`` and ``*_scales``; MLX's ``mxfp4`` packing holds the same bytes, so they are
handed over packed too (:func:`repack_mxfp4`). Block-scaled FP8 folders (DeepSeek-V3's
``quant_method`` ``fp8``) are dequantized as they load (:mod:`.fp8`).
"""

from __future__ import annotations

import json
import logging
import re
import struct
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import (
    Checkpoint,
    HostPart,
    LeavePredicate,
    QuantSpec,
    Shard,
    ShardPlan,
    StoredPart,
    StoredTensor,
    TensorShards,
)
from mlxr_core.model.layers.config_eras import file_spellings
from mlxr_core.model.lora import AdapterCheckpoint
from mlxr_plugins.formats.safetensors import adapters, fp8
from mlxr_plugins.formats.safetensors.files import read_json
from mlxr_plugins.formats.safetensors.tokenizer import read_chat_template, tokenizer_spec

log = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
#: ``generation_config.json`` keys that are default sampling parameters.
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: Packings MLX's quantized modules understand.
QUANT_BITS = (2, 3, 4, 5, 6, 8)
#: Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
#: numpy's type for each safetensors dtype a share is read in; bfloat16 as its raw bits (numpy
#: has no bfloat16, nor has the ``safetensors`` package's numpy reader).
NUMPY_DTYPES = {
    "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "F16": "<f2", "BF16": "<u2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
}  # fmt: skip
#: The largest header the safetensors format allows.
MAX_HEADER_BYTES = 100_000_000
#: MLX dimensions are 32-bit signed integers.
MAX_DIM = 2**31 - 1


def model_folder(path: Path) -> Path | None:
    """The folder a model path points into: the path itself, or the folder of a weights file."""
    if path.is_dir():
        return path
    if path.is_file() and (path.suffix == ".safetensors" or path.name == INDEX):
        return path.parent
    return None


def token_ids(value: Any) -> list[int]:
    """``eos_token_id`` as configs write it (an int, a list of ints, or null) as a list."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def weight_files(folder: Path, path: Path) -> dict[Path, list[str] | None]:
    """Safetensors files to read -> the tensors the index places in each (None without an index).

    A sharded folder is read through its index and every shard it names must exist; otherwise
    ``model.safetensors``, else every ``*.safetensors`` file (Mistral's ``consolidated.*``, a second
    copy of the same weights under other names, is skipped when other files exist).
    """
    index = path if path.name == INDEX else folder / INDEX
    if path.is_file() and path.suffix == ".safetensors":
        return {path: None}
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError("the index has no weight_map", path=str(index))
        shards: dict[Path, list[str]] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(folder / str(shard), []).append(tensor)
        for shard, tensors in shards.items():
            if not shard.is_file():
                raise ModelLoadError(
                    f"missing shard: {INDEX} places {len(tensors)} tensors in it",
                    path=str(shard),
                    tensor=tensors[0],
                )
        return {shard: tensors for shard, tensors in sorted(shards.items())}
    if (folder / SINGLE_FILE).is_file():
        return {folder / SINGLE_FILE: None}
    found = sorted(folder.glob("*.safetensors"))
    preferred = [f for f in found if not f.name.startswith("consolidated")]
    if not found:
        raise ModelLoadError(
            f"no {SINGLE_FILE}, {INDEX} or other .safetensors file", path=str(folder)
        )
    return dict.fromkeys(preferred or found)


def read_weights(
    files: dict[Path, list[str] | None],
    dtype: mx.Dtype,
    shares: TensorShards | None = None,
    leave: LeavePredicate | None = None,
    left: dict[str, tuple[mx.array, StoredPart]] | None = None,
) -> tuple[dict[str, mx.array], dict[str, Path], dict[str, str], dict[str, int]]:
    """Every tensor of ``files`` (floats cast to ``dtype``), the file each came from, the
    ``__metadata__`` of the first file, and, with ``shares``, the bytes taken from the files for
    the tensors it splits (``read``) and what they hold whole (``whole``). Each tensor ``leave``
    accepts is left in its file, unread: ``left`` gets it (never evaluated) and its place."""
    weights: dict[str, mx.array] = {}
    origin: dict[str, Path] = {}
    metadata: dict[str, str] = {}
    shard_bytes = {"read": 0, "whole": 0}
    unsplit: list[str] = []
    headers = {file: check_header(file) for file in files}
    entries = {name: entry for header, _ in headers.values() for name, entry in header.items()}
    for file, expected in files.items():
        header, start = headers[file]
        try:
            loaded: Any = mx.load(str(file), format="safetensors", return_metadata=True)
        except Exception as exc:
            # MLX names the tensor whose header entry or data is bad; lift it into the error.
            named = re.search(r"[Tt]ensor '([^']*)'", str(exc))
            raise ModelLoadError(
                f"corrupt or truncated safetensors file: {exc}",
                path=str(file),
                tensor=named.group(1) if named else None,
            ) from exc
        arrays: dict[str, mx.array] = loaded[0]
        metadata = metadata or dict(loaded[1])
        for name in expected or []:
            if name not in arrays:
                raise ModelLoadError(
                    f"{INDEX} places this tensor here but the file lacks it",
                    path=str(file),
                    tensor=name,
                )
        for name, array in arrays.items():
            if name in origin:
                raise ModelLoadError(
                    f"the tensor is also in {origin[name].name}", path=str(file), tensor=name
                )
            origin[name] = file
            if leave is not None and left is not None and leave(name):
                entry = header[name]
                begin, end = entry["data_offsets"]
                place = StoredTensor(file, start + begin, end - begin, tuple(entry["shape"]),
                                     partial(decode_stored, entry["dtype"]), name)  # fmt: skip
                left[name] = (array, StoredPart(place))
                continue
            shard = shares(name) if shares is not None else None
            if shard is not None and array.ndim > shard.axis:  # a row-parallel bias is whole
                entry = header[name]
                share = read_share(file, start, entry, shard) if splits(entries, name, shard) else None
                shard_bytes["whole"] += array.nbytes
                shard_bytes["read"] += array.nbytes if share is None else share.nbytes
                if share is None:
                    unsplit.append(f"{name} ({entry['dtype']} {entry['shape']})")
                else:  # the whole tensor, never evaluated, is never read
                    array = mx.array(share)
                    array = array.view(mx.bfloat16) if entry["dtype"] == "BF16" else array
            if mx.issubdtype(array.dtype, mx.floating):
                if not mx.all(mx.isfinite(array)).item():
                    raise ModelLoadError(
                        "non-finite values (NaN or infinity) in the stored tensor",
                        path=str(file),
                        tensor=name,
                    )
                # FP8 block scales stay float32 until their weights are dequantized (fp8.py).
                array = array if name.endswith(fp8.SCALES) else array.astype(dtype)
            weights[name] = array
    if unsplit:
        log.info("%d tensors to split are read whole, their layout does not split there: %s%s",
                 len(unsplit), unsplit[0], ", ..." if len(unsplit) > 1 else "")  # fmt: skip
    return weights, origin, metadata, shard_bytes


def decode_stored(stored_dtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, HostPart]:
    """A left tensor's bytes as its one part, ``weight``: floats to be cast, bfloat16 as raw bits
    (numpy has none), integers (packed words, MLX's ``scales`` of mxfp4) as they are."""
    if stored_dtype not in NUMPY_DTYPES:
        raise ValueError(f"{stored_dtype} tensors cannot be read on demand")
    array = raw.view(NUMPY_DTYPES[stored_dtype]).reshape(shape)
    if stored_dtype in ("F16", "F32", "F64"):
        if not np.isfinite(array).all():
            raise ValueError("non-finite values (NaN or infinity) in the stored tensor")
        return {"weight": (array, "float")}
    if stored_dtype == "BF16":
        if not np.all((array & 0x7F80) != 0x7F80):
            raise ValueError("non-finite values (NaN or infinity) in the stored tensor")
        return {"weight": (array, "bf16")}
    return {"weight": (array, "raw")}


def splits(entries: dict[str, Any], name: str, shard: Shard) -> bool:
    """Whether tensor ``name`` and the other parts of its packing (``weight``, ``scales``,
    ``biases``), by their header ``entries``, all split by ``shard``: a packing is cut whole or
    not at all."""
    module, _, part = name.rpartition(".")
    parts = ("weight", "scales", "biases") if part in ("weight", "scales", "biases") else (part,)
    for entry in (entries.get(f"{module}.{other}") for other in parts):
        if entry is None:
            continue
        shape = entry["shape"]
        if not shard.axis < len(shape) <= 2:
            return False
        try:
            shard.ranges(shape[shard.axis])
        except ValueError:
            return False
    return True


def read_share(file: Path, start: int, entry: dict[str, Any], shard: Shard) -> np.ndarray | None:
    """``shard`` of the tensor of header ``entry`` (its data at ``start`` + its offsets in
    ``file``), copied out of a read-only mapping so that only its pages are read; None where it
    has no numpy type or no bytes. Call it where :func:`splits` holds."""
    shape, (begin, end) = tuple(entry["shape"]), entry["data_offsets"]
    if entry["dtype"] not in NUMPY_DTYPES or begin == end:
        return None
    ranges = shard.ranges(shape[shard.axis])
    data = np.memmap(file, dtype=NUMPY_DTYPES[entry["dtype"]], mode="r", offset=start + begin, shape=shape)
    pieces = [data[a:b] if shard.axis == 0 else data[:, a:b] for a, b in ranges]
    return np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces, axis=shard.axis)


def check_header(file: Path) -> tuple[dict[str, Any], int]:
    """Check a safetensors file's header against the file before MLX reads (and allocates) it:
    every tensor's dtype, its shape (non-negative 32-bit dimensions) and a byte range that is
    exactly its size and lies inside the file; returns the header and where the data starts.
    Raises ModelLoadError naming the file and tensor."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(
                    f"truncated safetensors file: {size} bytes, shorter than its 8-byte header "
                    "length", path=str(file),
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise ModelLoadError(
                    f"corrupt or truncated safetensors file: its header claims {length} bytes "
                    f"but the file has {size}", path=str(file),
                )
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ModelLoadError(f"unreadable safetensors header: {exc}", path=str(file)) from exc
    except RecursionError:
        raise ModelLoadError("the safetensors header nests too deeply", path=str(file)) from None
    if not isinstance(header, dict):
        raise ModelLoadError("the safetensors header is not a JSON object", path=str(file))
    data_bytes = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = {"path": str(file), "tensor": str(name)}
        if not isinstance(entry, dict):
            raise ModelLoadError("the header entry is not an object", **where)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ModelLoadError(f"unknown dtype {dtype!r}", **where)
        if not isinstance(shape, list) or not all(
            type(dim) is int and 0 <= dim <= MAX_DIM for dim in shape
        ):
            raise ModelLoadError(f"invalid shape {shape!r}", **where)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(offset) is int for offset in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise ModelLoadError(
                f"data offsets {offsets!r} outside the file's {data_bytes} data bytes", **where
            )
        expected = DTYPE_BYTES[dtype]
        for dim in shape:
            expected *= dim
        if offsets[1] - offsets[0] != expected:
            raise ModelLoadError(
                f"shape {shape} of {dtype} needs {expected} bytes but its data offsets "
                f"{offsets} hold {offsets[1] - offsets[0]}", **where,
            )
    return header, 8 + length


#: The packing of Hugging Face's MXFP4 tensors: e2m1 codes in groups of 32 with an e8m0 scale.
MXFP4 = QuantSpec(bits=4, group_size=32, mode="mxfp4")


def hf_quant_method(config: dict[str, Any]) -> str | None:
    """``quantization_config.quant_method`` of a Hugging Face folder (None for mlx-lm's, whose
    ``quantization`` block describes the packing)."""
    block = config.get("quantization_config")
    if config.get("quantization") is not None or not isinstance(block, dict):
        return None
    method = block.get("quant_method")
    return None if method is None else str(method)


def repack_mxfp4(weights: dict[str, mx.array], origin: dict[str, Path]) -> dict[str, QuantSpec]:
    """Hugging Face's MXFP4 tensors as MLX ``mxfp4`` modules, in ``weights`` itself; returns their
    packings. ``P_blocks`` (uint8 ``[..., rows, in / 32, 16]``: two e2m1 codes a byte, the earlier
    element in the low nibble) and ``P_scales`` (e8m0 exponents, uint8 ``[..., rows, in / 32]``)
    become module ``P``'s ``weight``, the same bytes as MLX's uint32 words ``[..., rows, in / 8]``,
    and ``scales`` as they are."""
    specs: dict[str, QuantSpec] = {}
    for name in sorted(name for name in weights if name.endswith("_blocks")):
        module = name.removesuffix("_blocks")
        where = {"path": str(origin[name]), "tensor": name}
        blocks, scales = weights[name], weights.get(f"{module}_scales")
        if scales is None:
            raise ModelLoadError(f"MXFP4 blocks without their {module}_scales", **where)
        if (
            blocks.dtype != mx.uint8
            or scales.dtype != mx.uint8
            or blocks.ndim < 3
            or blocks.shape[-1] != 16
            or blocks.shape[:-1] != scales.shape
        ):
            raise ModelLoadError(
                f"MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales {scales.dtype} "
                f"{list(scales.shape)} are not uint8 [..., groups, 16] and [..., groups]",
                **where,
            )
        del weights[name], weights[f"{module}_scales"]
        weights[f"{module}.weight"] = blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)
        weights[f"{module}.scales"] = scales
        specs[module] = MXFP4
    return specs


def quantization_specs(
    config: dict[str, Any], weights: dict[str, mx.array], origin: dict[str, Path], folder: Path
) -> dict[str, QuantSpec]:
    """A :class:`QuantSpec` for every packed module (one with ``scales`` next to its ``weight``),
    from ``config.json``'s ``quantization`` block; each packing is checked against the shapes."""
    block = config.get("quantization")
    hf_block = config.get("quantization_config")
    if block is None and isinstance(hf_block, dict):
        method = hf_block.get("quant_method")
        if method is not None:
            raise ModelLoadError(
                f"quantization_config.quant_method {method!r} is not supported (supported: MLX "
                f"quantization as mlx-lm writes it, mxfp4, fp8; dequantize the model or convert it)",
                path=str(folder / CONFIG),
            )
        block = hf_block  # some mlx-lm releases wrote only this spelling
    packed = sorted(name.removesuffix(".scales") for name in weights if name.endswith(".scales"))
    if not packed:
        return {}
    if not isinstance(block, dict):
        raise ModelLoadError(
            "the weights are packed (.scales tensors) but config.json has no quantization block",
            path=str(origin[f"{packed[0]}.scales"]),
            tensor=f"{packed[0]}.scales",
        )

    specs: dict[str, QuantSpec] = {}
    for module in packed:
        where = {"path": str(origin[f"{module}.scales"]), "tensor": f"{module}.weight"}
        params = block.get(module, block)
        if params is False:
            raise ModelLoadError(
                "config.json marks this module unquantized but it is packed", **where
            )
        try:
            spec = QuantSpec(
                bits=int(params["bits"]),
                group_size=int(params["group_size"]),
                mode=str(params.get("mode", "affine")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"unusable quantization parameters {params!r}", **where) from exc
        weight = weights.get(f"{module}.weight")
        scales = weights[f"{module}.scales"]
        if weight is None or weight.dtype != mx.uint32:
            raise ModelLoadError(
                "a packed module needs a uint32 weight next to its scales", **where
            )
        if spec.mode == "affine" and f"{module}.biases" not in weights:
            raise ModelLoadError("an affine-quantized module needs biases", **where)
        if f"{module}.global_scale" in weights:
            # mlx-lm's nvfp4 experts with one float32 scale per expert over the e4m3 ones
            # (``mlx_lm.convert --global-scale``): the kernel ops take no such second scale.
            raise ModelLoadError(
                f"quantization.mode {spec.mode!r} with a per-tensor global_scale is not supported "
                "(the quantized_matmul / gather_matmul kernels take one scale per group); convert "
                "the model without a global scale",
                path=where["path"], tensor=f"{module}.global_scale", key="quantization.mode",
            )
        columns = scales.shape[-1] * spec.group_size
        if spec.bits not in QUANT_BITS or weight.shape[-1] * 32 != columns * spec.bits:
            raise ModelLoadError(
                f"packed weight of shape {list(weight.shape)} does not fit {spec.bits}-bit groups of "
                f"{spec.group_size} with scales of shape {list(scales.shape)}",
                **where,
            )
        specs[module] = spec
    return specs


class SafetensorsFormat:
    """Hugging Face safetensors folders, including mlx-lm's (quantized) ones."""

    name = "safetensors"

    def detect(self, path: Path) -> bool:
        """True for a folder holding safetensors weights (or such a file, or its index)."""
        folder = model_folder(Path(path))
        if folder is None:
            return False
        return (folder / INDEX).is_file() or any(folder.glob("*.safetensors"))

    def load(self, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """Read the folder: config, weights (floats as ``dtype``), quantization, tokenizer spec."""
        return self._read(Path(path), dtype, None)

    def detect_adapter(self, path: Path) -> bool:
        """True for a PEFT or mlx-lm LoRA adapter folder (:mod:`.adapters`)."""
        return adapters.detect(Path(path))

    def load_adapter(self, path: Path, *, base_config: dict[str, Any]) -> AdapterCheckpoint:
        """Read a PEFT or mlx-lm LoRA adapter folder."""
        return adapters.load(Path(path))

    def load_shards(self, path: Path, plan: ShardPlan, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`load`, each tensor ``plan`` splits read as this process's share: rows or
        columns, of a packing's ``weight``, ``scales`` and ``biases`` alike."""
        return self._read(Path(path), dtype, plan)

    def load_leaving(self, path: Path, leave: LeavePredicate, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`load`, each tensor ``leave`` accepts left in its file (its bytes as stored:
        floats, bfloat16, mlx-lm's packed words and their scales and biases)."""
        return self._read(Path(path), dtype, None, leave)

    def _read(self, path: Path, dtype: str, plan: ShardPlan | None, leave: LeavePredicate | None = None) -> Checkpoint:
        folder = model_folder(path)
        if folder is None:
            raise ModelLoadError("not a folder or .safetensors file", path=str(path))
        if dtype not in DTYPES:
            raise ModelLoadError(
                f"unsupported dtype {dtype!r} (use one of {', '.join(DTYPES)})", path=str(path)
            )
        if not (folder / CONFIG).is_file():
            raise ModelLoadError(
                f"no {CONFIG}: a safetensors model folder needs the config next to its weights",
                path=str(folder),
            )
        stored = read_json(folder / CONFIG)
        # The config as the file has it: each architecture's config class reads either
        # transformers era's spelling (mlxr_core.model.layers.config_eras); errors about a value
        # read under another key name the file's.
        config, keys = stored, file_spellings(stored)
        generation = self._generation_config(folder)

        files = weight_files(folder, path)
        shares = plan(config) if plan is not None else None
        if leave is not None and hf_quant_method(config) in ("mxfp4", "fp8"):
            raise ModelLoadError(f"{hf_quant_method(config)} weights are converted as they load and cannot "
                                 "be read on demand", path=str(folder / CONFIG), key="quantization_config")
        left: dict[str, tuple[mx.array, StoredPart]] = {}
        weights, origin, file_metadata, shard_bytes = read_weights(files, DTYPES[dtype], shares, leave, left)
        stored = {name: place for name, (_, place) in left.items()}
        sources: dict[str, str] = {}
        if hf_quant_method(config) == "mxfp4":
            quantization = repack_mxfp4(weights, origin)
        elif hf_quant_method(config) == "fp8":
            blocks = fp8.block_size(config, folder / CONFIG)
            sources = fp8.dequantize_fp8(weights, origin, blocks, DTYPES[dtype])
            quantization = {}
        else:
            unread = {name: array for name, (array, _) in left.items()}
            quantization = quantization_specs(config, {**weights, **unread}, origin, folder)

        eos_ids = sorted(
            {*token_ids(config.get("eos_token_id")), *token_ids(generation.get("eos_token_id"))}
        )
        tokenizer = tokenizer_spec(
            folder, eos_token_ids=eos_ids, vocab_size=config.get("vocab_size")
        )
        tokenizer_config = tokenizer.data.get("tokenizer_config", {}) if tokenizer else {}
        block = config.get("quantization")
        block = block if isinstance(block, dict) else {}
        return Checkpoint(
            path=folder,
            format=self.name,
            config=config,
            config_path=folder / CONFIG,
            config_keys=keys,
            weights=weights,
            quantization=quantization,
            suggested_quantization=dict.fromkeys(sources, fp8.SUGGESTED),
            source_types=sources,
            tokenizer=tokenizer,
            stored=stored,
            chat_template=read_chat_template(folder, tokenizer_config),
            metadata={
                "files": [file.name for file in files],
                "producer": "mlx-lm" if file_metadata.get("format") == "mlx" else None,
                "stored_dtype": config.get("torch_dtype", config.get("dtype")),
                "quantization": {
                    key: value
                    for key, value in block.items()
                    if key in ("bits", "group_size", "mode")
                },
                "eos_token_ids": eos_ids,
                "generation_defaults": {k: generation[k] for k in SAMPLING_KEYS if k in generation},
                "resident_bytes": sum(array.nbytes for array in weights.values()),
                **({"shard_bytes": shard_bytes} if plan is not None else {}),
            },
        )

    @staticmethod
    def _generation_config(folder: Path) -> dict[str, Any]:
        """``generation_config.json``, or nothing: it only refines defaults, so a broken one is
        reported and skipped rather than failing the load."""
        path = folder / GENERATION_CONFIG
        if not path.is_file():
            return {}
        try:
            return read_json(path)
        except ModelLoadError as exc:
            log.warning("ignoring %s", exc)
            return {}
