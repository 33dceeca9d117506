"""mlx-lm's model graphs as mlxr architectures.

:class:`MlxLmBridge` finds ``mlx_lm.models.<model_type>`` (through mlx-lm's own aliases), and
:class:`MlxLmArchitecture` builds its ``Model`` from the config with mlx-lm's ``ModelArgs`` and loads
the checkpoint through the model's own ``sanitize``. What the engine needs from it:

- Caches. Every attention layer gets mlxr's :class:`~mlxr_core.model.cache.KVCache`, which the engine batches
  (:class:`~mlxr_core.model.cache.BatchKVCache`: rows right-aligned after left padding, an offset
  per row, which ``mx.fast.rope`` takes as it is) and the prefix cache copies. mlx-lm's models take
  no mask: they build one from the cache (``create_attention_mask`` calls ``cache.make_mask``), so
  the module hands mlx-lm a view of each cache (:mod:`.caches`), the same cache with mlx-lm's
  ``make_mask``, which hides a batch row's padding and the keys outside a sliding window. Once its
  weights are loaded, two prompts are decoded alone and as a left-padded batch: a graph that lets
  a row attend to its padding is refused rather than served wrongly.
- Sliding windows. A layer for which mlx-lm makes a ``RotatingKVCache`` keeps every position in a
  full cache and masks those outside its window, as mlxr's own window layers do
  (:mod:`mlxr_core.model.masks`): batching, the prefix cache and trimming then work unchanged.
- Recurrent state. A layer for which mlx-lm makes an ``ArraysCache`` (LFM2's short convolutions,
  Nemotron-H's and Falcon-H1's Mamba layers, Gated DeltaNet) gets mlxr's
  :class:`~mlxr_core.model.cache.StateCache`, which mlx-lm's layers use as they use theirs and
  which the engine batches, stores at a prefix's end and refuses to trim like mlxr's own.
- Configs. transformers 5's config is put in the form mlx-lm's ``ModelArgs`` reads, and a config
  whose math it would drop is refused naming the key (:mod:`.configs`).
- Refusals. A model type with another kind of cache (a list of caches per layer, chunked or
  quantized caches) is refused when built, naming the cache class.
- Kernels. The graph is mlx-lm's: mlxr's kernel choices do not apply inside it (packed linear
  layers excepted, which the loader routes through the ``quantized_matmul`` kernel), and it decodes
  eagerly (a compiled decode step needs mlxr's block methods).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ArchitectureUnavailable, MlxrError, ModelLoadError, close_matches
from mlxr_core.kernels import KernelSet
from mlxr_plugins.archs.mlx_lm_bridge import INSTALL, mlx_lm_folder, model_types
from mlxr_plugins.archs.mlx_lm_bridge.caches import batch_problem, cache_layout, make_caches, views
from mlxr_plugins.archs.mlx_lm_bridge.configs import mlx_lm_config

#: What of mlxr does not apply on this path, said in the startup log and by ``mlxr info``.
KERNELS_NOTE = (
    "mlxr's kernel choices do not apply inside mlx-lm's graph (packed linear layers excepted), "
    "and its decode step runs eagerly"
)
#: A model type that can name a module of ``mlx_lm.models`` (no dots, no path).
MODEL_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")
#: Config keys mlx-lm's model families use for the same shapes, most common first.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_head_kv")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
#: Context length assumed when the config names none (``models[].context_length`` overrides it).
DEFAULT_CONTEXT = 4096


class MlxLmBridge:
    """The architecture fallback (:class:`~mlxr_core.model.arch.ArchitectureFallback`) serving
    mlx-lm's model types."""

    def resolve(self, config: dict[str, Any]) -> tuple[MlxLmArchitecture, str]:
        model_type = str(config.get("model_type"))
        if mlx_lm_folder() is None:
            raise ArchitectureUnavailable(f"not installed ({INSTALL})")
        import mlx_lm
        import mlx_lm.utils

        version = f"mlx-lm {mlx_lm.__version__}"
        name = module_name(config, mlx_lm.utils)
        if not MODEL_TYPE.fullmatch(name) or importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
            hint = close_matches(model_type, model_types() or ())
            raise ArchitectureUnavailable(f"{version} has no model type {model_type!r}{hint}")
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except (Exception, SystemExit) as exc:  # some model files exit when a package is missing
            raise ModelLoadError(
                f"{version}'s {name} model file failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        for attr in ("Model", "ModelArgs"):
            if not isinstance(getattr(module, attr, None), type):
                raise ArchitectureUnavailable(f"{version}'s mlx_lm.models.{name} has no {attr} class")
        return MlxLmArchitecture(model_type, module), f"{version} builds mlx_lm.models.{name}; {KERNELS_NOTE}"


def module_name(config: dict[str, Any], utils: ModuleType) -> str:
    """The ``mlx_lm.models`` module serving ``config``, by mlx-lm's own remapping (by the
    ``architectures`` entry first, then by model type: ``mistral`` is ``llama``)."""
    model_type = str(config.get("model_type"))
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_architecture = getattr(utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    for architecture in architectures if isinstance(architectures, (list, tuple)) else ():
        remapped = by_architecture.get((model_type, architecture))
        if remapped is not None:
            return str(remapped)
    return str(getattr(utils, "MODEL_REMAPPING", {}).get(model_type, model_type))


class MlxLmArchitecture:
    """One mlx-lm model type as an :class:`~mlxr_core.model.arch.Architecture`."""

    def __init__(self, model_type: str, module: ModuleType):
        self.model_type = model_type
        self.module = module

    def _model(self, config: dict[str, Any]) -> nn.Module:
        module = self.module.__name__.rsplit(".", 1)[-1]
        args = self.module.ModelArgs.from_dict(mlx_lm_config(config, self.module.ModelArgs, module))
        model: nn.Module = bridged(self.module.Model)(args)
        return model

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """mlx-lm's ``Model`` taking the engine's call (see :func:`bridged`); ``kernels`` are not
        used inside it."""
        model = self._model(config)
        model.cache_layout = cache_layout(model, self.model_type)
        return model

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """The model's own ``sanitize`` (Hugging Face names and layouts to mlx-lm's: stacked
        experts, split projections, dropped rotary tables), as ``mlx_lm.load`` applies it."""
        if not callable(getattr(self.module.Model, "sanitize", None)):
            return weights
        # A throwaway instance (its random weights are never evaluated): sanitize reads its args.
        sanitized: dict[str, mx.array] = self._model(config).sanitize(dict(weights))
        return sanitized

    def make_cache(self, model: nn.Module) -> list[Any]:
        """One mlxr cache per cache mlx-lm would make: keys and values (window layers included)
        or a recurrent state."""
        return make_caches(model.cache_layout, getattr(model, "state_bytes", None))

    def check_loaded(self, model: nn.Module) -> None:
        """Refuse a model whose graph does not batch as the engine batches (the engine serves
        every model batched): see :func:`batch_problem`. Then measure what each recurrent
        layer's state takes per sequence (the KV budget reserves it)."""
        problem = batch_problem(model, lambda: self.make_cache(model))
        if problem is not None:
            raise ModelLoadError(f"mlx-lm's {self.model_type} {problem}")
        cache = self.make_cache(model)
        mx.eval(model(mx.array([[1]]), cache=cache))
        model.state_bytes = tuple(0 if layer.attends else layer.nbytes for layer in cache)

    def context_length(self, config: dict[str, Any]) -> int:
        """``max_position_embeddings`` (or the family's name for it), else :data:`DEFAULT_CONTEXT`."""
        value = _first(config, CONTEXT_KEYS)
        return int(value) if value else DEFAULT_CONTEXT

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Head counts and head size from the config, as far as it names them: the engine sizes
        its key/value reservations from them (an estimate for latent-attention families, whose
        caches are smaller). Kernels are not bound inside mlx-lm's graph."""
        heads = int(_first(config, HEAD_KEYS) or 1)
        hidden = int(_first(config, HIDDEN_KEYS) or 0)
        head_dim = int(config.get("head_dim") or (hidden // heads if hidden else 128))
        kv_heads = int(_first(config, KV_HEAD_KEYS) or heads)
        return {"head_dim": head_dim, "n_heads": heads, "n_kv_heads": kv_heads, "masks": ("causal", "array")}

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """The backbone's output (mlx-lm's ``model.model``, or ``model.backbone`` in its Mamba
        families: after the final norm, before the LM head); a model type without one gives no
        hidden states (nor embeddings)."""
        backbone = next(
            (part for name in ("model", "backbone") if isinstance(part := getattr(model, name, None), nn.Module)),
            None,
        )
        if backbone is None:
            raise MlxrError(
                f"mlx-lm's {self.model_type} has no `model` or `backbone` to read hidden states from, "
                "so the mlx-lm bridge cannot compute its embeddings"
            )
        hidden: mx.array = backbone(inputs, cache=views(model, cache))
        return hidden


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[key] for key in keys if config.get(key)), None)


@functools.cache
def bridged(model_class: type) -> type:
    """``model_class`` (an mlx-lm ``Model``) called as mlxr's engine calls a model,
    ``model(inputs, cache=caches, mask=mask)``: the caches go to mlx-lm as :class:`CacheView`
    objects, which make the masks (the engine's ``mask`` is the batch's padding mask, which
    they rebuild). Its parameters keep mlx-lm's names, so checkpoints load as they do there."""

    def __call__(self: nn.Module, inputs: mx.array, cache: list[Any] | None = None, mask: Any = None) -> mx.array:
        logits: mx.array = model_class.__call__(self, inputs, cache=views(self, cache))
        return logits

    return type("BridgedModel", (model_class,), {"__call__": __call__, "__module__": __name__})
