"""The loading pipeline: model config -> checkpoint -> architecture -> kernels -> weights.

The first stages, shared with ``mlxr info``, ``mlxr convert`` and the format check, are
:mod:`mlxr_core.model.stages` (open the checkpoint, plan its architecture and kernels); this
module builds the planned module, loads its weights and makes it ready to serve. Runs on the
engine thread (it creates MLX arrays). Every step that can fail raises an
:class:`~mlxr_core.errors.MlxrError` saying which file, tensor, plugin or key was at fault.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxr_core.errors import ConfigError, MlxrError, ModelLoadError
from mlxr_core.kernels import KernelSet, current_platform
from mlxr_core.model.arch import Architecture, ChecksLoadedModel, KeepsTablesStored, RenamesModules
from mlxr_core.model.audio import SpeechToText, load_speech
from mlxr_core.model.checkpoint import (
    Checkpoint,
    LeavePredicate,
    LeavesTensors,
    QuantSpec,
    Shard,
    TensorShards,
)
from mlxr_core.model.compiled import CompiledDecode, disagreement, eager_step, unsupported
from mlxr_core.model.experts.store import ExpertStore
from mlxr_core.model.experts.wiring import is_expert_tensor, stream_experts, tag_stored
from mlxr_core.model.fuse import fuse_model
from mlxr_core.model.kv_storage import KVStorage, configure_kv_storage
from mlxr_core.model.layers.attention import Attention
from mlxr_core.model.layers.mlp import route_gated_activations
from mlxr_core.model.lora import AdapterSet, read_adapter
from mlxr_core.model.paths import default_model_name, resolve_model_path
from mlxr_core.model.quantize import apply_policy, refuse_unrunnable_modes, route_quantized_linears
from mlxr_core.model.quantized_cache import quantize_caches
from mlxr_core.model.stages import (
    ArchChoice,
    OpenCheckpoint,
    build_tokenizer,
    naming_config,
    open_checkpoint,
    plan,
)

# Where callers found these before the stages had a module of their own.
from mlxr_core.model.stages import choose_arch as choose_arch
from mlxr_core.model.stages import pick_format as pick_format
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_core.model.vision import Vision, load_vision

if TYPE_CHECKING:
    from mlxr_core.config.schema import ModelConfig, SpeculationConfig
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
    #: The front end and transcriber of a speech-to-text model (Whisper), or None.
    speech: SpeechToText | None = None
    #: Where its streamed experts come from (``models[].experts.residency: stream``), or None.
    experts: ExpertStore | None = None
    #: The resident LoRA adapters of a model configured with some (``models[].adapters``), or None.
    adapters: AdapterSet | None = None
    #: Drafting inside the batch (``models[].speculative``), or None.
    speculative: SpeculationConfig | None = None
    #: Bytes a row's drafter keeps per position beside the model's caches (an MTP head's keys
    #: and values), set when the drafter is prepared; the KV budget reserves them too.
    drafter_bytes_per_token: int = 0
    #: The engine's prefix cache for this model (set where its batch runner is made), or None;
    #: engine jobs (option scoring) fork from its entries as rows do.
    prefix_cache: Any = None

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
        # The compiled step was traced without adapter rows: rows using adapters step eagerly.
        if self.compiled_decode is not None and (self.adapters is None or self.adapters.active() is None):
            return self.compiled_decode(tokens, caches, mask, shift)
        return eager_step(self.model, tokens, caches, mask, shift)

    @property
    def nbytes(self) -> int:
        """The resident weights' bytes: the text model's, the vision side's (tower, projector) and
        the resident LoRA adapters'."""
        modules = [self.model] if self.vision is None else [self.model, self.vision.module]
        adapters = self.adapters.nbytes if self.adapters is not None else 0  # resident LoRA updates
        return adapters + sum(array.nbytes for module in modules for _, array in tree_flatten(module.parameters()))  # type: ignore[misc,union-attr,str-unpack]

    @property
    def memory_bytes(self) -> int:
        """What the model holds in memory at most: :attr:`nbytes` and, with streamed experts,
        their cache's capacity."""
        return self.nbytes + (self.experts.cache.capacity if self.experts is not None else 0)


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
    experts: ExpertStore | None = None,
) -> nn.Module:
    """The architecture's module holding ``checkpoint``'s weights under a quantization policy
    (:mod:`mlxr_core.model.quantize`), evaluated and in eval mode. What the policy did per source
    type is logged at debug level and added to ``report`` when given. With ``tensor_group``, the
    module holds this rank's share of the split layers (:mod:`mlxr_core.model.tensor_parallel`),
    cut before the weights are loaded, so the whole split tensors never reach it; ``name`` (the
    model's) is what a refusal to split names. With ``experts``, the tensors the checkpoint left in
    its files (:attr:`Checkpoint.stored`) are the experts ``experts`` reads on demand
    (:mod:`mlxr_core.model.experts`)."""
    config = checkpoint.config
    with naming_config(checkpoint):
        model = arch.build(config, kernels)
    checkpoint, tables = split_tables(checkpoint, arch)
    stand_ins, stored = tag_stored(checkpoint) if experts is not None else ({}, [])
    try:
        sanitized = arch.sanitize({**checkpoint.weights, **stand_ins}, config)
    except ModelLoadError as exc:
        if exc.path is not None:
            raise
        raise ModelLoadError(exc.detail, path=str(checkpoint.path), tensor=exc.tensor) from exc
    if experts is not None:
        resolved = quantization_policy
        if resolved == "auto":
            resolved = "dequantize" if current_platform()[0] == "cpu" and not kernels.keeps_packed else "keep"
        sanitized = stream_experts(
            model, sanitized, stored, checkpoint, experts, renamed_modules(arch, checkpoint.quantization),
            renamed_modules(arch, checkpoint.suggested_quantization), resolved,
        )
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
    refuse_unrunnable_modes(quantization, weights, kernels, path=str(checkpoint.path))
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
    if tables:
        assert isinstance(arch, KeepsTablesStored)
        arch.attach_tables(model, config, tables, DTYPES[dtype])
    mx.eval(model.parameters())
    model.eval()
    return model


def split_tables(checkpoint: Checkpoint, arch: Architecture) -> tuple[Checkpoint, dict[str, Any]]:
    """``checkpoint`` less the tensors of the tables the architecture keeps out of its parameters
    (:class:`~mlxr_core.model.arch.KeepsTablesStored`), and those: left in the files or read."""
    if not isinstance(arch, KeepsTablesStored):
        return checkpoint, {}
    keeps = partial(arch.stored_table, checkpoint.config)
    tables: dict[str, Any] = {name: part for name, part in checkpoint.stored.items() if keeps(name)}
    tables.update((name, array) for name, array in checkpoint.weights.items() if keeps(name))
    if not tables:
        return checkpoint, {}
    rest = attrs.evolve(
        checkpoint,
        weights={name: array for name, array in checkpoint.weights.items() if name not in tables},
        stored={name: part for name, part in checkpoint.stored.items() if name not in tables},
    )
    return rest, tables


def _either(first: LeavePredicate, second: LeavePredicate, name: str) -> bool:
    return first(name) or second(name)


def leave_in_files(
    path: Path, registries: Registries, *, streams: bool, format: str = "auto", arch: str = "auto"
) -> LeavePredicate | None:
    """The checkpoint tensors to leave in their files: the routed experts where they stream, and
    the tables the architecture keeps (:func:`stored_tables`); None for none."""
    tables = stored_tables(path, registries, format, arch)
    if not streams:
        return tables
    return is_expert_tensor if tables is None else partial(_either, is_expert_tensor, tables)


def stored_tables(path: Path, registries: Registries, format: str = "auto", arch: str = "auto") -> LeavePredicate | None:
    """The tensors to leave in the files of the folder at ``path`` because its architecture keeps
    them as tables (:class:`~mlxr_core.model.arch.KeepsTablesStored`), found from its
    ``config.json`` before any weight is read; None where there are none, or where the format
    cannot leave tensors (they are then read, and still kept out of the parameters)."""
    if not (path.is_dir() or path.suffix == ".safetensors"):
        return None  # a GGUF file: no architecture keeps tables in one
    folder = path if path.is_dir() else path.parent
    try:
        _, fmt = pick_format(path, registries, format)
        if not isinstance(fmt, LeavesTensors) or not (folder / "config.json").is_file():
            return None
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            return None
        chosen = choose_arch(Checkpoint(path, "probe", config, {}), registries, arch).arch
    except Exception:  # only a probe: the load itself reads the folder and says what is wrong
        return None
    return partial(chosen.stored_table, config) if isinstance(chosen, KeepsTablesStored) else None


def tensor_shares(
    probe: OpenCheckpoint,
    registries: Registries,
    *,
    arch: str,
    kernels: Mapping[str, str],
    group: Any,
    name: str,
) -> TensorShards:
    """The share of each tensor this rank of ``group`` reads, for a format that reads shares
    (:class:`~mlxr_core.model.checkpoint.ReadsShards`): given the checkpoint's config (``probe``,
    stage one without weights), the planned module is built (its parameters never evaluated) and
    split by :func:`~mlxr_core.model.tensor_parallel.plan_shards`, in the checkpoint's tensor
    names. A model that cannot be split is refused then, before its weights are read; a config
    the architecture cannot build reads every tensor whole, and the load reports why further on."""
    from mlxr_core.model.tensor_parallel import plan_shards

    path = probe.path
    try:
        planned = plan(probe, registries, arch=arch, kernels=kernels)
        with naming_config(probe.checkpoint):
            model = planned.arch.build(planned.config, planned.kernels)
    except MlxrError as exc:
        log.debug("%s: reading every tensor whole: %s", path.name, exc)
        return lambda tensor: None
    try:
        shards = plan_shards(model, group.size(), group.rank(), name=name)
    except ModelLoadError as exc:  # refused before a byte of the weights is read
        raise ModelLoadError(exc.detail, path=str(path), key=exc.key) from None
    renames = planned.arch if isinstance(planned.arch, RenamesModules) else None

    def share(tensor: str) -> Shard | None:
        module, _, part = tensor.rpartition(".")
        names = renames.sanitized_modules(module) if renames is not None else [module]
        return shards.get(f"{names[0]}.{part}") if len(names) == 1 else None

    return share


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
    name = model_config.name or default_model_name(path)
    choices = {**(kernel_choices or {}), **model_config.kernels}
    shares = None
    if tensor_group is not None:
        shares = partial(
            tensor_shares, registries=registries, arch=model_config.arch, kernels=choices, group=tensor_group, name=name
        )
    streams = model_config.experts.residency == "stream"
    leave = None if tensor_group is not None else leave_in_files(
        path, registries, streams=streams, format=model_config.format, arch=model_config.arch
    )
    opened = open_checkpoint(
        path, registries, format=model_config.format, dtype=model_config.dtype, mmproj=model_config.mmproj,
        shares=shares, leave=leave,
    )
    planned = plan(opened, registries, arch=model_config.arch, kernels=choices)
    checkpoint, chosen, arch, kernels = opened.checkpoint, planned.chosen, planned.arch, planned.kernels
    format_name, dtype, config = opened.format, opened.dtype, checkpoint.config
    log.info("%s: model type %r: %s", path.name, config.get("model_type"), chosen.reason)

    tokenizer = build_tokenizer(planned, registries)
    if tokenizer is None:
        # A GGUF without a tokenizer model (or one the reader could not take) lacks this key.
        key = "tokenizer.ggml.model" if checkpoint.format == "gguf" else None
        raise ModelLoadError("the checkpoint carries no tokenizer", path=str(path), key=key)
    experts = ExpertStore(model_config.experts, DTYPES[dtype]) if streams else None
    try:
        model = build_model(
            checkpoint, arch, kernels, model_config.quantization, dtype, tensor_group=tensor_group, name=name,
            experts=experts,
        )
    except BaseException:
        if experts is not None:
            experts.close()
        raise
    if isinstance(arch, ChecksLoadedModel):
        arch.check_loaded(model)
    if pipeline_group is not None:
        from mlxr_core.model.pipeline import split_layers

        try:
            split_layers(model, arch, pipeline_group, name=name)
        except ModelLoadError as exc:
            raise ModelLoadError(exc.detail, path=str(path), key=exc.key) from None
    # An adapter updates q_proj, k_proj, ... one by one: a model serving adapters keeps them apart.
    if model_config.fuse_projections and not (model_config.adapters or model_config.runtime_adapters):
        log.debug("%s: %d layer groups fused into one matmul each", path.name, fuse_model(model))
    compiled = None
    if model_config.compile_decode and experts is not None:
        log.info("%s: decoding eagerly: streamed experts are read as each layer routes", path.name)
    elif model_config.compile_decode and pipeline_group is not None:
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
    speech = load_speech(checkpoint, arch, model, tokenizer)
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
        speculative=model_config.speculative,
        metadata=checkpoint.metadata,
        compiled_decode=compiled,
        arch_reason=chosen.reason,
        kv_cache=kv_cache,
        vision=vision,
        speech=speech,
        experts=experts,
        adapters=AdapterSet(
            model,
            model_config.max_adapters,
            {adapter.name: adapter.path for adapter in model_config.adapters},
            partial(read_adapter, registries=registries, base_config=config),
        )
        if model_config.adapters or model_config.runtime_adapters
        else None,
    )
    if experts is not None:
        log.info("%s: experts streamed from the checkpoint into a %.0f MB cache (%s, read ahead: %s)", name,
                 experts.cache.capacity / 1e6, model_config.experts.policy, model_config.experts.prefetch)  # fmt: skip
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
