"""The neutral hand-off between a format plugin and an architecture plugin.

A format plugin reads files and produces a :class:`Checkpoint`: a tolerant config dict in Hugging Face
naming (``model_type``, ``hidden_size``, ``num_attention_heads`` ...), weights already named as the
architecture expects them (Hugging Face / mlx-lm names such as ``model.layers.0.self_attn.q_proj.weight``),
the quantization of each packed tensor, a tokenizer spec and the chat template. The architecture
never sees a file format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np


@attrs.frozen
class QuantSpec:
    """MLX quantization of one module: ``mode`` ``affine`` is ``w = scales * q + biases`` per
    group; ``mxfp4`` is e2m1 codes times a power-of-two scale per group of 32 (no biases)."""

    bits: int
    group_size: int
    mode: str = "affine"


@attrs.frozen
class Shard:
    """One process's share of a tensor split across ``size`` processes: along ``axis``, each of
    ``segments`` (lengths that sum to the axis: a fused projection's query, key and value rows;
    empty: the whole axis is one segment) is cut into ``size`` equal parts, and part ``rank`` of
    each is kept, in order."""

    axis: int
    size: int
    rank: int
    segments: tuple[int, ...] = ()

    def ranges(self, length: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges kept along ``axis`` of a tensor ``length`` long there;
        ValueError when its segments do not cut into ``size`` equal parts."""
        segments = self.segments or (length,)
        if sum(segments) != length or any(segment % self.size for segment in segments):
            raise ValueError(f"{length} entries in segments {list(segments)} do not split {self.size} ways")
        kept, start = [], 0
        for segment in segments:
            step = segment // self.size
            kept.append((start + self.rank * step, start + (self.rank + 1) * step))
            start += segment
        return kept


#: The share of each tensor, by its name in the checkpoint, this process reads; None: the whole.
TensorShards = Callable[[str], "Shard | None"]
#: Given a checkpoint's config as soon as the format has read it: that checkpoint's shares.
ShardPlan = Callable[[dict[str, Any]], TensorShards]


#: A host array a stored tensor decodes into and how it becomes an MLX array: ``float`` (cast to
#: the model dtype), ``bf16`` (raw bfloat16 bits, then cast) or ``raw`` (as it is: packed words).
HostPart = tuple["np.ndarray", str]


@attrs.frozen(eq=False)
class StoredTensor:
    """Where a tensor left in its file lies (``offset``, ``nbytes``: its data, absolute in
    ``file``) and how its bytes become arrays: ``decode(raw, shape)`` takes the bytes of a whole
    tensor, or of one row of a stack (``raw`` uint8, ``shape`` its stored shape), and returns its
    parts (``weight``, ``scales``, ``biases``; one, ``weight``, for a plain tensor) as
    :data:`HostPart`. Runs off the MLX thread: numpy only. ``shape`` is the stored shape; a
    stack of experts has them first."""

    file: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    decode: Callable[[np.ndarray, tuple[int, ...]], dict[str, HostPart]]
    #: The file's name for it (``blk.0.ffn_up_exps.weight``), for errors.
    name: str = ""

    def row(self, index: int, rows: int) -> tuple[int, int, tuple[int, ...]]:
        """``(offset, nbytes, shape)`` of row ``index`` of ``rows`` equal rows stacked first."""
        size = self.nbytes // rows
        return self.offset + index * size, size, self.shape[1:]


@attrs.frozen
class StoredPart:
    """A checkpoint tensor left in its file: part ``part`` of what :attr:`StoredTensor.decode`
    returns for ``source``."""

    source: StoredTensor
    part: str = "weight"


@attrs.define
class TokenizerSpec:
    """What a tokenizer backend needs to build a tokenizer.

    ``kind`` selects the backend in the tokenizer registry (``"gguf"``, ``"hf"`` ...); ``data`` is
    whatever that backend needs (for GGUF: the ``tokenizer.ggml.*`` metadata; for HF: file paths).
    """

    kind: str
    data: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Checkpoint:
    """A loaded checkpoint, ready for an architecture to build a model around it."""

    path: Path
    format: str
    config: dict[str, Any]
    weights: dict[str, mx.array]
    #: module path (``model.layers.0.mlp.up_proj``) -> how its ``weight``/``scales``/``biases`` are packed.
    quantization: dict[str, QuantSpec] = attrs.field(factory=dict)
    #: module path -> the MLX format nearest to the quantized source of a *dense* ``weight`` (a block
    #: type MLX cannot hold exactly, handed over dequantized); used when the policy keeps weights packed.
    suggested_quantization: dict[str, QuantSpec] = attrs.field(factory=dict)
    #: module path -> the source's storage type (``"Q4_K"``, ``"F32"`` ...), for load reports.
    source_types: dict[str, str] = attrs.field(factory=dict)
    tokenizer: TokenizerSpec | None = None
    chat_template: str | None = None
    #: Anything else worth reporting (file type, per-type tensor counts, ...).
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: The file ``config`` was read from (``config.json``), when it is not ``path`` itself.
    config_path: Path | None = None
    #: config key -> the metadata key (or tensor, ``*.weight``) the format read it from, where the
    #: file spells it otherwise (GGUF: ``num_hidden_layers`` -> ``llama.block_count``); errors
    #: about a config value name the file's key.
    config_keys: dict[str, str] = attrs.field(factory=dict)
    #: Weight name -> the tensor the file names it, where the file spells it otherwise (an
    #: mmproj's ``v.blk.0.attn_q.weight``); errors about a weight name the file's tensor.
    tensor_names: dict[str, str] = attrs.field(factory=dict)
    #: The file the vision tower and projector came from, when it is not ``path`` (an mmproj).
    vision_path: Path | None = None
    #: The image processor's settings in ``preprocessor_config.json``'s naming, where the
    #: checkpoint carries them in another file (an mmproj's ``clip.vision.image_mean``); None: the
    #: folder's ``preprocessor_config.json``, if any.
    preprocessor: dict[str, Any] | None = None
    #: Tensors the format left in their files (read on demand: streamed experts), by the name
    #: they would have had in :attr:`weights`; see :class:`LeavesTensors`.
    stored: dict[str, StoredPart] = attrs.field(factory=dict)


class Format(Protocol):
    """A checkpoint format, registered through ``mlxr_register_formats``."""

    #: Registry name, e.g. ``"gguf"``.
    name: str

    def detect(self, path: Path) -> bool:
        """Return True if ``path`` (a file or a folder) is in this format. Must be cheap."""
        ...

    def load(self, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """Read ``path`` into a :class:`Checkpoint`; raise ModelLoadError naming file and tensor."""
        ...


@runtime_checkable
class ReadsProjector(Protocol):
    """An optional capability of a :class:`Format`: a vision tower and projector kept in a file of
    its own beside a text checkpoint (llama.cpp's ``mmproj``), chosen by ``models[].mmproj``."""

    def load_projector(self, checkpoint: Checkpoint, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """``checkpoint`` with the tower and projector of ``path`` added as a multimodal checkpoint
        of its family holds them (its config's ``vision_config`` ..., its weights' names), and
        :attr:`Checkpoint.vision_path` set. Raises ModelLoadError naming ``path`` and the tensor or
        key when the file is corrupt or does not fit the text model."""
        ...


@runtime_checkable
class ReadsShards(Protocol):
    """An optional capability of a :class:`Format`: under tensor parallelism, reading from the
    file only this process's share of the tensors split across processes."""

    def load_shards(self, path: Path, plan: ShardPlan, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`Format.load`, but each tensor ``plan(config)`` gives a :class:`Shard` is read
        as that share alone, where its layout allows (the others whole, the loader slices them);
        ``metadata["shard_bytes"]`` is ``{"read": ..., "whole": ...}``: the bytes taken from the
        file for the shares, and what the whole tensors hold."""
        ...


#: Whether a tensor, by its name in the checkpoint (as :attr:`Checkpoint.weights` would hold
#: it), is left in its file.
LeavePredicate = Callable[[str], bool]


@runtime_checkable
class LeavesTensors(Protocol):
    """An optional capability of a :class:`Format`: some tensors left in their files, unread,
    their places recorded (streamed experts, :mod:`mlxr_core.model.experts`)."""

    def load_leaving(self, path: Path, leave: LeavePredicate, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`Format.load`, but each tensor ``leave`` accepts is neither read nor checked: it
        is in :attr:`Checkpoint.stored`, not in :attr:`Checkpoint.weights`, with its bytes'
        place and a decoder giving what the load would have made of them (packed parts as
        :attr:`Checkpoint.quantization` says, floats to be cast to ``dtype``). Its quantization
        spec is recorded as for a loaded tensor. Raises ModelLoadError as :meth:`Format.load`
        does, and where a left tensor's storage has no such decoder (naming it)."""
        ...
