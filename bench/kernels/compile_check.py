"""Compile the ``cuda``, ``cuda_norm`` and ``cuda_qmv`` backends' kernels offline with ``nvcc`` and print their
resource usage.

    python bench/kernels/compile_check.py [--arch sm_90] [--keep DIR]

Needs ``nvcc`` (CUDA 12.8+ / 13), no GPU. It writes each kernel as ``mx.fast.cuda_kernel`` would
hand it to NVRTC (MLX's generated signature, ``constexpr`` template arguments, our header and
body), with a small stand-in for MLX's ``device/utils.cuh`` (only ``Shape``/``Strides`` are used),
for every dtype, head dim and heads-per-block the backend instantiates, and prints registers,
spills and shared memory per instantiation (``ptxas -v``): spills in the split kernel would mean
the register budget behind ``heads_per_block`` is wrong.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxr_plugins.kernels import cuda

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
using mlx::core::cu::Shape;
using mlx::core::cu::Strides;
"""


def signature(name: str, inputs: dict[str, str], outputs: dict[str, str], source: str) -> str:
    """The ``__global__`` signature MLX generates: shape/strides only where the body uses them."""
    params = []
    for arg, ctype in inputs.items():
        params.append(f"const {ctype}* {arg}")
        if f"{arg}_shape" in source:
            params.append(f"const __grid_constant__ Shape {arg}_shape")
        if f"{arg}_strides" in source:
            params.append(f"const __grid_constant__ Strides {arg}_strides")
    params += [f"{ctype}* {arg}" for arg, ctype in outputs.items()]
    return f"__global__ void {name}(\n    " + ",\n    ".join(params) + ") {\n"


def kernel_text(name: str, header: str, source: str, inputs: dict[str, str],
                outputs: dict[str, str], template: dict[str, str | int]) -> str:
    consts = "".join(
        f"  using {key} = {value};\n" if isinstance(value, str) else f"  constexpr int {key} = {value};\n"
        for key, value in template.items()
    )
    return (PRELUDE + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            + signature(name, inputs, outputs, source) + consts + source + "\n}\n}\n")


def instantiations() -> list[tuple[str, str]]:
    """(label, CUDA text) for each kernel variant the backend can launch."""
    out: list[tuple[str, str]] = []
    for dtype, ctype in CUDA_TYPES.items():
        for D in cuda.FUSED_HEAD_DIMS:
            for ratio in (1, 2, 4, 8):
                layout = cuda.layout_for(1, 8 * ratio, 8, D, getattr(mx, dtype), D**-0.5, 8)
                template: dict[str, str | int] = {
                    key: ctype if key == "T" else value for key, value in layout.template
                }
                name = f"flash_decode_{dtype}_D{D}_H{layout.heads_per_block}_U{layout.keys_per_step}"
                if any(label == name for label, _ in out):
                    continue
                out.append((name, kernel_text(
                    name, cuda._HEADER, cuda._SOURCE,
                    {"q": ctype, "k": ctype, "v": ctype}, {"o": ctype, "ws": "float"}, template,
                )))
    from mlxr_plugins.kernels import cuda_norm

    for dtype, ctype in CUDA_TYPES.items():
        for D in (640, 2048, 4096, 8192):
            template = {"T": ctype, "D": D, "THREADS": cuda_norm.THREADS, "EPS_BITS": 925353388}
            out.append((f"add_rms_norm_{dtype}_D{D}", kernel_text(
                f"add_rms_norm_{dtype}_D{D}", "", cuda_norm._SOURCE,
                {"x": ctype, "y": ctype, "w": ctype}, {"h": ctype, "n": ctype}, template,
            )))
    from mlxr_plugins.kernels import cuda_qmv

    shapes = [(3072, 2048), (16384, 2048), (2048, 8192), (512, 2048), (4096, 4096)]
    for dtype, ctype in CUDA_TYPES.items():
        for bits in cuda_qmv.BITS:
            for n, k in shapes:
                plan = cuda_qmv.layout(n, k, bits, 64)
                out.append(qmv_text(plan, dtype, ctype))
    # The layouts the tests force (benchmarks sweep them too).
    for splits, rows_per_warp in ((8, 1), (4, 2), (1, 4), (2, 2)):
        out.append(qmv_text(cuda_qmv.layout(1000, 2048, 4, 64, splits, rows_per_warp), "bfloat16", "__nv_bfloat16"))
    for in_flight in (1, 4):
        out.append(qmv_text(cuda_qmv.layout(1000, 8192, 4, 64, 1, 1, in_flight=in_flight), "bfloat16",
                            "__nv_bfloat16"))
    return out


def qmv_text(plan: Any, dtype: str, ctype: str) -> tuple[str, str]:
    """(label, CUDA text) of one ``cuda_qmv`` instantiation."""
    from mlxr_plugins.kernels import cuda_qmv

    template = {key: ctype if key == "T" else value for key, value in plan.template(mx.float32)}
    name = (f"qmv_{dtype}_{plan.bits}bit_{plan.n}x{plan.k}_S{plan.splits}_R{plan.rows_per_warp}"
            f"_U{plan.in_flight}")
    return name, kernel_text(name, cuda_qmv._HEADER, cuda_qmv._SOURCE,
                             {"x": ctype, "w": "uint32_t", "scales": ctype, "biases": ctype}, {"o": ctype},
                             template)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--keep", type=Path, help="also write the .cu files here")
    parser.add_argument("--only", default="", help="only the kernels whose label starts with this")
    args = parser.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found", file=sys.stderr)
        return 1
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for label, text in instantiations():
            if not label.startswith(args.only):
                continue
            path = Path(args.keep or tmp) / f"{label}.cu"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            proc = subprocess.run(
                [nvcc, f"-arch={args.arch}", "-std=c++17", "-cubin", "-Xptxas", "-v",
                 "-o", str(path.with_suffix(".cubin")), str(path)],
                capture_output=True, text=True,
            )
            if proc.returncode:
                failed += 1
                print(f"{label}: FAILED\n{proc.stderr}")
                continue
            usage = re.findall(r"Used (\d+) registers.*", proc.stderr)
            spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
            smem = re.findall(r"(\d+) bytes smem", proc.stderr)
            print(f"{label:40s} registers {usage[-1] if usage else '?':>4}  "
                  f"spill st/ld {'/'.join(spills[-1]) if spills else '?':>7}  "
                  f"smem {smem[-1] if smem else '0':>6} B")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
