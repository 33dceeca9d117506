"""A drafter's own checkpoint (``models[].speculative.path``: an EAGLE-3 head, a DFlash drafter)
read beside the target: the folder opened and recognized, errors naming the config key, and the
head made ready once its weights are in."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ConfigError, MlxrError, ModelLoadError
from mlxr_core.model.layers import CausalLM
from mlxr_core.model.loader import DTYPES, LoadedModel
from mlxr_core.model.paths import resolve_model_path
from mlxr_core.model.stages import open_checkpoint
from mlxr_plugins.decoders.mtp import METHOD_KEY

PATH_KEY = "models[].speculative.path"


@dataclasses.dataclass
class DraftFolder:
    """An opened draft folder: what errors say (``where``), its path, the target, its config and tensors."""

    where: str
    path: str
    target: CausalLM
    config: dict[str, Any]
    weights: dict[str, mx.array]

    def not_fitting(self, exc: Exception) -> ModelLoadError:
        """The load error of a config key or tensor of the draft that does not fit the target."""
        key = getattr(exc, "key", None)
        return ModelLoadError(f"{self.where}: the draft {self.path} does not fit{f' ({key})' if key else ''}: {exc}",
                              path=self.path)  # fmt: skip

    def ready(self, head: nn.Module, layers: tuple[int, ...], dtype: str) -> None:
        """Check that the target's layers record their inputs for ``layers`` (a family with its
        own layer loop does not: ConfigError naming the method), then ``head`` in ``dtype``, evaluated."""
        try:
            self.target.forward_hidden(mx.zeros((1, 1), dtype=mx.int32), None, None, layers)
        except MlxrError as exc:
            raise ConfigError(f"{self.where}: {exc}", field=METHOD_KEY) from None
        head.set_dtype(DTYPES[dtype])
        mx.eval(head.parameters())
        head.eval()


def open_draft(model: LoadedModel, registries: Any, method: str, kind: str, architectures: tuple[str, ...]) -> DraftFolder:
    """``model``'s draft folder of ``method`` (a ``kind`` checkpoint whose config names one of
    ``architectures``), read in the model's dtype. Raises ConfigError naming
    ``models[].speculative.path`` for a missing, unreadable or foreign folder, and
    ``models[].speculative.method`` for a target that hands over no hidden states."""
    where = f"model {model.name}: speculative method {method}"
    path = model.speculative.path if model.speculative is not None else None
    if not path:
        raise ConfigError(f"{where} needs the {kind} draft folder", field=PATH_KEY)
    target = model.model
    if not isinstance(target, CausalLM):
        raise ConfigError(f"{where}: the {model.config.get('model_type')!r} model hands over no hidden states",
                          field=METHOD_KEY)  # fmt: skip
    try:
        opened = open_checkpoint(resolve_model_path(path), registries, dtype=model.dtype)
    except MlxrError as exc:
        raise ConfigError(f"{where}: the draft {path} cannot be read: {exc}", field=PATH_KEY) from None
    config = opened.checkpoint.config
    named = config.get("architectures") or []
    if not any(name in architectures for name in named):
        raise ConfigError(f"{where}: {path} is no {kind} draft (its config names {named}, not one of "
                          f"{list(architectures)})", field=PATH_KEY)  # fmt: skip
    return DraftFolder(where, str(path), target, config, dict(opened.checkpoint.weights))
