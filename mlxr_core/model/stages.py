"""Model loading in stages: open a checkpoint, then plan what it is built as.

:func:`open_checkpoint` reads a model's files through their format plugin (a vision projector
attached); :func:`plan` chooses the architecture, checks the config against it and binds a kernel
for every op. ``load_model``, ``mlxr info``, ``mlxr convert`` and the format conformance check all
go through both stages, then build the module (:func:`~mlxr_core.model.loader.build_model`).
Nothing here builds a graph or evaluates a weight.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.errors import (
    ArchitectureUnavailable,
    ConfigError,
    ModelLoadError,
    UnknownArchitecture,
    UnsupportedFormat,
)
from mlxr_core.kernels import KernelSet, bind_kernels, current_platform
from mlxr_core.model.arch import Architecture, DefaultChatTemplate
from mlxr_core.model.checkpoint import (
    Checkpoint,
    Format,
    LeavePredicate,
    LeavesTensors,
    ReadsProjector,
    ReadsShards,
    TensorShards,
)
from mlxr_core.model.paths import resolve_projector

if TYPE_CHECKING:
    from mlxr_core.model.tokenizer import Tokenizer
    from mlxr_core.plugins import Registries

# The load's one logger (its progress lines too), whichever stage speaks.
log = logging.getLogger("mlxr_core.model.loader")


def default_dtype() -> str:
    """float32 on CPU (float16 matmuls are pathologically slow there), bfloat16 on a GPU."""
    device, _ = current_platform()
    return "bfloat16" if device == "gpu" else "float32"


def pick_format(path: Path, registries: Registries, choice: str | Format = "auto") -> tuple[str, Format]:
    """The format plugin named by ``choice`` (or ``choice`` itself, a :class:`Format` object), or
    the first whose ``detect`` accepts ``path``."""
    if not isinstance(choice, str):
        return choice.name, choice
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


def attach_projector(checkpoint: Checkpoint, path: Path, registries: Registries, dtype: str) -> Checkpoint:
    """``checkpoint`` with the vision tower and projector file at ``path`` (``models[].mmproj``),
    read by the format that recognizes it; ConfigError when that format reads no projectors."""
    name, fmt = pick_format(path, registries)
    if not isinstance(fmt, ReadsProjector):
        raise ConfigError(f"{path}: the {name} format reads no projector files; models[].mmproj takes llama.cpp's "
                          "mmproj GGUF", field="models[].mmproj")
    log.info("%s: vision tower and projector from %s", checkpoint.path.name, path.name)
    return fmt.load_projector(checkpoint, path, dtype=dtype)


@attrs.frozen
class OpenCheckpoint:
    """Stage one of a load: a model's files read by their format."""

    #: The model file or folder (resolved: no ``pkg:`` spelling).
    path: Path
    #: The name of the format that read it.
    format: str
    #: The dtype its float weights were read in, and the model runs in.
    dtype: str
    checkpoint: Checkpoint


#: Given a checkpoint's config as soon as its format has read it (stage one without weights):
#: the share of each tensor this process reads (tensor parallelism).
ShareChooser = Callable[[OpenCheckpoint], TensorShards]


def open_checkpoint(
    path: Path,
    registries: Registries,
    *,
    format: str | Format = "auto",
    dtype: str = "auto",
    mmproj: str | None = None,
    shares: ShareChooser | None = None,
    leave: LeavePredicate | None = None,
) -> OpenCheckpoint:
    """Read the model at ``path`` (resolved, see :func:`~mlxr_core.model.paths.resolve_model_path`)
    with the format ``format`` (a registered name, a :class:`Format`, or ``auto``: detected), its
    float weights in ``dtype`` (``auto``: :func:`default_dtype`), with the projector ``mmproj``
    names (as ``models[].mmproj``: unset takes the one beside a GGUF, ``none`` none). With
    ``shares``, a format that reads shares (:class:`ReadsShards`) reads only those. With
    ``leave``, the tensors it accepts stay in their files (:class:`LeavesTensors`; ConfigError,
    naming ``models[].experts``, for a format that cannot)."""
    format_name, fmt = pick_format(path, registries, format)
    dtype = default_dtype() if dtype == "auto" else dtype
    if leave is not None:
        if not isinstance(fmt, LeavesTensors) or shares is not None:
            why = "under tensor parallelism" if shares is not None else f"from the {format_name} format"
            raise ConfigError(f"{path.name}: experts cannot stream {why}; models[].experts.residency stream reads "
                              "safetensors and GGUF checkpoints on one process", field="models[].experts")  # fmt: skip
        checkpoint = fmt.load_leaving(path, leave, dtype=dtype)
    elif shares is not None and isinstance(fmt, ReadsShards):

        def share_plan(config: dict[str, Any]) -> TensorShards:
            probe = Checkpoint(path=path, format=format_name, config=config, weights={})
            return shares(OpenCheckpoint(path, format_name, dtype, probe))

        checkpoint = fmt.load_shards(path, share_plan, dtype=dtype)
    else:
        checkpoint = fmt.load(path, dtype=dtype)
    projector = resolve_projector(mmproj, path)
    if projector is not None:
        checkpoint = attach_projector(checkpoint, projector, registries, dtype)
    return OpenCheckpoint(path, format_name, dtype, checkpoint)


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


@attrs.frozen
class LoadPlan:
    """Stage two of a load: the architecture an opened checkpoint is built as (and why), its
    config checked against it, and the kernel bound for each op."""

    opened: OpenCheckpoint
    chosen: ArchChoice
    kernels: KernelSet

    @property
    def checkpoint(self) -> Checkpoint:
        return self.opened.checkpoint

    @property
    def arch(self) -> Architecture:
        return self.chosen.arch

    @property
    def config(self) -> dict[str, Any]:
        return self.opened.checkpoint.config


def plan(
    opened: OpenCheckpoint,
    registries: Registries,
    *,
    arch: str = "auto",
    kernels: Mapping[str, str] | None = None,
) -> LoadPlan:
    """Choose the architecture of ``opened`` (``arch``: ``models[].arch``, see :func:`choose_arch`),
    check its config (:func:`check_config`) and bind its kernels in the checkpoint's dtype
    (``kernels``: op -> backend, the merged ``kernels:``; ops left out are ``auto``)."""
    chosen = choose_arch(opened.checkpoint, registries, arch)
    check_config(opened.checkpoint, chosen.arch)
    shapes = chosen.arch.kernel_context(opened.checkpoint.config)
    bound = bind_kernels(registries.kernels, dtype=opened.dtype, shapes=shapes, choices=kernels)
    return LoadPlan(opened, chosen, bound)


def build_tokenizer(planned: LoadPlan, registries: Registries) -> Tokenizer | None:
    """The checkpoint's tokenizer, with its chat template or else its architecture's default;
    None when the checkpoint carries no tokenizer. A backend's ModelLoadError names the file."""
    checkpoint = planned.checkpoint
    if checkpoint.tokenizer is None:
        return None
    backend = registries.tokenizers.get(checkpoint.tokenizer.kind)
    chat_template = checkpoint.chat_template
    if chat_template is None and isinstance(planned.arch, DefaultChatTemplate):
        chat_template = planned.arch.default_chat_template(planned.config)
        if chat_template is not None:
            arch_name = planned.config.get("model_type", "architecture's")
            log.info("%s has no chat template; using the %s default", planned.opened.path.name, arch_name)
    try:
        return backend.build(checkpoint.tokenizer.data, chat_template=chat_template)
    except ModelLoadError as exc:
        if exc.path is not None:
            raise
        raise ModelLoadError(exc.detail, path=str(planned.opened.path), tensor=exc.tensor, key=exc.key) from exc
