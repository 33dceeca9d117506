"""The packed matmul's kernels (``qmm_kernels.h``) without MLX, once per SIMD layer: this machine's
build, x86-64's plain C++ and AVX2 builds, and arm64's NEON build run under qemu where the cross
compiler and the emulator are installed (``.ci/run`` installs them; elsewhere that case skips with
the reason). Each build checks every packed width, group size and scale dtype against a plain
double-precision sum (``native_kernels_check.cpp``)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from mlxr_plugins.kernels import native

HERE = Path(__file__).parent
CHECK = HERE / "native_kernels_check.cpp"
HEADERS = Path(native.__file__).parent


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_and_run(tmp_path: Path, compiler: str, flags: list[str], runner: list[str] | None = None) -> str:
    binary = tmp_path / "check"
    subprocess.run(
        [compiler, "-std=c++20", "-O2", *flags, f"-I{HEADERS}", str(CHECK), "-o", str(binary)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    result = subprocess.run([*(runner or []), str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


#: The int8 cases the check runs on a layer with integer dot products (4 and 8 bits), and those
#: it adds for 5 bits where the layer also has VBMI.
INT8_CASES = 1018
INT8_CASES_PER_WIDTH = 509

X86_LAYERS = {
    "native": (["-march=native"], None),  # this machine's: AVX-512 or AVX2 where it has them
    "scalar": (["-march=x86-64"], "scalar"),  # no AVX2: the plain C++ path
    "avx2": (["-march=haswell"], "avx2"),
}


@pytest.mark.parametrize("layer", sorted(X86_LAYERS))
def test_x86_layers_match_the_plain_sum(tmp_path: Path, layer: str) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"an x86-64 build: this machine is {platform.machine()}")
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    if layer == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C to run the AVX2 build")
    flags, isa = X86_LAYERS[layer]
    out = build_and_run(tmp_path, "g++", flags)
    # The int8 decode tiles exist where the build has AVX-512 VNNI (this machine's, if its CPU has it).
    int8 = layer == "native" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()
    five = int8 and "avx512vbmi" in cpu_flags()  # 5-bit weights through the int8 tiles
    expected = (INT8_CASES + (INT8_CASES_PER_WIDTH if five else 0)) if int8 else 0
    assert out.endswith(f"1080 cases ok, {expected} int8 cases ok"), out
    if isa is not None:
        assert out.startswith(f"{isa}:"), out


def test_neon_layer_matches_the_plain_sum(tmp_path: Path) -> None:
    if platform.machine() in ("aarch64", "arm64"):
        compiler, runner = "g++", None
    else:
        compiler, emulator = "aarch64-linux-gnu-g++", "qemu-aarch64-static"
        missing = [tool for tool in (compiler, emulator) if shutil.which(tool) is None]
        if missing:
            pytest.skip(f"no arm64 cross build here: {', '.join(missing)} missing "
                        "(apt-get install g++-aarch64-linux-gnu qemu-user-static)")
        runner = [emulator]
    out = build_and_run(tmp_path, compiler, ["-march=armv8-a", *(["-static"] if runner else [])], runner)
    assert out == "neon: 1080 cases ok, 0 int8 cases ok", out


def test_extension_sources_compile_for_arm64(tmp_path: Path) -> None:
    """The whole extension (``qmm.cpp``, ``ops.cpp``) compiles for arm64 against the installed
    MLX's headers (it is linked and run on arm64 machines only; here it is compiled alone)."""
    import sysconfig

    import mlx.core as mx
    import nanobind

    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip("an arm64 machine builds and runs the extension itself (test_cpu_native.py)")
    compiler = "aarch64-linux-gnu-g++"
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} missing (apt-get install g++-aarch64-linux-gnu)")
    nb = Path(nanobind.__path__[0])
    includes = [nb / "include", nb / "ext" / "robin_map" / "include", Path(mx.__file__).parent / "include",
                Path(sysconfig.get_paths()["include"])]
    for source in native.SOURCES:
        result = subprocess.run(
            [compiler, "-std=c++20", "-O1", "-march=armv8.2-a+fp16", "-fPIC", *(f"-I{d}" for d in includes),
             "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")],
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]


def test_a_build_says_so_before_it_starts_even_where_no_logging_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``mlxr generate`` configures no logging: only a warning reaches the terminal while the
    kernels compile for tens of seconds (it printed nothing)."""
    built: list[Path] = []
    monkeypatch.setattr(native, "_build", lambda compiler, target, *rest: built.append(target))
    target = tmp_path / "kernels.so"
    with caplog.at_level("WARNING", logger=native.log.name):
        native._build_locked("c++", target, tmp_path, tmp_path, tmp_path)
    assert built == [target]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "compiling" in caplog.records[0].getMessage()
