#!/usr/bin/env bash
# The GPU half of bench/kernels (see README.md): run from the repository root on the GPU machine,
# after `.gpu/a/*` has been copied to /root/gpu-parts/ and with `.gpu/b` and `.gpu/wheels` present
# (../shared/tools/gpu/README.md). Writes everything under $OUT (default bench/kernels/results).
set -u
out=${OUT:-bench/kernels/results}
mkdir -p "$out/ncu"
source .gpu/b/unpack.sh > /dev/null 2>&1 || { echo "unpack failed" >&2; exit 3; }
pip install --no-deps --no-build-isolation --no-index -q --target /root/site . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
# 1. The CPU suite's CUDA tests, which skip everywhere else.
python3 -m pytest -q -p no:cacheprovider tests/plugins/kernels/test_device_kernels.py 2>&1 \
  | tail -4 > "$out/pytest_gpu.txt"
cat "$out/pytest_gpu.txt"
# 2. Parity over dtypes/GQA/head dims/layouts, attention timings, end-to-end decode.
python3 bench/kernels/decode_attention.py --out "$out" 2>&1 | grep -v '^WARNING' > "$out/log.txt"
cat "$out/decode_attention.txt"
# 3. Kernel time alone under Nsight Compute (cold L2, real clocks).
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 240 "$ncu" --target-processes all --clock-control none --metrics gpu__time_duration.sum \
  --csv --log-file "$out/ncu/ncu.csv" \
  python3 bench/kernels/decode_attention.py --sections profile --out "$out/ncu" \
  > "$out/ncu/ncu_stdout.txt" 2>&1
python3 bench/kernels/decode_attention.py --summarize-ncu "$out/ncu/ncu.csv" --out "$out/ncu" \
  | cut -c1-110
