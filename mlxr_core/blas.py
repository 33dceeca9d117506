"""A fast BLAS for MLX's CPU backend on Linux, without the user asking.

The Linux ``mlx[cpu]`` wheel links a bundled reference (netlib) BLAS; OpenBLAS makes its matmuls
about 25x faster on CPU. Loading an OpenBLAS library with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported makes the dynamic linker resolve MLX's ``cblas_*`` symbols to it. :func:`ensure_fast_blas`
does that once, and is a no-op on macOS (Accelerate), when MLX is already imported, or when
``MLXR_BLAS=off``. ``MLXR_BLAS=/path/libopenblas.so`` picks a library explicitly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

#: Where Debian/Ubuntu (``libopenblas0-pthread``), Fedora and conda put OpenBLAS.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_state: dict[str, str | None] = {}


def find_openblas() -> str | None:
    """The first OpenBLAS shared library found on this machine, or None."""
    prefix = Path(sys.prefix) / "lib" / "libopenblas.so.0"
    for candidate in (str(prefix), *CANDIDATES):
        if os.path.exists(candidate):
            return candidate
    return ctypes.util.find_library("openblas")


def ensure_fast_blas() -> str | None:
    """Preload OpenBLAS for MLX's CPU backend if possible; return the library used, or None.

    Safe to call many times; only the first call acts.
    """
    if "result" in _state:
        return _state["result"]
    _state["result"] = None
    setting = os.environ.get("MLXR_BLAS", "auto").strip()
    if not sys.platform.startswith("linux") or setting.lower() in {"off", "0", "none"}:
        return None
    if "mlx.core" in sys.modules:
        log.debug("mlx.core was imported before mlxr: cannot preload a fast BLAS")
        return None
    library = find_openblas() if setting.lower() in {"", "auto"} else setting
    if library is None:
        log.info(
            "no OpenBLAS found: MLX's CPU matmuls use the slow reference BLAS "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        )
        return None
    try:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        log.warning("could not load %s (%s); MLX keeps its bundled BLAS", library, exc)
        return None
    _state["result"] = library
    log.debug("preloaded %s for MLX's CPU backend", library)
    return library
