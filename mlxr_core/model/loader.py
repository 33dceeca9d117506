"""The loading pipeline: model config -> checkpoint -> architecture -> kernels -> weights.

Runs on the engine thread (it creates MLX arrays). Every step that can fail raises an
:class:`~mlxr_core.errors.MlxrError` saying which file, tensor, plugin or key was at fault.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxr_core.errors import (
    ArchitectureUnavailable,
    ConfigError,
    MlxrError,
    ModelLoadError,
    UnknownArchitecture,
    UnsupportedFormat,
)
from mlxr_core.kernels import KernelSet, bind_kernels, current_platform
from mlxr_core.model.arch import (
    Architecture,
    ChecksLoadedModel,
    DefaultChatTemplate,
    RenamesModules,
)
from mlxr_core.model.checkpoint import (
    Checkpoint,
    Format,
    QuantSpec,
    ReadsProjector,
    ReadsShards,
    Shard,
    ShardPlan,
    TensorShards,
)
from mlxr_core.model.compiled import CompiledDecode, disagreement, eager_step, unsupported
from mlxr_core.model.fuse import fuse_model
from mlxr_core.model.kv_storage import KVStorage, configure_kv_storage
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mlp import route_gated_activations
from mlxr_core.model.paths import default_model_name, resolve_model_path, resolve_projector
from mlxr_core.model.quantize import apply_policy, route_quantized_linears
from mlxr_core.model.quantized_cache import quantize_caches
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_core.model.vision import Vision, load_vision

if TYPE_CHECKING:
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.plugins import Registries

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
T = TypeVar("T")


@attrs.define
class LoadedModel:
    """A model ready to run: the module, its tokenizer and how to make its caches."""

    name: str
    model: nn.Module
    tokenizer: Tokenizer
    arch: Architecture
    config: dict[str, Any]
    context_length: int
    kernels: KernelSet
    dtype: str
    path: Path
    format: str
    decoder: str = "plain"
    metadata: dict[str, Any] = attrs.field(factory=dict)
    created: int = attrs.field(factory=lambda: int(time.time()))
    #: The decode step compiled between attentions (``models[].compile_decode``), or None.
    compiled_decode: CompiledDecode | None = None
    #: How the architecture was chosen (:attr:`ArchChoice.reason`).
    arch_reason: str = ""
    #: Keys and values stored quantized (``models[].kv_cache``), or None for full precision.
    kv_cache: KVStorage | None = None
    #: The image processor, vision module and image tokens of a multimodal model, or None.
    vision: Vision | None = None

    def make_cache(self) -> list[Any]:
        caches = self.arch.make_cache(self.model)
        return caches if self.kv_cache is None else quantize_caches(caches, self.kv_cache)

    def decode(
        self, tokens: mx.array, caches: list[Any], mask: mx.array | None = None, shift: mx.array | None = None
    ) -> mx.array:
        """One decode step: ``[B]`` tokens, each the next of its row in ``caches`` (advanced in
        place) -> ``[B, vocab]`` logits; compiled when :attr:`compiled_decode` is set. ``shift``
        (``[B]``, or None for none) is what each row's rotary position adds to its cache position
        (M-RoPE's delta after images)."""
        if self.compiled_decode is not None:
            return self.compiled_decode(tokens, caches, mask, shift)
        return eager_step(self.model, tokens, caches, mask, shift)

    @property
    def nbytes(self) -> int:
        """The resident weights' bytes: the text model's and the vision side's (tower, projector)."""
        modules = [self.model] if self.vision is None else [self.model, self.vision.module]
        return sum(array.nbytes for module in modules for _, array in tree_flatten(module.parameters()))  # type: ignore[misc,union-attr,str-unpack]


def default_dtype() -> str:
    """float32 on CPU (float16 matmuls are pathologically slow there), bfloat16 on a GPU."""
    device, _ = current_platform()
    return "bfloat16" if device == "gpu" else "float32"


def dequantize_weights(
    weights: dict[str, mx.array], quantization: Mapping[str, QuantSpec], dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Unpack every quantized module's ``weight``/``scales``/``biases`` into a dense ``weight``."""
    dense = dict(weights)
    for module, spec in quantization.items():
        packed, scales, biases = (
            dense.pop(f"{module}.{part}", None) for part in ("weight", "scales", "biases")
        )
        if packed is None or scales is None:
            continue  # the architecture dropped this module (e.g. a tied lm_head)
        dense[f"{module}.weight"] = mx.dequantize(
            packed, scales, biases, group_size=spec.group_size, bits=spec.bits, mode=spec.mode
        ).astype(dtype)
    return dense


def attach_projector(checkpoint: Checkpoint, path: Path, registries: Registries, dtype: str) -> Checkpoint:
    """``checkpoint`` with the vision tower and projector file at ``path`` (``models[].mmproj``),
    read by the format that recognizes it; ConfigError when that format reads no projectors."""
    name, fmt = pick_format(path, registries)
    if not isinstance(fmt, ReadsProjector):
        raise ConfigError(f"{path}: the {name} format reads no projector files; models[].mmproj takes llama.cpp's "
                          "mmproj GGUF", field="models[].mmproj")
    log.info("%s: vision tower and projector from %s", checkpoint.path.name, path.name)
    return fmt.load_projector(checkpoint, path, dtype=dtype)


def pick_format(path: Path, registries: Registries, choice: str = "auto") -> tuple[str, Format]:
    """The format plugin named by ``choice``, or the first whose ``detect`` accepts ``path``."""
    if choice != "auto":
        return choice, registries.formats.get(choice)
    for name in registries.formats.names():
        fmt = registries.formats.get(name)
        if fmt.detect(path):
            return name, fmt
    raise UnsupportedFormat(
        f"{path}: no format plugin recognizes this model "
        f"(installed formats: {', '.join(registries.formats.names()) or 'none'})"
    )


@attrs.frozen
class ArchChoice:
    """The architecture a checkpoint loads through, and why (the startup log, ``mlxr info``)."""

    arch: Architecture
    #: ``"native"``, or the name of the architecture fallback serving it (``"mlx-lm"``).
    path: str
    #: One line: the plugin providing it, or what the fallback builds and what does not apply.
    reason: str


def choose_arch(checkpoint: Checkpoint, registries: Registries, choice: str = "auto") -> ArchChoice:
    """The architecture registered under the checkpoint's ``model_type`` (or ``choice``); else the
    first architecture fallback that serves that name (``mlxr_register_arch_fallbacks``), so a
    native architecture always wins. A ``choice`` naming a fallback sends the checkpoint's own
    ``model_type`` to it. Raises UnknownArchitecture listing the architectures and why each
    fallback declined."""
    model_type = checkpoint.config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"{model_type!r} is not a string", path=str(checkpoint.path), key="model_type")
    name = model_type if choice == "auto" else choice
    if not name:
        raise ModelLoadError(
            "the checkpoint names no model_type; set models[].arch", path=str(checkpoint.path), key="model_type"
        )
    if name in registries.archs:
        entry = registries.archs.entry(name)
        return ArchChoice(entry.load(), "native", f"native architecture {name!r} (plugin {entry.plugin})")
    fallbacks = list(registries.arch_fallbacks)
    why = f"no architecture plugin registers {name!r}"
    if name in registries.arch_fallbacks:
        fallbacks, why = [registries.arch_fallbacks.entry(name)], f"models[].arch is {name!r}"
        name = model_type
        if not name:
            raise ModelLoadError("the checkpoint names no model_type", path=str(checkpoint.path))
    declined = []
    for entry in fallbacks:
        label = entry.meta.get("label", entry.name)
        try:
            arch, note = entry.load().resolve({**checkpoint.config, "model_type": name})
        except ArchitectureUnavailable as exc:
            declined.append(f"{label}: {exc}")
            continue
        return ArchChoice(arch, entry.name, f"{label} ({why}): {note}")
    raise UnknownArchitecture(name, registries.archs.names(), declined, path=str(checkpoint.path))


def pick_arch(checkpoint: Checkpoint, registries: Registries, choice: str = "auto") -> Architecture:
    """The architecture of :func:`choose_arch`."""
    return choose_arch(checkpoint, registries, choice).arch


#: A layer's index in a weight name (``model.layers.12.mlp.up_proj.weight``).
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@contextlib.contextmanager
def naming_config(checkpoint: Checkpoint) -> Iterator[None]:
    """While an architecture reads ``checkpoint.config``: a ModelLoadError naming no file gets the
    config's file and the key as that file spells it (``llama.block_count``), and any other
    exception (a graph dividing by a value nothing checked) becomes a ModelLoadError naming the file."""
    where = str(checkpoint.config_path or checkpoint.path)
    try:
        yield
    except ModelLoadError as exc:
        if exc.path is not None:
            raise
        key = _file_key(checkpoint, exc.key)
        tensor = exc.tensor
        if tensor is None and key is not None and key.endswith(".weight"):
            key, tensor = None, key
        raise ModelLoadError(exc.detail, path=where, tensor=tensor, key=key) from exc
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        model_type = checkpoint.config.get("model_type")
        raise ModelLoadError(
            f"the {model_type} graph cannot be built from this config: {type(exc).__name__}: {exc}",
            path=where,
        ) from exc


def _file_key(checkpoint: Checkpoint, key: str | None) -> str | None:
    """``key`` (``rope_scaling.factor``, ``rope_freq_factors[3]``) as the checkpoint's file names it."""
    keys = checkpoint.config_keys
    if key is None or key in keys:
        return keys.get(key) if key else None
    root = re.split(r"[.\[]", key, maxsplit=1)[0]
    return keys[root] + key[len(root) :] if root in keys else key


def check_config(checkpoint: Checkpoint, arch: Architecture) -> None:
    """Check a checkpoint's config before anything is built from it: the layers it declares have
    weights, and the architecture reads it (its config class checks each value's type and range,
    :mod:`mlxr_core.model.layers.args`). Raises ModelLoadError naming the file, key and value."""
    config = checkpoint.config
    with naming_config(checkpoint):
        declared = config.get("num_hidden_layers")
        stored = {int(m[1]) for name in checkpoint.weights if (m := LAYER_INDEX.search(name))}
        if type(declared) is int and stored and declared > max(stored) + 1:
            raise ModelLoadError(
                f"{declared} layers declared, but the weights hold {max(stored) + 1}",
                key="num_hidden_layers",
            )
        arch.kernel_context(config)
        arch.context_length(config)


def renamed_modules(arch: Architecture, table: Mapping[str, T]) -> Mapping[str, T]:
    """``table`` (checkpoint module -> anything) under the names the architecture's ``sanitize``
    gives the modules (see :class:`~mlxr_core.model.arch.RenamesModules`)."""
    if not isinstance(arch, RenamesModules):
        return table
    return {new: value for module, value in table.items() for new in arch.sanitized_modules(module)}


def build_model(
    checkpoint: Checkpoint,
    arch: Architecture,
    kernels: KernelSet,
    quantization_policy: str = "auto",
    dtype: str = "float32",
    report: Counter[str] | None = None,
    *,
    tensor_group: Any = None,
    name: str | None = None,
) -> nn.Module:
    """The architecture's module holding ``checkpoint``'s weights under a quantization policy
    (:mod:`mlxr_core.model.quantize`), evaluated and in eval mode. What the policy did per source
    type is logged at debug level and added to ``report`` when given. With ``tensor_group``, the
    module holds this rank's share of the split layers (:mod:`mlxr_core.model.tensor_parallel`),
    cut before the weights are loaded, so the whole split tensors never reach it; ``name`` (the
    model's) is what a refusal to split names."""
    config = checkpoint.config
    with naming_config(checkpoint):
        model = arch.build(config, kernels)
    try:
        sanitized = arch.sanitize(checkpoint.weights, config)
    except ModelLoadError as exc:
        if exc.path is not None:
            raise
        raise ModelLoadError(exc.detail, path=str(checkpoint.path), tensor=exc.tensor) from exc
    result = apply_policy(
        quantization_policy,
        model,
        sanitized,
        renamed_modules(arch, checkpoint.quantization),
        renamed_modules(arch, checkpoint.suggested_quantization),
        renamed_modules(arch, checkpoint.source_types),
        DTYPES[dtype],
        current_platform()[0],
        keeps_packed=kernels.keeps_packed,
    )
    weights, quantization = result.weights, result.quantization
    for outcome, count in sorted(result.report.items()):
        log.debug("%s: %s: %d tensors", checkpoint.path.name, outcome, count)
    if report is not None:
        report.update(result.report)
    route_gated_activations(model, kernels.gated_activation)
    if quantization:

        def predicate(module_path: str, module: nn.Module) -> bool | dict[str, Any]:
            spec = quantization.get(module_path)
            if spec is None or not hasattr(module, "to_quantized"):
                return False
            return {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode}

        nn.quantize(model, class_predicate=predicate)
        route_quantized_linears(model, kernels.quantized_matmul)
    if tensor_group is not None:
        from mlxr_core.model.tensor_parallel import shard_model, shard_weights

        try:
            plan = shard_model(model, tensor_group, name=name or checkpoint.path.name)
        except ModelLoadError as exc:
            raise ModelLoadError(exc.detail, path=str(checkpoint.path), key=exc.key) from None
        weights = shard_weights(weights, plan, model)
    if current_platform()[1] == "cuda":
        # A weight that is a view into a larger tensor (experts split from a fused gate/up stack)
        # is copied out: MLX's CUDA ``gather_mm`` with sorted indices reads such a view at the wrong
        # offset (0.32.4: Gemma 4's experts, gpt-oss's fused GGUF layout). A weight that owns its
        # memory is passed through as it is. The copies and the fused tensors they came from are
        # both held until the load ends: such a checkpoint's split tensors count twice at its peak.
        weights = {key: mx.contiguous(value) for key, value in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        # mlx names the parameters that do not fit ("... for parameter NAME", "Missing 8 parameters: NAME, ...")
        named = re.search(r"\b((?:\w+\.)+(?:weight|bias|scales|biases))\b", str(exc))
        raise ModelLoadError(
            f"weights do not fit the {config.get('model_type')} graph: {exc}",
            path=str(checkpoint.path),
            tensor=named.group(1) if named else None,
        ) from exc
    mx.eval(model.parameters())
    model.eval()
    return model


def shard_plan(
    model_config: ModelConfig,
    registries: Registries,
    choices: Mapping[str, str],
    dtype: str,
    group: Any,
    name: str,
    path: Path,
    format_name: str,
) -> ShardPlan:
    """The :class:`ShardPlan` a format that reads shares follows: given the checkpoint's config,
    the architecture's module is built (its parameters never evaluated) and planned by
    :func:`~mlxr_core.model.tensor_parallel.plan_shards`, in the checkpoint's tensor names. A
    model that cannot be split is refused then, before its weights are read; a config the
    architecture cannot build reads every tensor whole, and the load reports why further on."""
    from mlxr_core.model.tensor_parallel import plan_shards

    def plan(config: dict[str, Any]) -> TensorShards:
        probe = Checkpoint(path=path, format=format_name, config=config, weights={})
        try:
            arch = pick_arch(probe, registries, model_config.arch)
            kernels = bind_kernels(registries.kernels, dtype=dtype, shapes=arch.kernel_context(config), choices=choices)
            with naming_config(probe):
                model = arch.build(config, kernels)
        except MlxrError as exc:
            log.debug("%s: reading every tensor whole: %s", path.name, exc)
            return lambda tensor: None
        try:
            shards = plan_shards(model, group.size(), group.rank(), name=name)
        except ModelLoadError as exc:  # refused before a byte of the weights is read
            raise ModelLoadError(exc.detail, path=str(path), key=exc.key) from None

        def share(tensor: str) -> Shard | None:
            module, _, part = tensor.rpartition(".")
            names = arch.sanitized_modules(module) if isinstance(arch, RenamesModules) else [module]
            return shards.get(f"{names[0]}.{part}") if len(names) == 1 else None

        return share

    return plan


def kv_quantization(
    model_config: ModelConfig, model: nn.Module, chosen: ArchChoice, name: str, registries: Registries
) -> KVStorage | None:
    """``models[].kv_cache`` for a built model (its method's storage), or None when unset. Raises
    ConfigError, naming the key, where the model cannot attend over a cache stored otherwise: an
    architecture fallback's layers (mlx-lm's own attention), attention layers that read their
    cache themselves (Gemma 4's shared keys), a setting the method refuses for this model (a head
    size that is not a multiple of ``group_size``)."""
    setting = model_config.kv_cache
    if setting is None:
        return None
    why = None
    layers = [module for _, module in model.named_modules() if isinstance(module, Attention)]
    if chosen.path != "native":
        why = f"it runs through the {chosen.path} architecture fallback, whose attention is not mlxr's"
    elif not layers or any(type(layer).attention is not Attention.attention for layer in layers):
        why = f"the {chosen.arch.__class__.__name__} architecture's attention reads its cache itself"
    if why is not None:
        raise ConfigError(f"model {name}: models[].kv_cache cannot apply: {why}; remove it", field="models[].kv_cache")
    return configure_kv_storage(setting, sorted({layer.head_dim for layer in layers}), registries, name)


def load_model(
    model_config: ModelConfig,
    registries: Registries,
    *,
    kernel_choices: Mapping[str, str] | None = None,
    tensor_group: Any = None,
    pipeline_group: Any = None,
) -> LoadedModel:
    """Load one configured model. ``kernel_choices`` are the global ``kernels:``; the model's
    own ``kernels:`` take precedence. With ``tensor_group`` (an ``mx.distributed.Group``), this
    rank keeps its share of the weights (:mod:`mlxr_core.model.tensor_parallel`); with
    ``pipeline_group``, its share of the layers (:mod:`mlxr_core.model.pipeline`)."""
    started = time.perf_counter()
    path = resolve_model_path(model_config.path)
    format_name, fmt = pick_format(path, registries, model_config.format)
    dtype = default_dtype() if model_config.dtype == "auto" else model_config.dtype
    name = model_config.name or default_model_name(path)
    choices = {**(kernel_choices or {}), **model_config.kernels}
    if tensor_group is not None and isinstance(fmt, ReadsShards):
        plan = shard_plan(model_config, registries, choices, dtype, tensor_group, name, path, format_name)
        checkpoint = fmt.load_shards(path, plan, dtype=dtype)
    else:
        checkpoint = fmt.load(path, dtype=dtype)
    projector = resolve_projector(model_config.mmproj, path)
    if projector is not None:
        checkpoint = attach_projector(checkpoint, projector, registries, dtype)
    chosen = choose_arch(checkpoint, registries, model_config.arch)
    arch = chosen.arch
    log.info("%s: model type %r: %s", path.name, checkpoint.config.get("model_type"), chosen.reason)
    check_config(checkpoint, arch)
    config = checkpoint.config

    if checkpoint.tokenizer is None:
        # A GGUF without a tokenizer model (or one the reader could not take) lacks this key.
        key = "tokenizer.ggml.model" if checkpoint.format == "gguf" else None
        raise ModelLoadError("the checkpoint carries no tokenizer", path=str(path), key=key)
    backend = registries.tokenizers.get(checkpoint.tokenizer.kind)
    chat_template = checkpoint.chat_template
    if chat_template is None and isinstance(arch, DefaultChatTemplate):
        chat_template = arch.default_chat_template(config)
        if chat_template is not None:
            arch_name = config.get("model_type", "architecture's")
            log.info("%s has no chat template; using the %s default", path.name, arch_name)
    try:
        tokenizer = backend.build(checkpoint.tokenizer.data, chat_template=chat_template)
    except ModelLoadError as exc:
        if exc.path is not None:
            raise
        raise ModelLoadError(exc.detail, path=str(path), tensor=exc.tensor, key=exc.key) from exc

    kernels = bind_kernels(
        registries.kernels, dtype=dtype, shapes=arch.kernel_context(config), choices=choices
    )
    model = build_model(
        checkpoint, arch, kernels, model_config.quantization, dtype, tensor_group=tensor_group, name=name
    )
    if isinstance(arch, ChecksLoadedModel):
        arch.check_loaded(model)
    if pipeline_group is not None:
        from mlxr_core.model.pipeline import split_layers

        try:
            split_layers(model, arch, pipeline_group, name=name)
        except ModelLoadError as exc:
            raise ModelLoadError(exc.detail, path=str(path), key=exc.key) from None
    if model_config.fuse_projections:
        log.debug("%s: %d layer groups fused into one matmul each", path.name, fuse_model(model))
    compiled = None
    if model_config.compile_decode and pipeline_group is not None:
        log.info("%s: decoding eagerly: the compiled decode step does not cross pipeline stages", path.name)
    elif model_config.compile_decode:
        reason = unsupported(model)
        if reason is None:
            compiled = CompiledDecode(model)
            try:
                reason = disagreement(model, lambda: arch.make_cache(model), compiled)
            except Exception as exc:  # an op the compiler refuses, say: the eager step still serves
                reason = f"one step through it raised {type(exc).__name__}: {exc}"
            if reason is not None:
                compiled = None
                log.warning("%s: decoding eagerly, the compiled decode step does not match the model: %s",
                            path.name, reason)
        else:
            log.info("%s: decoding eagerly, the decode step cannot be compiled: %s", path.name, reason)

    vision = load_vision(checkpoint, arch, DTYPES[dtype], model_config.vision.processor_settings())
    if model_config.vision.pan_and_scan and (vision is None or vision.tokens.several_views is None):
        raise ConfigError(f"{path.name}: models[].vision.pan_and_scan applies to Gemma 3's vision side only; "
                          "remove it", field="models[].vision.pan_and_scan")
    context_length = model_config.context_length or arch.context_length(config)
    kv_cache = kv_quantization(model_config, model, chosen, name, registries)
    loaded = LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        config=config,
        context_length=context_length,
        kernels=kernels,
        dtype=dtype,
        path=path,
        format=format_name,
        decoder=model_config.decoder,
        metadata=checkpoint.metadata,
        compiled_decode=compiled,
        arch_reason=chosen.reason,
        kv_cache=kv_cache,
        vision=vision,
    )
    log.info(
        "loaded %s (%s, %s, %s) in %.1fs: %.0f MB resident, context %d, kernels %s, decode step %s",
        name,
        format_name,
        config.get("model_type"),
        dtype,
        time.perf_counter() - started,
        loaded.nbytes / 1e6,
        context_length,
        ", ".join(f"{op}={backend}" for op, backend in kernels.chosen.items()),
        "compiled" if compiled is not None else "eager",
    )
    return loaded
