"""mlxr_core.plugin_api: one import for plugin authors, cheap, re-exporting the contracts as defined."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import typing

from mlxr_core import hookspecs, kernels, plugin_api, plugins

#: The contract each capability hook's ``register`` takes a target of, where it is defined.
CONTRACTS = {
    "mlxr_register_formats": ("Format", "mlxr_core.model.checkpoint"),
    "mlxr_register_tokenizers": ("TokenizerBackend", "mlxr_core.model.tokenizer"),
    "mlxr_register_archs": ("Architecture", "mlxr_core.model.arch"),
    "mlxr_register_arch_fallbacks": ("ArchitectureFallback", "mlxr_core.model.arch"),
    "mlxr_register_kernels": ("KernelBackend", "mlxr_core.kernels"),
    "mlxr_register_samplers": ("LogitsProcessor", "mlxr_core.engine.decoding"),
    "mlxr_register_decoders": ("Decoder", "mlxr_core.engine.decoding"),
    "mlxr_register_apis": ("ServerContext", "mlxr_core.http.context"),
    "mlxr_register_tool_parsers": ("ToolParser", "mlxr_core.chat.parsing"),
    "mlxr_register_reasoning_parsers": ("ReasoningParser", "mlxr_core.chat.parsing"),
    "mlxr_register_kv_caches": ("KVCacheMethod", "mlxr_core.model.kv_storage"),
}


def test_every_name_in_all_imports():
    namespace: dict[str, object] = {}
    exec("from mlxr_core.plugin_api import *", namespace)
    assert len(plugin_api.__all__) == len(set(plugin_api.__all__))
    assert set(plugin_api.__all__) <= set(namespace)
    assert set(plugin_api.__all__) <= set(dir(plugin_api))


def test_each_name_is_the_object_where_it_is_defined():
    for name in plugin_api.__all__:
        exported = getattr(plugin_api, name)
        if inspect.isclass(exported) or inspect.isfunction(exported):
            assert exported.__module__ != plugin_api.__name__, name
            assert getattr(importlib.import_module(exported.__module__), name) is exported, name
    assert plugin_api.hookimpl is plugins.hookimpl
    assert plugin_api.HOOK_API_VERSION is hookspecs.HOOK_API_VERSION
    assert plugin_api.OPS is kernels.OPS


def test_every_capability_hook_has_its_contract_exported():
    assert set(CONTRACTS) == set(plugins.CAPABILITY_HOOKS), "name the new hook's contract in CONTRACTS"
    for hook, (name, module) in CONTRACTS.items():
        assert name in plugin_api.__all__, hook
        assert getattr(plugin_api, name) is getattr(importlib.import_module(module), name), hook


def test_an_unknown_name_is_an_attribute_error():
    try:
        plugin_api.NoSuchContract  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchContract" in str(exc)
    else:
        raise AssertionError("plugin_api.NoSuchContract did not raise")


def test_registering_through_it_imports_no_heavy_library():
    # A plugin's entry-point module imports it, and `mlxr plugins` imports every such module;
    # the contracts that need MLX load it when first used.
    probe = (
        "import sys\n"
        "from mlxr_core.plugin_api import RegisterKernel, RegisterName, RegisterSection, hookimpl\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'litestar', 'PIL', 'numpy'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_every_hook_argument_is_typed_with_a_real_class():
    names = {name: getattr(plugin_api, name) for name in plugin_api.__all__}
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        if getattr(spec, "mlxr_spec", None) is None:
            continue
        hints = typing.get_type_hints(spec, localns=names)
        for param in inspect.signature(spec).parameters:
            assert param in hints and hints[param] is not typing.Any, f"{name}({param})"
