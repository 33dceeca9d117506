"""The GGUF format: read a GGUF file into a :class:`~mlxr_core.model.checkpoint.Checkpoint`.

Three tables and a reader do the work: :mod:`~mlxr_plugins.formats.gguf.reader` parses the file
and converts each tensor (exact MLX quantization where a block type has one, ``dtype`` arrays for
the rest, with the MLX format nearest to them for the loader's quantization policy);
:mod:`~mlxr_plugins.formats.gguf.names` maps llama.cpp's tensor names to Hugging Face ones;
:mod:`~mlxr_plugins.formats.gguf.arch_settings` reads the config, a row per architecture.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from gguf import GGMLQuantizationType as QType

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import (
    Checkpoint,
    LeavePredicate,
    QuantSpec,
    ShardPlan,
    StoredPart,
    TokenizerSpec,
)
from mlxr_core.model.lora import AdapterCheckpoint
from mlxr_core.model.progress import track
from mlxr_plugins.formats.gguf.arch_settings import (
    config_keys,
    read_config,
    settings_of,
    shifted_norm,
)
from mlxr_plugins.formats.gguf.names import NOT_WEIGHTS, hf_name
from mlxr_plugins.formats.gguf.quants import EXACT_BITS, GROUP_SIZE, NEAREST_BITS
from mlxr_plugins.formats.gguf.reader import (
    DTYPES,
    FLOAT_TYPES,
    ReadTensors,
    check_vocabulary,
    convert_tensor,
    detect,
    field_value,
    left_tensor,
    open_reader,
    tensor_share,
)

log = logging.getLogger(__name__)

#: llama.cpp's ``general.sampling.*`` keys -> ``generation_config.json``'s names (the engine's
#: model sampling defaults, :func:`mlxr_core.engine.request.model_defaults`).
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}  # fmt: skip


class GGUFFormat:
    """llama.cpp's GGUF: one file holding metadata, tokenizer and (quantized) tensors."""

    name = "gguf"

    def detect(self, path: Path) -> bool:
        """True for a file that starts with the GGUF magic."""
        return Path(path).is_file() and detect(Path(path))

    def detect_adapter(self, path: Path) -> bool:
        """True for a llama.cpp LoRA GGUF (``general.type: adapter``)."""
        from mlxr_plugins.formats.gguf import adapters

        return adapters.is_adapter(Path(path))

    def load_adapter(self, path: Path, *, base_config: dict[str, Any]) -> AdapterCheckpoint:
        """Read a llama.cpp LoRA GGUF (:mod:`.adapters`)."""
        from mlxr_plugins.formats.gguf import adapters

        return adapters.load(Path(path), base_config)

    def load(self, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """Read ``path``: exact MLX quantization where a block type has one, ``dtype`` arrays for the rest."""
        return self._read(Path(path), dtype, None)

    def load_shards(self, path: Path, plan: ShardPlan, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`load`, each tensor ``plan`` splits read as this process's share: rows (whole
        heads, llama.cpp's rotary order undone per head) or input columns at whole blocks."""
        return self._read(Path(path), dtype, plan)

    def load_leaving(self, path: Path, leave: LeavePredicate, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`load`, each tensor ``leave`` accepts (by its Hugging Face name) left in the file,
        read later as :meth:`load` would convert it."""
        return self._read(Path(path), dtype, None, leave)

    def _read(self, path: Path, dtype: str, plan: ShardPlan | None, leave: LeavePredicate | None = None) -> Checkpoint:
        if dtype not in DTYPES:
            raise ModelLoadError(
                f"unsupported dtype {dtype!r} (use one of {', '.join(DTYPES)})", path=str(path)
            )
        reader = open_reader(path)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        try:
            config = read_config(reader, tensors)
        except ModelLoadError as exc:
            raise ModelLoadError(exc.detail, path=str(path), tensor=exc.tensor, key=exc.key) from exc
        except Exception as exc:
            raise ModelLoadError(f"unreadable model metadata: {exc}", path=str(path)) from exc
        check_vocabulary(reader, config, path)

        # llama.cpp's architecture (a Mixtral file says ``llama``), which its tensor layout follows.
        arch = field_value(reader, "general.architecture")
        family = settings_of(arch)
        permute: dict[str, int | None] = {}
        if family.permuted_rows:
            # A file without head counts fails in the architecture, naming the key.
            permute = {
                "attn_q": config.get("num_attention_heads"),
                "attn_k": config.get("num_key_value_heads"),
            }

        weights: dict[str, mx.array] = {}
        stored: dict[str, StoredPart] = {}
        quantization: dict[str, QuantSpec] = {}
        suggested: dict[str, QuantSpec] = {}
        source_types: dict[str, str] = {}
        counts: Counter[str] = Counter()
        shares = plan(config) if plan is not None else None
        shard_bytes: Counter[str] = Counter()
        unsplit: list[str] = []
        for name, tensor in track(tensors.items(), len(tensors), f"reading {path.name}"):
            counts[tensor.tensor_type.name] += 1
            if name.endswith(NOT_WEIGHTS):
                continue
            target = hf_name(name, arch)
            heads = permute.get(name.split(".")[2]) if name.startswith("blk.") else None
            shift = 1.0 if shifted_norm(name, arch) else 0.0
            shard = shares(target) if shares is not None else None
            source = tensor
            if shard is not None and tensor.data.ndim > shard.axis:  # a row-parallel bias is whole
                share = tensor_share(tensor, shard)
                shard_bytes["whole"] += tensor.data.nbytes
                shard_bytes["read"] += tensor.data.nbytes if share is None else share.nbytes
                if share is None:
                    unsplit.append(f"{name} ({tensor.tensor_type.name} {list(map(int, tensor.shape))})")
                else:
                    tensor = tensor._replace(data=share)
                    heads = heads // shard.size if heads and shard.axis == 0 else heads
            try:
                if leave is not None and leave(target) and not heads and not shift:
                    stored.update(left_tensor(tensor, target, path, quantization))
                    arrays = {}
                else:
                    arrays = convert_tensor(tensor, target, DTYPES[dtype], heads, quantization, shift)
            except Exception as exc:
                raise ModelLoadError(
                    f"cannot convert {tensor.tensor_type.name} tensor of shape "
                    f"{list(map(int, source.shape))}: {type(exc).__name__}: {exc}",
                    path=str(path),
                    tensor=name,
                ) from exc
            weights.update(arrays)
            if target.endswith(".weight") and tensor.data.ndim >= 2:
                module = target.removesuffix(".weight")
                source_types[module] = tensor.tensor_type.name
                if tensor.tensor_type not in (*EXACT_BITS, *FLOAT_TYPES, QType.MXFP4):
                    bits = NEAREST_BITS.get(tensor.tensor_type, 8)
                    suggested[module] = QuantSpec(bits=bits, group_size=GROUP_SIZE)

        if unsplit:
            log.info("%s: %d tensors to split are read whole, their layout does not split there: %s%s",
                     path.name, len(unsplit), unsplit[0], ", ..." if len(unsplit) > 1 else "")  # fmt: skip
        if family.weights is not None:
            try:
                family.weights(ReadTensors(weights, quantization, suggested, source_types), config)
            except ModelLoadError as exc:
                raise ModelLoadError(exc.detail, path=str(path), tensor=exc.tensor) from exc

        tokenizer = None
        try:
            if "tokenizer.ggml.model" in reader.fields:
                from mlxr_plugins.formats.gguf.tokenizer import tokenizer_data_from_reader

                tokenizer = TokenizerSpec(kind="gguf", data=tokenizer_data_from_reader(reader))
            chat_template = field_value(reader, "tokenizer.chat_template")
            name = field_value(reader, "general.name")
            file_type = field_value(reader, "general.file_type")
            generation = {ours: field_value(reader, f"general.sampling.{theirs}") for theirs, ours in SAMPLING_KEYS.items()}
        except Exception as exc:
            raise ModelLoadError(
                f"unreadable metadata: {type(exc).__name__}: {exc}", path=str(path)
            ) from exc
        return Checkpoint(
            path=path,
            format=self.name,
            config=config,
            config_keys=config_keys(arch),
            weights=weights,
            quantization=quantization,
            suggested_quantization=suggested,
            source_types=source_types,
            tokenizer=tokenizer,
            chat_template=chat_template,
            stored=stored,
            metadata={
                "name": name,
                "file_type": file_type,
                # The model's sampling defaults as llama.cpp writes them, named as generation_config.json's.
                "generation_defaults": {key: value for key, value in generation.items() if value is not None},
                "tensor_types": dict(counts),
                "dequantized_types": sorted({source_types[m] for m in suggested}),
                "resident_bytes": sum(array.nbytes for array in weights.values()),
                **({"shard_bytes": {"read": shard_bytes["read"], "whole": shard_bytes["whole"]}} if plan else {}),
            },
        )

    def load_projector(self, checkpoint: Checkpoint, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """``checkpoint`` with the vision tower and projector of llama.cpp's mmproj file ``path``
        (:mod:`mlxr_plugins.formats.gguf.mmproj`)."""
        from mlxr_plugins.formats.gguf.mmproj import load_projector

        return load_projector(checkpoint, Path(path), dtype)

    #: One tensor into the arrays it becomes (the mmproj reader converts its tensors through it).
    _convert = staticmethod(convert_tensor)
