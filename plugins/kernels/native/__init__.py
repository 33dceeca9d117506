"""mlxr's native CPU kernels: an MLX C++ extension (a custom primitive), compiled on first use.

The sources (``qmm.cpp`` with ``qmm_kernels.h``: the packed matmul; ``ops.cpp``: RMS norm, RoPE,
attention) are compiled with the system's C++ compiler against the installed MLX's headers and
library and the nanobind that MLX was built with (``mlxr[cpu]`` pins it), with ``-march=native``
(``-mcpu=native`` on arm64): the machine that runs it gets its own SIMD (AVX-512, AVX2, NEON,
else plain C++).
The library lands in a cache folder (``$MLXR_KERNEL_CACHE``, else ``~/.cache/mlxr/kernels``) under
a name hashed from everything that shapes it (source, MLX, nanobind, compiler, Python ABI, CPU
flags), so a new MLX or a different CPU builds anew and an unchanged one loads in milliseconds.

Building is bounded (:data:`BUILD_TIMEOUT_S` per compiler run), locked (one process builds, the
others wait on a file lock and load its result: pytest-xdist workers, server ranks), logged, and
never raises: :func:`load` returns the module or the reason it could not, which the backend's
``supports()`` reports (``mlxr kernels``) so ``auto`` falls back to the next backend.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("qmm.cpp"), Path(__file__).with_name("ops.cpp"))
#: Headers the sources include (part of the build key).
HEADERS = (Path(__file__).with_name("qmm_kernels.h"),)
MODULE_NAME = "_mlxr_qmm"
#: Seconds one compiler run may take (two run at once, then the link).
BUILD_TIMEOUT_S = 240
#: Seconds a process waits for another one's build before giving up.
LOCK_TIMEOUT_S = 3 * BUILD_TIMEOUT_S
#: MLX's Python module is built with nanobind's domain ``mlx``: an extension passing ``mx.array``
#: across must share it (and nanobind's ABI version) or the array type is not recognised.
NB_DOMAIN = "mlx"


def cache_dir() -> Path:
    """Where built kernels are kept: ``$MLXR_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/mlxr/kernels``."""
    configured = os.environ.get("MLXR_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxr" / "kernels"


def default_threads() -> int:
    """Threads the kernels use: ``OMP_NUM_THREADS``, else ``OPENBLAS_NUM_THREADS`` (what ``mlxr
    launch`` gives each rank on a shared machine), else the CPUs this process may run on."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The extension module, built if needed, and ``""``; or None and why it cannot be had.

    Cached for the process: the build or its failure happens once."""
    try:
        module = _load()
    except _Unavailable as exc:
        log.info("native CPU kernels unavailable: %s", exc)
        return None, str(exc)
    module.set_num_threads(default_threads())
    return module, ""


class _Unavailable(Exception):
    """Why the extension cannot be built or loaded (the message is the reason shown)."""


def _load() -> ModuleType:
    if sys.platform != "linux":
        raise _Unavailable(
            f"built on Linux only for now (this machine: {platform.system()} {platform.machine()})"
        )
    compiler = _compiler()
    try:
        import mlx.core as mx
        import nanobind
    except ImportError as exc:
        raise _Unavailable(f"{exc.name} is not installed: pip install 'mlxr[cpu]'") from None
    python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").exists():
        raise _Unavailable(
            f"Python's C headers are missing ({python_include}/Python.h): install the python3-dev "
            "package of this Python"
        )
    # The folder of the MLX that runs: ``mlx`` is a namespace package, so ``mlx.__path__`` may
    # list another folder named mlx first (one on sys.path before site-packages).
    mlx_dir = Path(mx.__file__).parent
    if not (mlx_dir / "include" / "mlx" / "primitives.h").exists():
        raise _Unavailable(f"the installed MLX ships no C++ headers ({mlx_dir}/include)")
    key = _build_key(compiler, str(getattr(mx, "__version__", "")), str(getattr(nanobind, "__version__", "")))
    folder = cache_dir()
    target = folder / f"{MODULE_NAME}-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.exists():
        _build_locked(compiler, target, mlx_dir, Path(nanobind.__path__[0]), python_include)
    return _import(target)


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise _Unavailable("no C++ compiler found (g++, c++ or $CXX): install g++ (apt-get install g++)")


def _build_key(compiler: str, mlx_version: str, nanobind_version: str) -> str:
    """A hash of everything the built library depends on."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _Unavailable(f"{compiler} --version failed: {exc}") from None
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        mlx_version.encode(),
        nanobind_version.encode(),
        "".join(version).encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
        _cpu_flags().encode(),
        " ".join(_flags(Path("."), Path("."), Path("."))).encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def _flags(mlx_dir: Path, nanobind_dir: Path, python_include: Path) -> list[str]:
    arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    return [
        "-O3", arch, "-fPIC", "-fvisibility=hidden", "-DNDEBUG", f"-DNB_DOMAIN={NB_DOMAIN}",
        f"-I{nanobind_dir / 'include'}", f"-I{nanobind_dir / 'ext' / 'robin_map' / 'include'}",
        f"-I{mlx_dir / 'include'}", f"-I{python_include}",
    ]


def _build_locked(
    compiler: str, target: Path, mlx_dir: Path, nanobind_dir: Path, python_include: Path
) -> None:
    """Build ``target`` unless another process is doing it (then wait for its result)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the build
    except OSError as exc:
        raise _Unavailable(f"cannot write the kernel cache {target.parent}: {exc}") from None
    with lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        waited = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.warning("waiting for another process compiling mlxr's native CPU kernels...")
                    waited = True
                if time.monotonic() > deadline:
                    raise _Unavailable(
                        f"another process held the build lock of {target} for over "
                        f"{LOCK_TIMEOUT_S} s"
                    ) from None
                time.sleep(0.2)
        try:
            if not target.exists():  # the lock's previous holder may have built it
                # A warning, so a command that configures no logging (mlxr generate) shows it too:
                # the build takes tens of seconds with nothing else printed.
                log.warning("compiling mlxr's native CPU kernels (once per MLX version and machine, "
                            "up to a minute)...")
                _build(compiler, target, mlx_dir, nanobind_dir, python_include)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(
    compiler: str, target: Path, mlx_dir: Path, nanobind_dir: Path, python_include: Path
) -> None:
    """Compile nanobind's runtime and the sources side by side, link, move into place atomically."""
    flags = _flags(mlx_dir, nanobind_dir, python_include)
    started = time.perf_counter()
    log.info("compiling the native CPU kernels into %s (once per MLX version and machine)", target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as work:
        objects = [Path(work) / "nanobind.o", *(Path(work) / f"{source.stem}.o" for source in SOURCES)]
        compiles = [
            [compiler, "-std=c++17", *flags, "-c", str(nanobind_dir / "src" / "nb_combined.cpp"),
             "-o", str(objects[0])],
            *([compiler, "-std=c++20", "-pthread", *flags, "-c", str(source), "-o", str(obj)]
              for source, obj in zip(SOURCES, objects[1:], strict=True)),
        ]
        _run_all(compiles, target)
        linked = Path(work) / target.name
        lib = mlx_dir / "lib"
        _run_all(
            [[compiler, "-shared", "-pthread", *map(str, objects), f"-L{lib}", "-lmlx",
              f"-Wl,-rpath,{lib}", "-o", str(linked)]],
            target,
        )
        os.replace(linked, target)
    log.info("native CPU kernels built in %.1f s", time.perf_counter() - started)


def _run_all(commands: list[list[str]], target: Path) -> None:
    """Run ``commands`` at once, each within :data:`BUILD_TIMEOUT_S`; the first failure raises
    with the compiler's last lines (the whole output goes to a log beside ``target``)."""
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command in commands
    ]
    failure = None
    for command, proc in zip(commands, procs, strict=True):
        try:
            output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failure = failure or f"{Path(command[0]).name} ran past {BUILD_TIMEOUT_S} s"
            continue
        if proc.returncode != 0 and failure is None:
            log_path = target.with_suffix(".log")
            log_path.write_text(" ".join(command) + "\n" + output)
            tail = " | ".join(output.strip().splitlines()[-3:])
            failure = f"compiling failed ({tail}); full output in {log_path}"
    if failure is not None:
        raise _Unavailable(failure)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    if spec is None:
        raise _Unavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as exc:
        raise _Unavailable(f"cannot load {path}: {exc}") from None
    _check(module)
    return module


def _check(module: ModuleType) -> None:
    """One small product against MLX's own: a library that loads but cannot take MLX's arrays
    (another nanobind ABI) or computes wrong is refused here, not at the first token."""
    import mlx.core as mx

    x = mx.arange(64, dtype=mx.float32).reshape(1, 64) / 64
    w, scales, biases = mx.quantize(mx.ones((4, 64)) * mx.arange(64) / 32, group_size=32, bits=4)
    try:
        with mx.stream(mx.cpu):
            got = module.quantized_matmul(x, w, scales, biases, 32, 4)
            want = mx.quantized_matmul(x, w, scales, biases, group_size=32, bits=4)
            ok = bool(mx.allclose(got, want, rtol=1e-4, atol=1e-4))
    except TypeError as exc:
        raise _Unavailable(
            f"the built library cannot take MLX's arrays (nanobind ABI mismatch?): {exc}"
        ) from None
    if not ok:
        raise _Unavailable("the built library's self-check differs from mx.quantized_matmul")
