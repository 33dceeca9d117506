#!/usr/bin/env bash
# cuda_qmv (the one-row packed matmul kernel) on the GPU machine: run from the repository root with
# mlxr installed (`pip install .`) over MLX's CUDA backend. Writes everything under $OUT (default
# bench/kernels/results/qmv). Each part has its own time limit (about 9 minutes in all), most
# important first, so that one that fails or hangs leaves the others' results. MLX keeps the
# kernels NVRTC compiled in its PTX cache: a later part does not compile an instantiation again.
set -u
out=${OUT:-bench/kernels/results/qmv}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# 1. Parity first (exits 1 on a mismatch, before timing): the kernel against the float64 product
#    over dtypes, group sizes, bit widths and work splits, mx.quantized_matmul's error beside it;
#    then mx.quantized_matmul against the kernel per Llama-3.2-1B / Qwen3-30B-A3B layer, 4 and 8 bits.
timeout 170 python3 bench/kernels/qmv_one_row.py --check --bits 4 8 --out "$out/qmv.json" \
  > "$out/qmv.txt" 2>&1
echo "qmv_one_row exit $?"
grep -v '^WARNING' "$out/qmv.txt" | tail -26
# 2. A 4-bit Llama-3.2-1B decode step, one stream: the defaults against quantized_matmul=cuda_qmv.
timeout 110 python3 bench/batched_step.py --weights q4 --rows 1 --rounds 2 --steps 100 \
  --variants auto quantized_matmul=cuda_qmv --out "$out/step_llama_q4.json" > "$out/step_llama_q4.txt" 2>&1
echo "batched_step exit $?"
tail -8 "$out/step_llama_q4.txt"
# 3. The kernel's GPU tests: parity over more shapes and layouts, input shapes, the registry's
#    parity harness, a tiny 4-bit Llama's greedy tokens through cuda_qmv against mlx_fast.
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 0 tests/plugins/kernels/test_device_kernels.py \
  -k qmv > "$out/pytest_qmv.txt" 2>&1
tail -12 "$out/pytest_qmv.txt"
# 4. Every work split (splits of the reduction x rows per warp) per 4-bit layer.
timeout 70 python3 bench/kernels/qmv_one_row.py --sweep --out "$out/qmv_sweep.json" > "$out/qmv_sweep.txt" 2>&1
grep -v '^WARNING' "$out/qmv_sweep.txt" | tail -12
# 5. Device time per call (cold L2, each kernel alone) under Nsight Compute.
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  timeout 60 "$ncu" --target-processes all --metrics gpu__time_duration.sum --csv \
    --kernel-name regex:"qmv|qmm|gemv|marker" \
    --log-file "$out/qmv_ncu.csv" python3 bench/kernels/qmv_one_row.py --ncu-calls 3 \
    --out "$out/qmv_ncu_run.json" > "$out/qmv_ncu_stdout.txt" 2>&1
  python3 bench/kernels/qmv_one_row.py --ncu-calls 3 --summarize-ncu "$out/qmv_ncu.csv" \
    --out "$out/qmv_ncu.json" 2>&1 | tail -26
fi
