"""Everything a plugin author imports, from one module.

::

    from mlxr_core.plugin_api import RegisterName, hookimpl

The marker for hook implementations and the ``register`` callbacks' types; the contract of every
kind of plugin (``Format``, ``TokenizerBackend``, ``Architecture``, ``ArchitectureFallback``,
``KernelBackend``, a sampler's ``LogitsProcessor``, ``Decoder``, an API's ``ServerContext``,
``ToolParser``, ``ReasoningParser``, ``KVCacheMethod``) with its optional capabilities; the data
they are handed (``Checkpoint``, ``KernelSet``, ``SamplingParams``, ``LoadedModel`` ...), what the
lifecycle hooks observe, and the errors a plugin raises. Each name is the object where it is
defined (``mlxr_core.model.arch.Architecture`` ...); this module only gathers them.

``mlxr plugins`` imports every plugin's entry-point module and must not import MLX, so importing
this module is as cheap as the hook marker: a contract is imported from its own module when it is
first used (PEP 562), and a type checker sees plain imports. An entry-point module that names a
contract whose module needs MLX (``Decoder``, the caches, ``LoadedModel``) for types only imports
it under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import (
    ArchitectureUnavailable,
    ConfigError,
    EngineStopped,
    MlxrError,
    ModelLoadError,
    RequestError,
)
from mlxr_core.hookspecs import HOOK_API_VERSION, RegisterKernel, RegisterName, RegisterSection
from mlxr_core.plugins import Registries, hookimpl

if TYPE_CHECKING:
    from mlxr_core.chat.parsing import (
        ChannelParser,
        ReasoningParser,
        ReasoningStream,
        SpecialMarkup,
        Text,
        Tool,
        ToolCall,
        ToolParser,
        ToolStream,
    )
    from mlxr_core.config.schema import KVCacheConfig
    from mlxr_core.engine.client import EngineClient
    from mlxr_core.engine.decoding import (
        Decoder,
        DraftStats,
        LogitsProcessor,
        RequestSampler,
        SamplerContext,
    )
    from mlxr_core.engine.request import SamplingParams
    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.errors import exception_handlers
    from mlxr_core.kernels import OPS, KernelBackend, KernelContext, KernelSet
    from mlxr_core.model.arch import (
        Architecture,
        ArchitectureFallback,
        ChecksLoadedModel,
        DefaultChatTemplate,
        RenamesModules,
    )
    from mlxr_core.model.cache import (
        BatchLayerCache,
        KVCache,
        LayerCache,
        RecurrentCache,
        StateCache,
    )
    from mlxr_core.model.checkpoint import (
        Checkpoint,
        Format,
        QuantSpec,
        ReadsProjector,
        ReadsShards,
        Shard,
        TokenizerSpec,
    )
    from mlxr_core.model.kv_storage import KVCacheMethod, KVStorage
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.quantized_cache import PackedCache
    from mlxr_core.model.tokenizer import Tokenizer, TokenizerBackend, WritesHFFiles
    from mlxr_core.model.vision import (
        DraftsImages,
        ImageProcessor,
        ImageTokens,
        ProvidesVision,
        VisionArchitecture,
    )

#: Where each contract is defined; imported from there on first use.
_LAZY = {
    name: module
    for module, names in {
        "mlxr_core.config.schema": ("KVCacheConfig",),
        "mlxr_core.engine.decoding": (
            "Decoder", "DraftStats", "LogitsProcessor", "RequestSampler", "SamplerContext",
        ),
        "mlxr_core.engine.client": ("EngineClient",),
        "mlxr_core.engine.request": ("SamplingParams",),
        "mlxr_core.http.context": ("ServerContext",),
        "mlxr_core.http.errors": ("exception_handlers",),
        "mlxr_core.kernels": ("OPS", "KernelBackend", "KernelContext", "KernelSet"),
        "mlxr_core.model.arch": (
            "Architecture", "ArchitectureFallback", "ChecksLoadedModel", "DefaultChatTemplate",
            "RenamesModules",
        ),
        "mlxr_core.model.cache": (
            "BatchLayerCache", "KVCache", "LayerCache", "RecurrentCache", "StateCache",
        ),
        "mlxr_core.model.checkpoint": (
            "Checkpoint", "Format", "QuantSpec", "ReadsProjector", "ReadsShards", "Shard",
            "TokenizerSpec",
        ),
        "mlxr_core.model.kv_storage": ("KVCacheMethod", "KVStorage"),
        "mlxr_core.model.loader": ("LoadedModel",),
        "mlxr_core.model.quantized_cache": ("PackedCache",),
        "mlxr_core.model.tokenizer": ("Tokenizer", "TokenizerBackend", "WritesHFFiles"),
        "mlxr_core.model.vision": (
            "DraftsImages", "ImageProcessor", "ImageTokens", "ProvidesVision", "VisionArchitecture",
        ),
        "mlxr_core.chat.parsing": (
            "ChannelParser", "ReasoningParser", "ReasoningStream", "SpecialMarkup", "Text", "Tool",
            "ToolCall", "ToolParser", "ToolStream",
        ),
    }.items()
    for name in names
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "HOOK_API_VERSION",
    "OPS",
    "Architecture",
    "ArchitectureFallback",
    "ArchitectureUnavailable",
    "BatchLayerCache",
    "ChannelParser",
    "Checkpoint",
    "ChecksLoadedModel",
    "ConfigError",
    "Decoder",
    "DefaultChatTemplate",
    "DraftStats",
    "DraftsImages",
    "EngineClient",
    "EngineStopped",
    "Format",
    "ImageProcessor",
    "ImageTokens",
    "KVCache",
    "KVCacheConfig",
    "KVCacheMethod",
    "KVStorage",
    "KernelBackend",
    "KernelContext",
    "KernelSet",
    "LayerCache",
    "LoadedModel",
    "LogitsProcessor",
    "MlxrError",
    "ModelLoadError",
    "PackedCache",
    "ProvidesVision",
    "QuantSpec",
    "ReadsProjector",
    "ReadsShards",
    "ReasoningParser",
    "ReasoningStream",
    "RecurrentCache",
    "RegisterKernel",
    "RegisterName",
    "RegisterSection",
    "Registries",
    "RenamesModules",
    "RequestError",
    "RequestSampler",
    "SamplerContext",
    "SamplingParams",
    "ServerContext",
    "Shard",
    "SpecialMarkup",
    "StateCache",
    "Text",
    "Tokenizer",
    "TokenizerBackend",
    "TokenizerSpec",
    "Tool",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "VisionArchitecture",
    "WritesHFFiles",
    "exception_handlers",
    "hookimpl",
]
