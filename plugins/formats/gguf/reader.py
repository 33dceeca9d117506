"""Reading a GGUF file: its header, metadata and tensors, each tensor into MLX arrays.

The ``gguf`` package parses the file (memory-mapped) and dequantizes what MLX cannot hold exactly;
Q4_0/Q4_1/Q8_0 blocks are repacked bit-exactly into MLX affine quantization (see
:mod:`mlxr_plugins.formats.gguf.quants`), Q5_0/Q5_1/Q4_K/Q5_K through their exact 32-element
groups, and MXFP4 into MLX's ``mxfp4`` mode. Names and configs are the business of
:mod:`~mlxr_plugins.formats.gguf.names` and :mod:`~mlxr_plugins.formats.gguf.arch_settings`.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import attrs
import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QType

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import HostPart, QuantSpec, Shard, StoredPart, StoredTensor
from mlxr_plugins.formats.gguf.quants import (
    EXACT_BITS,
    GROUP_SIZE,
    repack,
    repack_mxfp4,
    unpermute_rows,
)

MAGIC = b"GGUF"
#: Stored as plain floats: read as they are, cast to the model dtype.
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class _Reader(gguf.GGUFReader):
    """``GGUFReader``, faster, and naming the tensor whose data does not fit in the file."""

    # The reader slices its np.memmap once per metadata item (~250k times for a 49k-token vocab);
    # every memmap slice pays for memmap.__array_finalize__. A plain ndarray view of the same
    # mapping reads the same bytes, still lazily, about 3.5x faster.
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[Any]]:
        """Arrays of scalars in one read, arrays of strings in a tight loop: the base class walks
        every element through several numpy views (8 s for Gemma's 262k-token vocabulary).
        ``contents()`` reads the same values either way."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_raw = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item_type = gguf.GGUFValueType(int(item_raw[0]))
        start, n = orig_offs + 12, int(count[0])
        types = [gguf.GGUFValueType.ARRAY, item_type]
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            values = self._get(start, scalar, n)
            if values.size != n:
                raise ValueError(f"an array of {n} values at offset {orig_offs} runs past the end")
            return 12 + int(values.nbytes), [item_raw, count, values], [2], types
        if item_type == gguf.GGUFValueType.STRING and n * 8 > len(self.data) - start:
            raise ValueError(f"an array of {n} strings at offset {orig_offs} runs past the end")
        if item_type != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, offs = self.data, start
        buffer = memoryview(data.data)  # the raw bytes, for struct
        parts: list[Any] = [item_raw, count]
        for _ in range(int(count[0])):
            (length,) = struct.unpack_from("<Q", buffer, offs)
            parts.append(data[offs + 8 : offs + 8 + length])
            offs += 8 + length
        if offs > len(data):
            raise ValueError(f"a string array at offset {orig_offs} runs past the end of the file")
        return offs - orig_offs, parts, list(range(2, len(parts))), types

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except Exception:
            for field in fields:  # only on failure: find the culprit
                try:
                    super()._build_tensors(start_offs, [field])
                except Exception as exc:
                    raise _TensorError(bytes(field.parts[1]).decode(errors="replace"), exc) from exc
            raise


class _TensorError(Exception):
    def __init__(self, tensor: str, cause: Exception):
        super().__init__(f"{tensor}: {cause}")
        self.tensor, self.cause = tensor, cause


def open_reader(path: Path) -> gguf.GGUFReader:
    """Parse ``path``'s header and tensor index (memory-mapped); raise ModelLoadError if corrupt."""
    if not detect(path):
        raise ModelLoadError(
            "not a GGUF file (it does not start with the magic bytes 'GGUF')", path=str(path)
        )
    try:
        return _Reader(path)
    except _TensorError as exc:
        raise ModelLoadError(
            f"truncated or corrupt GGUF: the tensor's data does not fit in the file "
            f"({path.stat().st_size} bytes): {exc.cause}",
            path=str(path),
            tensor=exc.tensor,
        ) from exc.cause
    except Exception as exc:
        raise ModelLoadError(
            f"corrupt GGUF header: {type(exc).__name__}: {exc}", path=str(path)
        ) from exc


def detect(path: Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata key, or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as exc:
        raise ValueError(f"metadata key {key!r} is unreadable: {type(exc).__name__}: {exc}") from exc
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # The shortest decimal of the stored float32 (1e-05, not 9.999999747378752e-06).
        value = float(str(np.float32(value)))
    return value


def _to_mx(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array).astype(dtype)


def _check_finite(array: np.ndarray, what: str, *, bf16_bits: bool = False) -> None:
    """Refuse a tensor holding NaN or infinity: a corrupt file, or one that would yield NaN logits."""
    # Raw bfloat16 bits: an all-ones exponent is infinity or NaN.
    finite = np.all((array & 0x7F80) != 0x7F80) if bf16_bits else np.isfinite(array).all()
    if not finite:
        raise ValueError(f"non-finite {what} (NaN or infinity)")


def _host_array(tensor: Any) -> np.ndarray:
    """A float tensor on the host: F32/F16 as stored, BF16 as its raw uint16 bits (numpy has no
    bfloat16), any other type dequantized to float32 by ``gguf``."""
    qtype = tensor.tensor_type
    if qtype in (QType.F32, QType.F16):
        return np.asarray(tensor.data)
    if qtype == QType.BF16:
        return np.ascontiguousarray(tensor.data).view("<u2")
    return gguf.quants.dequantize(tensor.data, qtype)


def tensor_share(tensor: Any, shard: Shard) -> np.ndarray | None:
    """The share ``shard`` of a matrix's data, copied out of the file's mapping (so only its pages
    are read), in the reader's layout: raw blocks of a quantized (or bfloat16) row are cut at whole
    blocks. None where the layout cannot be cut so (columns inside a block, a stack of experts)."""
    data = tensor.data
    if data.ndim > 2:
        return None
    # uint8 rows hold whole blocks (a block of one element for bfloat16); ranges count blocks.
    block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type][1] if data.dtype == np.uint8 else 1
    scale = block_bytes if shard.axis == 1 else 1
    try:
        ranges = shard.ranges(data.shape[shard.axis] // scale)
    except ValueError:
        return None
    pieces = [data[start * scale : stop * scale] if shard.axis == 0 else data[:, start * scale : stop * scale]
              for start, stop in ranges]  # fmt: skip
    return np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces, axis=shard.axis)


def check_vocabulary(reader: gguf.GGUFReader, config: dict[str, Any], path: Path) -> None:
    """Refuse an embedding with fewer rows than the tokenizer has tokens: ids past its end would
    read memory that is not the model's (llama.cpp refuses such files too)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    rows = config.get("vocab_size")
    if tokens is not None and isinstance(rows, int) and len(tokens.data) > rows:
        raise ModelLoadError(
            f"{rows} rows for the {len(tokens.data)} tokens of tokenizer.ggml.tokens",
            path=str(path),
            tensor="token_embd.weight",
        )


@attrs.frozen
class ReadTensors:
    """What the reader made of a file's tensors, by Hugging Face module name (where a family's
    weights function fixes them up in place)."""

    weights: dict[str, mx.array]
    #: Module -> how its ``weight``/``scales``/``biases`` are packed.
    quantization: dict[str, QuantSpec]
    #: Module -> the MLX format nearest to a dequantized block type.
    suggested: dict[str, QuantSpec]
    #: Module -> the file's storage type (``"Q4_K"``).
    source_types: dict[str, str]


def convert_tensor(
    tensor: Any,
    target: str,
    dtype: mx.Dtype,
    heads: int | None,
    quantization: dict[str, QuantSpec],
    shift: float = 0.0,
) -> dict[str, mx.array]:
    """One GGUF tensor -> the checkpoint arrays it becomes (``weight`` or ``weight, scales, biases``).
    ``shift`` is subtracted from a dense tensor in float32, before the cast to ``dtype``."""
    qtype = tensor.tensor_type
    if qtype in EXACT_BITS and target.endswith(".weight") and tensor.data.ndim >= 2:
        packed = repack(tensor.data, qtype)
        _check_finite(packed.scales, "block scales")
        _check_finite(packed.biases, "block minimums")
        parts = {"weight": packed.weight, "scales": packed.scales, "biases": packed.biases}
        if heads:
            parts = {key: unpermute_rows(value, heads) for key, value in parts.items()}
        module = target.removesuffix(".weight")
        quantization[module] = QuantSpec(bits=packed.bits, group_size=GROUP_SIZE)
        return {
            f"{module}.weight": mx.array(parts["weight"]),
            f"{module}.scales": _to_mx(parts["scales"], dtype),
            f"{module}.biases": _to_mx(parts["biases"], dtype),
        }
    if qtype == QType.MXFP4 and target.endswith(".weight") and tensor.data.ndim >= 2:
        weight, scales = repack_mxfp4(tensor.data)
        if (scales == 255).any():  # e8m0's NaN
            raise ValueError("non-finite block scales (NaN)")
        if heads:
            weight, scales = unpermute_rows(weight, heads), unpermute_rows(scales, heads)
        module = target.removesuffix(".weight")
        quantization[module] = QuantSpec(bits=4, group_size=32, mode="mxfp4")
        return {f"{module}.weight": mx.array(weight), f"{module}.scales": mx.array(scales)}
    host = _host_array(tensor)
    _check_finite(host, "values", bf16_bits=qtype == QType.BF16)
    if heads:
        host = unpermute_rows(host, heads)
    if qtype == QType.BF16:
        array = mx.array(host).view(mx.bfloat16)
        return {target: (array.astype(mx.float32) - shift if shift else array).astype(dtype)}
    if shift:
        host = host.astype(np.float32) - np.float32(shift)
    return {target: _to_mx(host, dtype)}


def host_parts(qtype: QType, data: np.ndarray, target: str) -> dict[str, HostPart]:
    """What :func:`convert_tensor` makes of a tensor (``data`` as ``GGUFReader`` exposes it),
    kept on the host (numpy only: it runs off the MLX thread), by part: ``weight``, ``scales``,
    ``biases`` of an exact packing, else ``weight`` alone. Never a tensor with permuted rows."""
    if qtype in EXACT_BITS and target.endswith(".weight") and data.ndim >= 2:
        packed = repack(data, qtype)
        _check_finite(packed.scales, "block scales")
        _check_finite(packed.biases, "block minimums")
        return {"weight": (packed.weight, "raw"), "scales": (packed.scales, "float"), "biases": (packed.biases, "float")}
    if qtype == QType.MXFP4 and target.endswith(".weight") and data.ndim >= 2:
        weight, scales = repack_mxfp4(data)
        if (scales == 255).any():  # e8m0's NaN
            raise ValueError("non-finite block scales (NaN)")
        return {"weight": (weight, "raw"), "scales": (scales, "raw")}
    if qtype == QType.BF16:
        bits = np.ascontiguousarray(data).view("<u2")
        _check_finite(bits, "values", bf16_bits=True)
        return {"weight": (bits, "bf16")}
    host = np.asarray(data) if qtype in (QType.F32, QType.F16) else gguf.quants.dequantize(data, qtype)
    _check_finite(host, "values")
    return {"weight": (host, "float")}


def left_tensor(tensor: Any, target: str, path: Path, quantization: dict[str, QuantSpec]) -> dict[str, StoredPart]:
    """A tensor left in the file (see :class:`~mlxr_core.model.checkpoint.LeavesTensors`): the
    checkpoint names it would have become, each a part of its stored bytes; its packing recorded
    in ``quantization`` as :func:`convert_tensor` records it."""
    qtype, data = tensor.tensor_type, tensor.data

    def decode(raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, HostPart]:
        return host_parts(qtype, raw.view(data.dtype).reshape(shape), target)

    place = StoredTensor(path, int(tensor.data_offset), int(tensor.n_bytes), tuple(data.shape), decode, tensor.name)
    module = target.removesuffix(".weight")
    if qtype in EXACT_BITS and target.endswith(".weight") and data.ndim >= 2:
        quantization[module] = QuantSpec(bits=EXACT_BITS[qtype], group_size=GROUP_SIZE)
        return {f"{module}.{part}": StoredPart(place, part) for part in ("weight", "scales", "biases")}
    if qtype == QType.MXFP4 and target.endswith(".weight") and data.ndim >= 2:
        quantization[module] = QuantSpec(bits=4, group_size=32, mode="mxfp4")
        return {f"{module}.{part}": StoredPart(place, part) for part in ("weight", "scales")}
    return {target: StoredPart(place)}
