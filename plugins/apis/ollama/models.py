"""Served models as Ollama describes them: ``/api/tags``, ``/api/show`` and ``/api/ps`` entries.

Ollama's ``digest`` is the hash of a model's manifest; mlxr has no manifest, so it is a stable hash
of the model's name, path and load time (it identifies, it does not verify).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time

from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.lifecycle import ModelSlot
from mlxr_plugins.apis.ollama import schemas as s
from mlxr_plugins.apis.ollama.streaming import rfc3339

#: ``expires_at`` of a model that stays loaded until the server stops.
NEVER = "9999-12-31T23:59:59Z"
#: The same instant in seconds: a ``keep_alive`` reaching past it (``1e300``) expires never too,
#: where formatting the date would overflow.
NEVER_EPOCH = 253402300799.0
DTYPE_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def listed(info: ModelInfo) -> s.ListedModel:
    return s.ListedModel(
        name=info.name, model=info.name, modified_at=rfc3339(info.created), size=_size(info),
        digest=digest(info), details=details(info),
    )


def listed_adapter(name: str, base: str, info: ModelInfo | None) -> s.ListedModel:
    """A LoRA adapter served as a model of its own (``models[].adapters``, ``/api/create``): its
    model's details with ``parent_model``; ``size`` 0 (its bytes are counted in its model's)."""
    known = details(info) if info is not None else s.ModelDetails(format="", family="", families=[],
                                                                   parameter_size="", quantization_level="")  # fmt: skip
    known.parent_model = base
    digest = hashlib.sha256(f"{name}\0{base}".encode()).hexdigest()
    modified = rfc3339(info.created) if info is not None else rfc3339(0.0)
    return s.ListedModel(name=name, model=name, modified_at=modified, size=0, digest=digest, details=known)


def listed_unloaded(slot: ModelSlot) -> s.ListedModel:
    """A model never loaded yet (``load: lazy``): what its file says; details come with its load."""
    modified, size = 0.0, 0
    with contextlib.suppress(OSError):
        modified, size = slot.path.stat().st_mtime, slot.footprint
    unknown = s.ModelDetails(format="", family="", families=[], parameter_size="", quantization_level="")
    digest = hashlib.sha256(f"{slot.name}\0{slot.path}".encode()).hexdigest()
    return s.ListedModel(name=slot.name, model=slot.name, modified_at=rfc3339(modified), size=size,
                         digest=digest, details=unknown)  # fmt: skip


def running(info: ModelInfo, slot: ModelSlot) -> s.RunningModel:
    """A loaded model: ``size`` is what it counts for (weights, KV reserve, prefix cache: see
    :mod:`mlxr_core.engine.lifecycle`), ``expires_at`` when it unloads if no request comes."""
    from mlxr_core.kernels import current_platform

    # The weights' bytes in memory (the reserve the memory budget counts for its KV cache and
    # prefix cache is not memory the model holds).
    resident = info.nbytes or _size(info)
    on_gpu = current_platform()[0] == "gpu"
    expires = slot.expires_at(time.monotonic())
    return s.RunningModel(
        name=info.name, model=info.name, size=resident, digest=digest(info), details=details(info),
        expires_at=NEVER if expires is None or expires >= NEVER_EPOCH else rfc3339(expires),
        size_vram=resident if on_gpu else 0,
        context_length=info.context_length,
    )


def shown(info: ModelInfo) -> s.ShowResponse:
    family = info.model_type
    model_info = {
        "general.architecture": family,
        "general.name": str(info.metadata.get("name") or info.name),
        f"{family}.context_length": info.context_length,
    }
    if info.parameters:
        model_info["general.parameter_count"] = info.parameters
    return s.ShowResponse(
        modelfile="", parameters="", template=info.tokenizer.chat_template or "", details=details(info),
        model_info=model_info, capabilities=info.capabilities, modified_at=rfc3339(info.created),
    )


def details(info: ModelInfo) -> s.ModelDetails:
    return s.ModelDetails(
        format=info.format, family=info.model_type, families=[info.model_type],
        parameter_size=parameter_size(info.parameters), quantization_level=quantization_level(info),
    )  # fmt: skip


def parameter_size(count: int) -> str:
    """A parameter count as Ollama's ``format.HumanNumber`` writes it (``134.52M``, ``8.0B``);
    empty when unknown."""
    if count <= 0:
        return ""
    for scale, suffix, digits in ((1e12, "T", 1), (1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if count >= scale:
            number = count / scale
            return f"{number:.0f}{suffix}" if number == int(number) else f"{number:.{digits}f}{suffix}"
    return str(count)


def quantization_level(info: ModelInfo) -> str:
    """``Q4_1`` from a GGUF's file type, else the served dtype (``F32``, ``BF16``)."""
    file_type = info.metadata.get("file_type")
    if isinstance(file_type, int):
        import gguf

        try:
            name = gguf.LlamaFileType(file_type).name
        except ValueError:
            return ""
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return DTYPE_LEVELS.get(info.dtype, info.dtype.upper())


def digest(info: ModelInfo) -> str:
    return hashlib.sha256(f"{info.name}\0{info.path}\0{info.created}".encode()).hexdigest()


def _size(info: ModelInfo) -> int:
    """Bytes of the model file (Ollama's ``size``), else of its resident weights."""
    try:
        if os.path.isfile(info.path):
            return os.path.getsize(info.path)
    except OSError:
        pass
    return info.nbytes
