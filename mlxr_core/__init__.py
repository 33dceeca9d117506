"""mlxr: a plugin-based LLM inference runtime on MLX.

Importing this package is cheap: it never imports MLX. The heavy pieces live in
:mod:`mlxr_core.model` and :mod:`mlxr_core.engine` and are imported when used.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mlxr")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


# MLX's Linux CPU wheel bundles a reference BLAS; preloading OpenBLAS before anything imports
# mlx.core makes CPU matmuls ~25x faster. A no-op elsewhere and when MLX is already imported.
from mlxr_core.blas import ensure_fast_blas

ensure_fast_blas()

__all__ = ["__version__"]
