"""Weight quantization policy: which tensors stay packed, which become dense, which are requantized.

A checkpoint hands over packed modules (``Checkpoint.quantization``: exact MLX affine layouts of
the file's blocks) and dense ones, some of which were dequantized from a block type MLX cannot hold
exactly (``Checkpoint.suggested_quantization`` names the nearest MLX format for those). The
``models[].quantization`` policy decides:

==============  ==============================================================================
policy          effect
==============  ==============================================================================
``dequantize``  every weight dense in the model dtype (exact; costs memory)
``keep``        exact layouts stay packed; non-exact sources requantized to their suggested format
``auto``        ``keep`` on a GPU, and on a CPU where the bound ``quantized_matmul`` backend reads
                packed weights fast (``keeps_packed``: ``cpu_native``); else ``dequantize``
                (MLX's own CPU quantized matmul is ~20x slower than dense through OpenBLAS)
``q8``/``q4``   every quantizable weight (Linear, Embedding) as MLX 8/4-bit, group 32; packed ones
                already in that format are kept as they are (no second rounding)
``q4_g64``      as ``q4`` with group 64 (smaller, less precise)
``nvfp4``       every quantizable weight as MLX ``nvfp4``: e2m1 values, an e4m3 scale per 16
``mxfp8``       ... as MLX ``mxfp8``: e4m3 values, a power-of-two (e8m0) scale per 32
``mxfp4``       ... as MLX ``mxfp4``: e2m1 values, a power-of-two (e8m0) scale per 32
``f16``/``bf16`` every weight dense in that dtype (activations keep the model dtype)
==============  ==============================================================================
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.checkpoint import QuantSpec

#: Policies that requantize everything to one MLX format.
UNIFORM = {
    "q8": QuantSpec(8, 32),
    "q4": QuantSpec(4, 32),
    "q4_g64": QuantSpec(4, 64),
    "nvfp4": QuantSpec(4, 16, "nvfp4"),
    "mxfp8": QuantSpec(8, 32, "mxfp8"),
    "mxfp4": QuantSpec(4, 32, "mxfp4"),
}
DENSE_DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16}


@attrs.define
class QuantizedWeights:
    """The weights to load, the modules to build packed, and what happened per source type."""

    weights: dict[str, mx.array]
    quantization: dict[str, QuantSpec]
    #: ``"Q4_K -> MLX 4-bit g32 (kept)"`` ... -> number of modules.
    report: Counter[str]


def describe(spec: QuantSpec) -> str:
    mode = "" if spec.mode == "affine" else f" {spec.mode}"
    return f"MLX {spec.bits}-bit{mode} g{spec.group_size}"


def apply_policy(
    policy: str,
    model: nn.Module,
    weights: dict[str, mx.array],
    quantization: Mapping[str, QuantSpec],
    suggested: Mapping[str, QuantSpec],
    source_types: Mapping[str, str],
    dtype: mx.Dtype,
    device: str,
    keeps_packed: bool = False,
) -> QuantizedWeights:
    """Apply ``policy`` (already validated by the config schema) to sanitized ``weights``;
    ``keeps_packed``: the model's quantized matmul is fast on packed weights on a CPU."""
    if policy == "auto":
        policy = "dequantize" if device == "cpu" and not keeps_packed else "keep"
    weights = dict(weights)
    packed = {m: spec for m, spec in quantization.items() if f"{m}.scales" in weights}
    target = UNIFORM.get(policy)
    out: dict[str, QuantSpec] = {}
    report: Counter[str] = Counter()

    for module, spec in packed.items():
        source = source_types.get(module, describe(spec))
        if policy == "keep" or spec == target:
            out[module] = spec
            report[f"{source} -> {describe(spec)} (kept)"] += 1
            continue
        weights[f"{module}.weight"] = _unpack(weights, module, spec, dtype)

    quantizable = {
        path for path, module in model.named_modules() if hasattr(module, "to_quantized")
    }
    for module in sorted(quantizable):
        weight = weights.get(f"{module}.weight")
        if weight is None or module in out:
            continue
        wanted = (
            target if target is not None else suggested.get(module) if policy == "keep" else None
        )
        if wanted is None or weight.ndim < 2 or weight.shape[-1] % wanted.group_size:
            continue
        source = source_types.get(module, _dtype_name(weight))
        weights.update(_pack(module, weight, wanted, dtype))
        out[module] = wanted
        report[f"{source} -> {describe(wanted)} (requantized)"] += 1

    if policy in DENSE_DTYPES:
        cast = DENSE_DTYPES[policy]
        weights = {
            name: array.astype(cast) if mx.issubdtype(array.dtype, mx.floating) else array
            for name, array in weights.items()
        }
    for module in sorted(set(source_types) | set(packed)):
        if module not in out and f"{module}.weight" in weights:
            source = source_types.get(module) or describe(packed[module])
            report[f"{source} -> dense {_dtype_name(weights[f'{module}.weight'])}"] += 1
    return QuantizedWeights(weights, out, report)


def refuse_unrunnable_modes(
    quantization: Mapping[str, QuantSpec],
    weights: Mapping[str, mx.array],
    kernels: KernelSet,
    *,
    path: str | None = None,
) -> None:
    """Raise ModelLoadError (key ``quantization.mode``) where a kept packing's mode is one the
    kernel bound for it (``gather_matmul`` for a stack of experts, else ``quantized_matmul``)
    cannot run here: such weights are refused, never silently dequantized."""
    asked: set[tuple[str, str]] = set()
    for module, spec in sorted(quantization.items()):
        weight = weights.get(f"{module}.weight")
        op = "gather_matmul" if weight is not None and weight.ndim > 2 else "quantized_matmul"
        if (op, spec.mode) in asked:
            continue
        asked.add((op, spec.mode))
        reasons = kernels.packing_reasons(op, spec.mode)
        if reasons:
            raise ModelLoadError(
                f"quantization.mode {spec.mode!r} (module {module}): the kernels.{op} backend "
                f"{kernels.chosen.get(op, '?')!r} cannot run it here: {'; '.join(reasons)} (choose "
                f"another kernels.{op} backend, or models[].quantization: dequantize)",
                path=path,
                key="quantization.mode",
            )


def _pack(module: str, weight: mx.array, spec: QuantSpec, dtype: mx.Dtype) -> dict[str, mx.array]:
    """``module``'s packed tensors: affine scales and biases in ``dtype``; the float modes'
    scales as MLX makes them (uint8 codes: e4m3 for ``nvfp4``, e8m0 exponents for ``mx*``)."""
    packed = mx.quantize(weight, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    if spec.mode != "affine":
        return {f"{module}.weight": packed[0], f"{module}.scales": packed[1]}
    return {
        f"{module}.weight": packed[0],
        f"{module}.scales": packed[1].astype(dtype),
        f"{module}.biases": packed[2].astype(dtype),
    }


def _unpack(weights: dict[str, Any], module: str, spec: QuantSpec, dtype: mx.Dtype) -> mx.array:
    packed, scales, biases = (
        weights.pop(f"{module}.{part}", None) for part in ("weight", "scales", "biases")
    )
    return mx.dequantize(
        packed, scales, biases, group_size=spec.group_size, bits=spec.bits, mode=spec.mode
    ).astype(dtype)


def _dtype_name(array: mx.array) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul is the model's ``quantized_matmul`` kernel (see
    :mod:`mlxr_core.kernels`), so the backend chosen in ``kernels:`` runs every packed linear layer.

    The kernel gets the input as one matrix of rows (``[B * L, K]``, a free reshape of a contiguous
    input): a batched decode step's ``[B, 1, K]`` would otherwise be B separate one-row products to
    MLX's CUDA ``quantized_matmul``, each reading the whole weight (H100, Llama-3.2-1B shapes, 32
    rows: ``bench/kernels/quantized_rows.py --pipelined``)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = packed_matmul(self, x)
        if "bias" in self:
            x = x + self["bias"]
        return x


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose :meth:`as_linear` (the LM head of a model with tied
    embeddings) is the model's ``quantized_matmul`` kernel, like :class:`KernelQuantizedLinear`."""

    def as_linear(self, x: mx.array) -> mx.array:
        return packed_matmul(self, x)


def packed_matmul(module: nn.Module, x: mx.array) -> mx.array:
    """``x @ W.T`` for a packed layer through its routed kernel, ``x`` as rows (see
    :class:`KernelQuantizedLinear`). Only an input with more than one matrix (``[B, L, K]`` with
    B > 1) is reshaped: a one-stream step's ``[1, 1, K]`` is one matrix already, and the two
    reshapes would be two primitives more per layer and token for MLX to replay and evaluate,
    which a one-token step on a GPU pays in host time."""
    layer: Any = module
    shape = x.shape
    rows = len(shape) > 2 and math.prod(shape[:-2]) > 1
    if rows:
        x = x.reshape(-1, shape[-1])
    out: mx.array = layer._quantized_matmul(
        x,
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )
    if rows:
        out = out.reshape(*shape[:-1], out.shape[-1])
    return out


#: Packed module classes and the routing subclass each becomes.
ROUTED: dict[type, type] = {
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
}


def route_quantized_linears(model: nn.Module, quantized_matmul: Any) -> int:
    """Make every ``nn.QuantizedLinear`` of ``model`` (and the ``as_linear`` of every
    ``nn.QuantizedEmbedding``: a tied LM head) call ``quantized_matmul``; returns how many.

    The layers keep their parameters: only their class changes, to a subclass adding no state.
    """
    count = 0
    for _, module in model.named_modules():
        routed = ROUTED.get(type(module))
        if routed is not None:
            module.__class__ = routed
            object.__setattr__(module, "_quantized_matmul", quantized_matmul)
            count += 1
    return count


def parameter_count(*modules: nn.Module) -> int:
    """The parameters ``modules`` hold, a packed weight counted as the values it holds
    (``32 / bits`` a uint32 word) and its quantization scales and biases not at all."""
    total = 0
    for module in modules:
        for _, leaf in module.named_modules():
            bits = int(getattr(leaf, "bits", 0) or 0)
            for key, value in leaf.items():
                if not isinstance(value, mx.array):
                    continue
                if bits and key in ("scales", "biases"):
                    continue
                packed = bits and key == "weight" and value.dtype == mx.uint32
                total += value.size * 32 // bits if packed else value.size
    return total
