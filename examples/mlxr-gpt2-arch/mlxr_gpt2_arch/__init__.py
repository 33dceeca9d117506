"""mlxr-gpt2-arch: an example third-party mlxr plugin adding the GPT-2 architecture.

Registration names a ``"module:attr"`` string, so ``mlxr plugins`` never imports MLX through this
plugin; :mod:`mlxr_gpt2_arch.gpt2` is imported when a ``gpt2`` checkpoint is loaded.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl


@hookimpl
def mlxr_register_archs(register: RegisterName) -> None:
    """Register ``gpt2``, the ``model_type`` of Hugging Face GPT-2 checkpoints."""
    register("gpt2", "mlxr_gpt2_arch.gpt2:GPT2Architecture")
