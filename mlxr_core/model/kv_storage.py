"""KV cache methods: how a model's keys and values are stored (``models[].kv_cache``).

A method is registered by a plugin through ``mlxr_register_kv_caches`` under the name
``models[].kv_cache.method`` gives (the built-in ``kv_caches`` plugin registers ``affine``,
:mod:`mlxr_core.model.quantized_cache`, and ``turboquant``). It is asked twice: when the config is
checked, before any model loads, for what is wrong with the setting whatever the model
(:meth:`KVCacheMethod.problems`); when a model loads, for its :class:`KVStorage`
(:meth:`KVCacheMethod.configure`), which makes each attention layer's cache and says what a
position costs (the KV budget counts those bytes). The caches follow the protocol of
:mod:`mlxr_core.model.cache` and attend over what they store themselves
(:class:`~mlxr_core.model.quantized_cache.PackedCache`), so batching, chunked prefill, the prefix
cache and the drafting decoders work through them unchanged.

Nothing here imports MLX: ``mlxr config check`` runs the checks without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from mlxr_core.config.structure import Problem
from mlxr_core.errors import ConfigError, UnknownName

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config, KVCacheConfig
    from mlxr_core.plugins import Registries

#: Where a model's setting lives, for error messages.
FIELD = "models[].kv_cache"


@runtime_checkable
class KVStorage(Protocol):
    """``models[].kv_cache`` configured for one model (``LoadedModel.kv_cache``). An attrs class:
    its fields are the setting's identity (the prefix cache's disk tier keys entries by them, so
    name the method among them)."""

    __attrs_attrs__: ClassVar[Any]

    def make_cache(self, layer: int) -> Any:
        """A fresh single-sequence cache (:class:`~mlxr_core.model.cache.LayerCache`, attending
        itself) for the full-attention layer at index ``layer`` of the model's caches."""
        ...

    def bytes_per_position(self, heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes one position's keys and values take in one layer of ``heads`` key/value heads of
        ``head_dim``, activations of ``itemsize`` bytes: what is stored, packing included."""
        ...

    def full_precision_positions(self, tokens: int) -> int:
        """Positions of a ``tokens``-long sequence held in full precision besides (0 for none)."""
        ...


class KVCacheMethod(Protocol):
    """A way of storing keys and values, chosen by ``models[].kv_cache.method``."""

    def problems(self, setting: KVCacheConfig) -> list[tuple[str, str]]:
        """What is wrong with ``setting`` for this method whatever the model, as ``(key, message)``
        pairs, ``key`` a field of ``kv_cache`` (``"bits"``); empty when nothing is. Called when the
        config is checked, before any model loads."""
        ...

    def configure(self, setting: KVCacheConfig, head_dims: list[int]) -> KVStorage:
        """The storage for a model whose attention layers have heads of ``head_dims``.

        :raises ConfigError: where this model cannot take the setting, its ``field`` the key
            (``models[].kv_cache.group_size``), its message what to change; the loader prefixes
            the model's name.
        """
        ...


def method_problems(setting: KVCacheConfig, registries: Registries) -> list[tuple[str, str]]:
    """``(key, message)`` pairs wrong with ``setting``: an unregistered method, or what the method
    says (:meth:`KVCacheMethod.problems`)."""
    if setting.method not in registries.kv_caches:
        return [
            (
                "method",
                str(UnknownName("KV cache method", setting.method, registries.kv_caches.names())),
            )
        ]
    method: KVCacheMethod = registries.kv_caches.get(setting.method)
    return method.problems(setting)


def kv_cache_problems(config: Config, registries: Registries) -> list[Problem]:
    """Every model's ``kv_cache`` problems, with their key paths (``models[0].kv_cache.bits``)."""
    return [
        Problem(("models", index, "kv_cache", key), message)
        for index, model in enumerate(config.models)
        if model.kv_cache is not None
        for key, message in method_problems(model.kv_cache, registries)
    ]


def validate_kv_cache_choices(config: Config, registries: Registries) -> None:
    """Refuse ``kv_cache`` settings no loaded method takes, before any model loads.

    :raises ConfigError: naming each key and the file line it came from.
    """
    from mlxr_core.config.loader import config_error

    problems = kv_cache_problems(config, registries)
    if problems:
        raise config_error(config, problems)


def configure_kv_storage(
    setting: KVCacheConfig, head_dims: list[int], registries: Registries, model: str
) -> KVStorage:
    """The registered method's storage for one model.

    :raises ConfigError: naming the key, for an unregistered method, a setting the method refuses
        or one this model cannot take.
    """
    for key, message in method_problems(setting, registries):
        raise ConfigError(f"model {model}: {FIELD}.{key}: {message}", field=f"{FIELD}.{key}")
    method: KVCacheMethod = registries.kv_caches.get(setting.method)
    try:
        storage = method.configure(setting, head_dims)
    except ConfigError as exc:
        raise ConfigError(
            f"model {model}: {exc.message}", field=exc.field or f"{FIELD}.method"
        ) from None
    if not isinstance(storage, KVStorage):
        raise ConfigError(
            f"model {model}: KV cache method {setting.method!r} made no KV storage (an attrs class)",
            field=f"{FIELD}.method",
        )
    return storage
