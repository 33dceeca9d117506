"""One check of a server config against the loaded plugins' registries (it sits above config/,
model/ and the parsers, whose names it checks).

:func:`check_config` is what ``mlxr serve`` runs before it binds its port and what ``mlxr config
check`` prints: each plugin's own section, every name the config uses (APIs, kernel ops and
backends, formats, architectures, decoders, tool and reasoning parsers, kv-cache methods) against
what a loaded plugin registered, whether each kernel backend it names can run on this machine, and
every model path. It reports every problem at once, each with
its key and the file line it came from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxr_core.config.loader import ConfigProblems, config_error, validate_plugin_sections
from mlxr_core.config.structure import Problem
from mlxr_core.errors import UnknownName

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config, SpeculationConfig
    from mlxr_core.plugins import PluginHost, Registries


def check_config(config: Config, host: PluginHost) -> dict[str, Any]:
    """Check ``config`` against ``host``'s registries and the file system.

    :return: plugin name -> instance of its config section (as :func:`validate_plugin_sections`).
    :raises ConfigProblems: listing every problem found, each naming its key.
    """
    lines: list[str] = []
    sections: dict[str, Any] = {}
    try:
        sections = validate_plugin_sections(config, host.registries)
    except ConfigProblems as exc:
        lines += exc.problems
    problems = unregistered_names(config, host)
    problems += unavailable_kernels(config, host) if not problems else []
    problems += missing_models(config)
    if problems:
        lines += config_error(config, problems).problems
    if lines:
        raise ConfigProblems(lines)
    return sections


def unregistered_names(config: Config, host: PluginHost) -> list[Problem]:
    """Names in ``config`` that no loaded plugin registered, with what is available."""
    from mlxr_core.chat.parsing import parser_problems
    from mlxr_core.kernels import kernel_preferences
    from mlxr_core.model.kv_storage import kv_cache_problems

    registries = host.registries
    problems = []

    def check(path: tuple[str | int, ...], what: str, name: str, available: list[str]) -> None:
        if name not in available:
            problems.append(Problem(path, str(UnknownName(what, name, available))))

    backends: dict[str, list[str]] = {}
    for name in registries.kernels.names():
        op, _, backend = name.partition(":")
        backends.setdefault(op, []).append(backend)

    def check_kernels(path: tuple[str | int, ...], choices: dict[str, str]) -> None:
        for op, backend in choices.items():
            if op not in backends:
                problems.append(Problem((*path, op), str(UnknownName("kernel op", op, backends))))
            else:
                for name in kernel_preferences(backend):
                    if name != "auto":
                        check((*path, op), f"{op} kernel backend", name, backends[op])

    for index, api in enumerate(config.apis):
        check(("apis", index), "API", api, registries.apis.names())
    check_kernels(("kernels",), config.kernels)
    for index, model in enumerate(config.models):
        where = ("models", index)
        if model.format != "auto":
            check((*where, "format"), "format", model.format, registries.formats.names())
        if model.arch != "auto" and model.arch not in fallback_model_types(host):
            names = [*registries.archs.names(), *registries.arch_fallbacks.names()]
            check((*where, "arch"), "architecture", model.arch, names)
        check((*where, "decoder"), "decoder", model.decoder, registries.decoders.names())
        if model.speculative is not None and model.speculative.method != "none":
            drafting = [entry.name for entry in registries.decoders if entry.meta.get("drafts")]
            check((*where, "speculative", "method"), "drafting decoder", model.speculative.method, drafting)
            problems += draft_path_problems(where, model.speculative, registries)
        check_kernels((*where, "kernels"), model.kernels)
    return [*problems, *parser_problems(config, registries), *kv_cache_problems(config, registries)]


def draft_path_problems(
    where: tuple[str | int, ...], speculative: SpeculationConfig, registries: Registries
) -> list[Problem]:
    """``speculative.path`` missing for a method that drafts from a checkpoint of its own (one
    registered with ``draft_checkpoint=True``: ``eagle3``)."""
    method = speculative.method
    entry = next((entry for entry in registries.decoders if entry.name == method), None)
    if entry is None or not entry.meta.get("draft_checkpoint") or speculative.path is not None:
        return []
    return [Problem((*where, "speculative", "path"), f"the {method} method drafts from a checkpoint of its own: set its folder")]


#: Shapes the kernel check asks backends about before any model is read (``mlxr kernels``'
#: defaults: Llama-3-8B-like heads); a backend refusing only some shapes is not refused here.
CHECK_SHAPES = {"head_dim": 128, "n_heads": 32, "n_kv_heads": 8, "rope_dims": 128, "masks": ("causal",)}


def unavailable_kernels(config: Config, host: PluginHost) -> list[Problem]:
    """Kernel backends the config names (``kernels:``, ``models[].kernels``) that cannot run on
    this machine's device in the model's dtype, with their reasons (what ``mlxr serve`` would
    refuse while loading the model, said before it starts)."""
    from mlxr_core.errors import KernelUnavailable
    from mlxr_core.kernels import KernelContext, current_platform, select_kernel

    device, platform = current_platform()
    problems = []
    registry = host.registries.kernels
    for index, model in enumerate(config.models):
        dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if device == "gpu" else "float32")
        for op, choice in {**config.kernels, **model.kernels}.items():
            path: tuple[str | int, ...] = ("models", index, "kernels", op) if op in model.kernels else ("kernels", op)
            ctx = KernelContext(op=op, device=device, platform=platform, dtype=dtype, shapes=CHECK_SHAPES)
            try:
                select_kernel(registry, ctx, choice)
            except KernelUnavailable as exc:
                problem = Problem(path, str(exc).removeprefix(f"kernels.{op}: "))
                if problem not in problems:
                    problems.append(problem)
    return problems


def fallback_model_types(host: PluginHost) -> set[str]:
    """The model types the architecture fallbacks say they serve (the mlx-lm bridge's)."""
    return {name for entry in host.registries.arch_fallbacks for name in entry.meta.get("model_types") or ()}


def missing_models(config: Config) -> list[Problem]:
    """Model paths (and ``mmproj`` projector paths, and LoRA adapter paths) that do not resolve to
    a file or folder."""
    from mlxr_core.errors import ModelLoadError
    from mlxr_core.model.paths import resolve_model_path

    problems = []
    for index, model in enumerate(config.models):
        paths: dict[tuple[str | int, ...], str] = {("path",): model.path}
        if model.mmproj is not None and model.mmproj.lower() != "none":
            paths[("mmproj",)] = model.mmproj
        for j, adapter in enumerate(model.adapters):
            paths[("adapters", j, "path")] = adapter.path
        if model.speculative is not None and model.speculative.path is not None:
            paths[("speculative", "path")] = model.speculative.path
        for key, spec in paths.items():
            try:
                resolve_model_path(spec, join=False)  # a check writes nothing
            except ModelLoadError as exc:
                problems.append(Problem(("models", index, *key), str(exc)))
    return problems
