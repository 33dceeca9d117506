"""The mlx-lm bridge: serves every model type mlx-lm implements and mlxr has no architecture for,
through mlx-lm's own model classes, on mlxr's engine (continuous batching, the prefix cache,
streaming). Installed with ``pip install 'mlxr[mlx-lm]'``.

It registers an architecture fallback (``mlxr_register_arch_fallbacks``): the loader asks it only
for a model type no architecture plugin registers, so a native architecture always wins. This
module only lists mlx-lm's model files, without importing mlx-lm, so ``mlxr plugins`` stays cheap;
the graphs are imported when a model loads (:mod:`.architecture`). Disable it like any plugin
(``plugins.disable: [mlx_lm_bridge]``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from mlxr_core.plugin_api import hookimpl

if TYPE_CHECKING:
    from mlxr_core.plugin_api import RegisterName

MLXR_HOOK_API = "1.1"
#: How to get the bridge's one dependency.
INSTALL = "pip install 'mlxr[mlx-lm]'"
LABEL = "mlx-lm bridge"


@functools.cache
def mlx_lm_folder() -> Path | None:
    """Where mlx-lm is installed (found without importing it), or None."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def model_types() -> tuple[str, ...] | None:
    """The model types mlx-lm implements: each ``mlx_lm/models/<type>.py`` with a ``ModelArgs``,
    and the aliases of its ``MODEL_REMAPPING`` (``mistral`` -> ``llama``); None when mlx-lm is
    not installed."""
    folder = mlx_lm_folder()
    if folder is None:
        return None
    names = {
        path.stem
        for path in (folder / "models").glob("*.py")
        if "class ModelArgs" in path.read_text(encoding="utf-8", errors="replace")
    }
    aliases = {alias for alias, target in _remapping(folder / "utils.py").items() if target in names}
    return tuple(sorted(names | aliases))


def _remapping(utils: Path) -> dict[str, str]:
    """mlx-lm's ``MODEL_REMAPPING`` literal, read from its source (empty if it moved)."""
    try:
        tree = ast.parse(utils.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "MODEL_REMAPPING" for target in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


@hookimpl
def mlxr_register_arch_fallbacks(register: RegisterName) -> None:
    """Register the bridge under ``mlx-lm`` (``models[].arch: mlx-lm`` forces it)."""
    served = model_types()
    register(
        "mlx-lm",
        "mlxr_plugins.archs.mlx_lm_bridge.architecture:MlxLmBridge",
        label=LABEL,
        model_types=list(served) if served is not None else None,
        unavailable=None if served is not None else f"mlx-lm is not installed: {INSTALL}",
    )
