"""Plugin discovery and assembly.

:func:`load_plugins` builds a fresh pluggy manager (there is no module-level one), imports each
entry point of the ``mlxr`` group on its own, then calls every registration hook one plugin at a
time with a ``register`` callback bound to that plugin. A plugin that fails to import or raises while
registering is recorded as failed, its partial registrations are rolled back, and every other plugin
keeps working; with ``strict`` (``MLXR_STRICT_PLUGINS=1``) the first failure raises instead.

Compatibility gate: a plugin module may declare the hook API it was built for,
``MLXR_HOOK_API = "1"`` (or ``"1.2"``, ``"1.x"``); one whose major version differs from
:data:`mlxr_core.hookspecs.HOOK_API_VERSION`, or that needs a newer minor version, is reported as
failed with the reason and never registered. ``MLXR_TRACE_HOOKS=1`` logs every hook call (plugin,
hook, arguments, duration, outcome) through the ``mlxr_core.plugins`` logger.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import pluggy
from importlib_metadata import entry_points
from packaging.requirements import InvalidRequirement, Requirement

from mlxr_core import hookspecs
from mlxr_core.errors import PluginLoadError
from mlxr_core.registry import Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "mlxr"
hookimpl = pluggy.HookimplMarker("mlxr")
#: Module attribute in which a plugin declares the hook API it targets.
HOOK_API_ATTRIBUTE = "MLXR_HOOK_API"
#: Seconds the caller waits for one lifecycle hook implementation before going on without it.
LIFECYCLE_HOOK_TIMEOUT_S = 10.0

#: Registries filled by the capability hooks, by hook name.
CAPABILITY_HOOKS = {
    "mlxr_register_formats": "formats",
    "mlxr_register_tokenizers": "tokenizers",
    "mlxr_register_archs": "archs",
    "mlxr_register_arch_fallbacks": "arch_fallbacks",
    "mlxr_register_kernels": "kernels",
    "mlxr_register_samplers": "samplers",
    "mlxr_register_decoders": "decoders",
    "mlxr_register_apis": "apis",
    "mlxr_register_tool_parsers": "tool_parsers",
    "mlxr_register_reasoning_parsers": "reasoning_parsers",
    "mlxr_register_kv_caches": "kv_caches",
}


@attrs.define
class PluginInfo:
    """What ``mlxr plugins`` reports about one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None
    state: str = "ok"  # ok | failed | disabled
    essential: bool = False
    error: str | None = None
    traceback: str | None = None
    provides: dict[str, list[str]] = attrs.field(factory=dict)
    #: The hook API the plugin declares (``MLXR_HOOK_API``); ``None`` when it declares none.
    hook_api: str | None = None


@attrs.define
class Registries:
    formats: Registry = attrs.field(factory=lambda: Registry("format"))
    tokenizers: Registry = attrs.field(factory=lambda: Registry("tokenizer"))
    archs: Registry = attrs.field(factory=lambda: Registry("architecture"))
    arch_fallbacks: Registry = attrs.field(factory=lambda: Registry("architecture fallback"))
    kernels: Registry = attrs.field(factory=lambda: Registry("kernel"))
    samplers: Registry = attrs.field(factory=lambda: Registry("sampler"))
    decoders: Registry = attrs.field(factory=lambda: Registry("decoder"))
    apis: Registry = attrs.field(factory=lambda: Registry("api"))
    tool_parsers: Registry = attrs.field(factory=lambda: Registry("tool parser"))
    reasoning_parsers: Registry = attrs.field(factory=lambda: Registry("reasoning parser"))
    kv_caches: Registry = attrs.field(factory=lambda: Registry("KV cache method"))
    #: plugin name -> attrs class of its ``plugins.config.<name>`` section.
    config_sections: dict[str, type] = attrs.field(factory=dict)

    def all(self) -> dict[str, Registry]:
        return {name: getattr(self, name) for name in CAPABILITY_HOOKS.values()}


@attrs.define
class PluginHost:
    """A loaded plugin set: the pluggy manager, plugin states and the filled registries."""

    manager: pluggy.PluginManager
    plugins: dict[str, PluginInfo]
    registries: Registries
    #: Seconds :meth:`notify` waits for each lifecycle hook implementation.
    hook_timeout: float = LIFECYCLE_HOOK_TIMEOUT_S

    @property
    def failed(self) -> list[PluginInfo]:
        return [info for info in self.plugins.values() if info.state == "failed"]

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observe-only lifecycle hook, one implementation at a time.

        Each runs in a helper thread while the caller waits for it, at most :attr:`hook_timeout`
        seconds: a plugin that raises is logged and skipped, one that hangs is logged and left
        behind (a daemon thread), and the server goes on either way.
        """
        hook = getattr(self.manager.hook, hook_name)
        for impl in hook.get_hookimpls():
            args = {arg: kwargs[arg] for arg in impl.argnames}
            thread = threading.Thread(
                target=_observe, args=(impl.plugin_name, hook_name, impl.function, args),
                name=f"mlxr-hook-{impl.plugin_name}", daemon=True,
            )
            thread.start()
            thread.join(self.hook_timeout)
            if thread.is_alive():
                log.error(
                    "plugin %s did not return from %s within %gs; going on without it",
                    impl.plugin_name, hook_name, self.hook_timeout,
                )


def _observe(plugin: str, hook_name: str, function: Callable[..., Any], args: dict[str, Any]) -> None:
    try:
        call_hook(plugin, hook_name, function, **args)
    except Exception:
        log.exception("plugin %s raised in %s; ignored", plugin, hook_name)


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def check_requirements(requirements: Iterable[str]) -> None:
    """Fail fast unless every ``"dist>=x"`` in ``requirements`` is installed at a matching version."""
    from importlib_metadata import PackageNotFoundError, version

    problems = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            problems.append(f"{text!r} is not a valid requirement ({exc})")
            continue
        try:
            found = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{req} is required but {req.name} is not installed")
            continue
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            problems.append(f"{req} is required but {req.name} {found} is installed")
    if problems:
        raise PluginLoadError("plugins.require: " + "; ".join(problems))


def check_hook_api(declared: object) -> None:
    """Raise :class:`PluginLoadError` unless a plugin built for hook API ``declared`` can run here.

    ``declared`` is ``"MAJOR"``, ``"MAJOR.x"`` or ``"MAJOR.MINOR"`` (an int is read as MAJOR);
    ``None`` (nothing declared) is accepted. The major versions must match; a minor version is
    the oldest this plugin needs, since hooks only grow within a major version.
    """
    if declared is None:
        return
    provided = hookspecs.HOOK_API_VERSION
    match = re.fullmatch(r"(\d+)(?:\.(\d+|x))?", str(declared).strip())
    if match is None or isinstance(declared, bool):
        raise PluginLoadError(
            f"{HOOK_API_ATTRIBUTE} = {declared!r} is not a hook API version "
            f'(write "MAJOR", "MAJOR.x" or "MAJOR.MINOR", e.g. "{provided}")'
        )
    major, minor = int(match[1]), match[2]
    core_major, core_minor = (int(part) for part in provided.split("."))
    if major != core_major:
        hint = "upgrade mlxr" if major > core_major else "upgrade the plugin"
        raise PluginLoadError(
            f"built for hook API {major}, this mlxr provides {core_major} "
            f"(hook API {provided}); {hint}, or install a release of the plugin for hook API "
            f"{core_major}"
        )
    if minor not in (None, "x") and int(minor) > core_minor:
        raise PluginLoadError(
            f"built for hook API {major}.{minor}, this mlxr provides {provided}; upgrade mlxr"
        )


def call_hook(plugin: str, hook_name: str, function: Callable[..., Any], **kwargs: Any) -> Any:
    """Call one plugin's implementation of a hook; with ``MLXR_TRACE_HOOKS=1`` log the call,
    its arguments, its duration and how it ended."""
    if not env_flag("MLXR_TRACE_HOOKS"):
        return function(**kwargs)
    args = ", ".join(f"{name}={_short_repr(value)}" for name, value in kwargs.items())
    log.info("hook call: %s.%s(%s)", plugin, hook_name, args)
    started = time.perf_counter()
    try:
        result = function(**kwargs)
    except BaseException as exc:
        log.info(
            "hook done: %s.%s raised %s after %.2fms",
            plugin, hook_name, type(exc).__name__, (time.perf_counter() - started) * 1e3,
        )
        raise
    log.info("hook done: %s.%s in %.2fms", plugin, hook_name, (time.perf_counter() - started) * 1e3)
    return result


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_plugins(
    *,
    disable: Sequence[str] = (),
    strict: bool | None = None,
    require: Sequence[str] = (),
    extra: Iterable[tuple[str, object]] = (),
    discover: bool = True,
) -> PluginHost:
    """Discover, load and assemble plugins.

    :param disable: plugin names not to load (``MLXR_DISABLE_PLUGINS`` adds to it). An essential
        plugin (one whose module sets ``MLXR_ESSENTIAL = True``) cannot be disabled.
    :param strict: raise on the first failed plugin; defaults to ``MLXR_STRICT_PLUGINS``.
    :param require: requirement strings (``"mlxr-foo>=0.3"``) checked before anything loads.
    :param extra: ``(name, plugin object)`` pairs registered besides the entry points (tests, embedding).
    :param discover: read the ``mlxr`` entry-point group (False: only ``extra``).
    """
    if strict is None:
        strict = env_flag("MLXR_STRICT_PLUGINS")
    check_requirements(require)
    disabled = set(disable) | set(env_list("MLXR_DISABLE_PLUGINS"))

    manager = pluggy.PluginManager("mlxr")
    manager.add_hookspecs(hookspecs)
    if env_flag("MLXR_TRACE_HOOKS"):
        # Calls through ``manager.hook`` (the core calls implementations one plugin at a time
        # through call_hook, which logs them itself).
        manager.add_hookcall_monitoring(
            lambda name, impls, kwargs: log.info(
                "hook call: %s(%s) -> %s", name, ", ".join(kwargs), [i.plugin_name for i in impls]
            ),
            lambda outcome, name, impls, kwargs: log.info("hook done: %s", name),
        )
    plugins: dict[str, PluginInfo] = {}

    def fail(info: PluginInfo, what: str, exc: BaseException) -> None:
        info.state = "failed"
        # mlxr's own refusals (an incompatible hook API) read as they are.
        detail = str(exc) if isinstance(exc, PluginLoadError) else f"{type(exc).__name__}: {exc}"
        info.error = f"{what}: {detail}"
        info.traceback = "".join(traceback.format_exception(exc))
        log.warning("plugin %s failed (%s)", info.name, info.error)
        if strict:
            raise PluginLoadError(f"plugin {info.name!r} failed: {info.error}") from exc

    candidates: list[tuple[PluginInfo, Callable[[], object]]] = []
    if discover:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in plugins:
                continue  # the same distribution seen twice on sys.path
            dist = ep.dist
            info = PluginInfo(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist else None,
                version=dist.version if dist else None,
                module=ep.value,
            )
            plugins[ep.name] = info
            candidates.append((info, ep.load))
    for name, obj in extra:
        info = PluginInfo(name=name, module=getattr(obj, "__name__", repr(obj)))
        plugins[name] = info
        candidates.append((info, functools.partial(_identity, obj)))

    for info, load in candidates:
        try:
            obj = load()
        except Exception as exc:
            fail(info, "import failed", exc)
            continue
        info.essential = bool(getattr(obj, "MLXR_ESSENTIAL", False))
        info.hook_api = getattr(obj, HOOK_API_ATTRIBUTE, None)
        try:
            check_hook_api(info.hook_api)
        except PluginLoadError as exc:
            fail(info, "incompatible", exc)
            continue
        if info.name in disabled:
            if info.essential:
                log.warning("plugin %s is essential and cannot be disabled", info.name)
            else:
                info.state = "disabled"
                continue
        try:
            manager.register(obj, name=info.name)
        except Exception as exc:
            fail(info, "registration with pluggy failed", exc)

    registries = Registries()
    for info in plugins.values():
        if info.state == "ok":
            _collect(manager, info, registries, fail)
    # Once every plugin has registered: what each provides now, after overrides in either order.
    for info in plugins.values():
        if info.state == "ok":
            info.provides = {
                kind: names for kind, registry in registries.all().items()
                if (names := registry.by_plugin(info.name))
            }

    unknown = disabled - set(plugins)
    if unknown:
        log.warning("cannot disable unknown plugin(s): %s", ", ".join(sorted(unknown)))
    return PluginHost(manager=manager, plugins=plugins, registries=registries)


def _collect(
    manager: pluggy.PluginManager,
    info: PluginInfo,
    registries: Registries,
    fail: Callable[[PluginInfo, str, BaseException], None],
) -> None:
    """Run one plugin's registration hooks; on error roll back what it registered."""
    plugin = manager.get_plugin(info.name)
    for hook_name, kind in CAPABILITY_HOOKS.items():
        registry = getattr(registries, kind)
        impl = _impl_of(manager, hook_name, plugin)
        if impl is None:
            continue
        if kind == "kernels":

            def register(
                op: str,
                backend: str,
                target: Any,
                *,
                priority: int = 0,
                override: bool = False,
                _registry: Registry = registry,
            ) -> None:
                _registry.add(
                    f"{op}:{backend}", target, plugin=info.name, override=override, priority=priority
                )
        else:

            def register(  # type: ignore[misc]
                name: str, target: Any, *, override: bool = False, _registry: Registry = registry,
                **meta: Any,
            ) -> None:
                _registry.add(name, target, plugin=info.name, override=override, **meta)

        try:
            call_hook(info.name, hook_name, impl, register=register)
        except Exception as exc:
            for reg in registries.all().values():
                reg.remove_plugin(info.name)
            registries.config_sections.pop(info.name, None)
            fail(info, f"{hook_name} raised", exc)
            return
        provided = registry.by_plugin(info.name)
        if provided:
            info.provides[kind] = provided

    impl = _impl_of(manager, "mlxr_config_sections", plugin)
    if impl is not None:
        try:

            def register_section(schema: type) -> None:
                registries.config_sections[info.name] = schema

            call_hook(info.name, "mlxr_config_sections", impl, register=register_section)
        except Exception as exc:
            for reg in registries.all().values():
                reg.remove_plugin(info.name)
            fail(info, "mlxr_config_sections raised", exc)


def _identity(obj: object) -> object:
    return obj


def _impl_of(manager: pluggy.PluginManager, hook_name: str, plugin: object) -> Callable[..., Any] | None:
    for impl in getattr(manager.hook, hook_name).get_hookimpls():
        if impl.plugin is plugin:
            return impl.function
    return None
