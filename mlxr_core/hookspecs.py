"""Every hook an mlxr plugin can implement.

A plugin is any importable object (usually a module) listed in the ``mlxr`` entry-point group whose
functions are marked with :data:`mlxr_core.plugin_api.hookimpl` (that module gathers every
contract named below too). Capability hooks receive a ``register`` callback bound to the calling
plugin, so every registered item records which plugin provided it. Registration must be cheap:
register ``"package.module:attr"`` strings (imported only when the item is used) rather than
importing MLX, model graphs or kernels at registration time.

Hooks assemble the runtime once. Nothing here is called per token.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from mlxr_core.engine.client import EngineClient
    from mlxr_core.model.loader import LoadedModel

hookspec = pluggy.HookspecMarker("mlxr")

#: The hook API this mlxr provides, ``"MAJOR.MINOR"``. A plugin declares the one it was built for
#: in its entry-point module (``MLXR_HOOK_API = "1"``); a different major version is refused at
#: load time. Adding a hook, or an argument to one (pluggy lets an implementation take fewer),
#: bumps the minor version; removing or changing one bumps the major version.
HOOK_API_VERSION = "1.2"


class RegisterName(Protocol):
    def __call__(self, name: str, target: Any, *, override: bool = False, **meta: Any) -> None: ...


class RegisterKernel(Protocol):
    def __call__(
        self, op: str, backend: str, target: Any, *, priority: int = 0, override: bool = False
    ) -> None: ...


class RegisterSection(Protocol):
    def __call__(self, schema: type) -> None: ...


@hookspec
def mlxr_register_formats(register: RegisterName) -> None:
    """Register checkpoint formats.

    Called once per plugin manager, when the registries are assembled (``mlxr serve``,
    ``mlxr generate``, ``mlxr plugins`` ...).

    :param register: ``register(name, target, *, override=False)``. ``name`` is the format's
        name as written in ``models[].format`` (``"gguf"``); ``target`` is a
        ``"module:attr"`` string or an object implementing
        :class:`mlxr_core.model.checkpoint.Format` (``detect(path)``, ``load(path, dtype=...)``).
        A class is instantiated with no arguments on first use. ``override=True`` replaces an
        item of the same name registered by another plugin; without it a duplicate is an error.
    :return: nothing; the return value is ignored.
    """


@hookspec
def mlxr_register_tokenizers(register: RegisterName) -> None:
    """Register tokenizer backends.

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(kind, target, *, override=False)``. ``kind`` matches
        :attr:`mlxr_core.model.checkpoint.TokenizerSpec.kind` as a format plugin writes it
        (``"gguf"``, ``"hf"`` ...); ``target`` implements
        :class:`mlxr_core.model.tokenizer.TokenizerBackend`.
    :return: nothing.
    """


@hookspec
def mlxr_register_archs(register: RegisterName) -> None:
    """Register model architectures.

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(model_type, target, *, override=False)``. ``model_type`` is the
        checkpoint's ``model_type`` (``"llama"``, ``"mistral"``) or the name given in
        ``models[].arch``; ``target`` implements :class:`mlxr_core.model.arch.Architecture`.
    :return: nothing.
    """


@hookspec
def mlxr_register_arch_fallbacks(register: RegisterName) -> None:
    """Register architecture fallbacks: providers of model types no architecture is registered
    under, resolved per checkpoint (the mlx-lm bridge serves every model type mlx-lm implements).

    Called once per plugin manager, when the registries are assembled. The loader consults the
    fallbacks only for a ``model_type`` (or ``models[].arch``) that no architecture plugin
    registered, so a native architecture always wins; ``models[].arch`` naming a fallback sends
    the checkpoint's own ``model_type`` to it.

    :param register: ``register(name, target, *, override=False, **meta)``. ``name`` is what
        ``models[].arch`` may name (``"mlx-lm"``); ``target`` implements
        :class:`mlxr_core.model.arch.ArchitectureFallback` (``resolve(config)`` returns the
        architecture and a one-line note for the startup log, or raises
        :class:`mlxr_core.errors.ArchitectureUnavailable` saying why not). Registration must stay
        cheap (no MLX import): describe what the fallback offers in ``meta`` for ``mlxr plugins``:
        ``label`` (``"mlx-lm bridge"``), ``model_types`` (the list it serves, or ``None`` when it
        cannot serve any) and ``unavailable`` (why not, with the install command).
    :return: nothing.
    """


@hookspec
def mlxr_register_kernels(register: RegisterKernel) -> None:
    """Register kernel backends for ops (attention, rms_norm, rope, ...).

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(op, backend, target, *, priority=0, override=False)``. ``op`` is
        one of :data:`mlxr_core.kernels.OPS`; ``backend`` names this implementation as written in
        the ``kernels:`` config (``"reference"``, ``"mlx_fast"``); ``target`` implements
        :class:`mlxr_core.kernels.KernelBackend`. ``auto`` selection tries backends from the highest
        ``priority`` down and takes the first whose ``supports(ctx)`` returns no reasons.
    :return: nothing.
    """


@hookspec
def mlxr_register_samplers(register: RegisterName) -> None:
    """Register logits processors and samplers.

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(name, target, *, order=0, override=False)``. ``target`` is a
        factory ``make(params: SamplingParams) -> Callable[[mx.array], mx.array] | None``: given one
        request's sampling parameters it returns a logits processor (``[V] logits -> [V] logits``)
        or ``None`` when the request does not use it. Processors run in ascending ``order``; the
        chain is built once per request, never per token.
    :return: nothing.
    """


@hookspec
def mlxr_register_decoders(register: RegisterName) -> None:
    """Register decoding strategies (plain autoregressive, speculative, ...).

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(name, target, *, override=False, drafts=False,
        draft_checkpoint=False)``. ``name`` is what ``models[].decoder`` names; ``target``
        implements :class:`mlxr_core.engine.decoding.Decoder`. With ``drafts=True`` the target
        also drafts inside the batch (:class:`mlxr_core.engine.speculation.DraftingDecoder`: its
        ``row_drafter(model, request)`` gives each admitted request its drafter) and
        ``models[].speculative.method`` may name it; with ``draft_checkpoint=True`` it drafts from
        a checkpoint of its own, ``models[].speculative.path`` (``mlxr config check`` requires it);
        the decoder named ``prediction`` drafts every request that brings an OpenAI ``prediction``.
    :return: nothing.
    """


@hookspec
def mlxr_register_apis(register: RegisterName) -> None:
    """Register HTTP frontends.

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(name, target, *, override=False)``. ``name`` is what ``apis:``
        lists (``"openai"``); ``target`` is a factory ``make(ctx: ServerContext) -> litestar.Router``
        (see :class:`mlxr_core.http.context.ServerContext`) called once when the server starts.
        Every route is behind ``server.api_keys`` but GET routes whose ``opt`` marks them
        :data:`mlxr_core.http.access.PUBLIC` (files that hold no data, such as a web page's own).
    :return: nothing.
    """


@hookspec
def mlxr_register_tool_parsers(register: RegisterName) -> None:
    """Register tool-call formats (the markup a model family writes its function calls in).

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(name, target, *, override=False)``. ``name`` is what
        ``models[].tool_parser`` names (``"hermes"``); ``target`` implements
        :class:`mlxr_core.chat.parsing.ToolParser`: ``detect(template)`` scores a chat template for
        ``auto`` selection, ``stream()`` makes one request's incremental parser, and
        ``system_prompt``/``render_calls``/``render_result`` write tools into prompts whose
        template renders none.
    :return: nothing.
    """


@hookspec
def mlxr_register_reasoning_parsers(register: RegisterName) -> None:
    """Register reasoning formats (how a model marks its thinking, e.g. ``<think>...</think>``).

    Called once per plugin manager, when the registries are assembled.

    :param register: ``register(name, target, *, override=False)``. ``name`` is what
        ``models[].reasoning_parser`` names (``"think"``); ``target`` implements
        :class:`mlxr_core.chat.parsing.ReasoningParser`: ``detect(template)`` for ``auto`` selection and
        ``stream(prompt)`` making one request's splitter of reasoning and content.
    :return: nothing.
    """


@hookspec
def mlxr_register_kv_caches(register: RegisterName) -> None:
    """Register KV cache methods: ways of storing a model's keys and values (quantized, rotated
    and sketched ...) that attention runs over.

    Called once per plugin manager, when the registries are assembled. Hook API 1.2.

    :param register: ``register(name, target, *, override=False)``. ``name`` is what
        ``models[].kv_cache.method`` names (``"affine"``, ``"turboquant"``); ``target`` implements
        :class:`mlxr_core.model.kv_storage.KVCacheMethod`: ``problems(setting)`` says what is wrong
        with a ``kv_cache`` setting before any model loads, ``configure(setting, head_dims)``
        returns the model's :class:`~mlxr_core.model.kv_storage.KVStorage`, which makes each
        attention layer's cache (a :class:`~mlxr_core.model.quantized_cache.PackedCache`: it
        attends over what it stores itself) and counts the bytes a position takes.
    :return: nothing.
    """


@hookspec
def mlxr_register_commands(cli: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``mlxr`` subcommands.

    Called once when the ``mlxr`` command line is built, before arguments are parsed.

    :param cli: the argparse sub-parsers of ``mlxr``: ``p = cli.add_parser("name", help=...)``, add
        arguments, then ``p.set_defaults(handler=fn)`` where ``fn(args) -> int`` is the exit code.
    :return: nothing.
    """


@hookspec
def mlxr_config_sections(register: RegisterSection) -> None:
    """Declare the schema of this plugin's own config section, ``plugins.config.<plugin name>``.

    Called once per plugin manager, when the registries are assembled and before the config's
    plugin sections are validated.

    :param register: ``register(schema)`` where ``schema`` is an attrs class; the section is
        structured into it strictly (unknown keys, wrong types and bad values name the key path).
    :return: nothing.
    """


@hookspec
def mlxr_model_loaded(name: str, model: LoadedModel) -> None:
    """Observe a model that finished loading.

    Called each time a served model's weights are loaded: at startup for ``load: eager`` models,
    and again whenever one loads on demand (a ``lazy`` model's first request, a model loaded back
    after an idle or budget unload: :mod:`mlxr_core.engine.lifecycle`); in a helper thread while
    the engine thread waits (at most ``PluginHost.hook_timeout`` seconds, then the engine goes on).

    :param name: the served model's name.
    :param model: the :class:`mlxr_core.model.loader.LoadedModel`. Read its Python attributes
        (config, modules, paths); do not run MLX work on it (its arrays belong to the engine thread).
    :return: nothing. An exception is logged and ignored.
    """


@hookspec
def mlxr_engine_started(engine: EngineClient) -> None:
    """Observe the engine start.

    Called once, after the engine thread has loaded every model and accepts requests. Like every
    lifecycle hook, it runs in a helper thread, bounded by ``PluginHost.hook_timeout`` seconds.

    :param engine: the engine as its callers see it, a :class:`mlxr_core.engine.client.EngineClient`.
    :return: nothing. An exception is logged and ignored; a hang is logged and left behind.
    """


@hookspec
def mlxr_engine_stopping(engine: EngineClient) -> None:
    """Observe the engine stop.

    Called once, when shutdown begins and before queued requests are drained or cancelled, in a
    helper thread bounded by ``PluginHost.hook_timeout`` seconds.

    :param engine: the engine as its callers see it, a :class:`mlxr_core.engine.client.EngineClient`.
    :return: nothing. An exception is logged and ignored; a hang is logged and left behind.
    """
