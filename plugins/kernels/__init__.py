"""Built-in kernel backends: a pure-``mx`` reference for every op and ``mx.fast`` ones.

Importing this module is cheap (no MLX): backends are registered as ``"module:attr"`` strings and
imported when a model binds its kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.plugins import hookimpl

if TYPE_CHECKING:
    from mlxr_core.hookspecs import RegisterKernel
    from mlxr_core.kernels import KernelContext

#: Kernels are needed to run any model; ``--disable kernels`` would leave nothing to bind.
MLXR_ESSENTIAL = True

#: backend -> (module, priority): ``auto`` prefers the fast one wherever it supports the context.
BACKENDS = {
    "mlx_fast": ("mlxr_plugins.kernels.mlx_fast", 10),
    "reference": ("mlxr_plugins.kernels.reference", 0),
}


def _no_reasons(ctx: KernelContext) -> list[str]:
    return []


@attrs.frozen
class KernelImpl:
    """A kernel backend made of a function and a support check (see ``mlxr_core.kernels``)."""

    op: Callable[..., Any]
    check: Callable[[KernelContext], list[str]] = _no_reasons

    def supports(self, ctx: KernelContext) -> list[str]:
        """Reasons this backend cannot run in ``ctx``; empty when it can."""
        return self.check(ctx)


@hookimpl
def mlxr_register_kernels(register: RegisterKernel) -> None:
    """Register ``reference`` and ``mlx_fast`` for every op in ``mlxr_core.kernels.OPS``."""
    from mlxr_core.kernels import OPS

    for backend, (module, priority) in BACKENDS.items():
        for op in OPS:
            register(op, backend, f"{module}:{op}_kernel", priority=priority)
