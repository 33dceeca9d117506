#!/usr/bin/env bash
# Decode on a GPU, measured end to end and per kernel, in one command (run from the repository
# root on the GPU machine, after `.gpu/a/*` has been copied to /root/gpu-parts/ and with `.gpu/b`
# and `.gpu/wheels` present: ../shared/tools/gpu/README.md).
#
#   bash bench/roofline_gpu.sh [decode] [ncu]
#
# decode: bench/gpu_decode.py on the Llama-3.2-1B shape (bf16 and 4-bit g64) and on 12 of
#   Qwen3-30B-A3B's 48 layers (4-bit), 1, 8 and 32 streams, against mlx-lm's generate_step and
#   BatchGenerator in the same run, then the torch CUDA-graph decode loop (.gpu/b/torch_graph_peer.py,
#   a copy of ../shared/tools/gpu/torch_graph_peer.py) at 1, 8 and 32 rows on the same card.
# ncu: bench/batched_step.py's marked steps under Nsight Compute at 1, 8 and 32 rows for the same
#   three models, summarized per kernel: device time per step, kernels per step, and the weight
#   bytes a step reads over the device's busy time.
# Writes everything under $OUT (default bench/results/roofline).
set -u
out=${OUT:-bench/results/roofline}
mkdir -p "$out"
sections=${*:-decode ncu}
source .gpu/b/unpack.sh > /dev/null 2>&1 || { echo "unpack failed" >&2; exit 3; }
pip install --no-deps --no-build-isolation --no-index -q --target /root/site . > /dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$out/gpu.txt" 2>&1
for section in $sections; do
  case $section in
    decode)
      python3 bench/gpu_decode.py --shape llama-3.2-1b --only bf16 q4 --rounds 2 --gen-tokens 256 \
        --prompt-tokens 128 --streams 8 32 --out "$out/decode_llama-3.2-1b.json" \
        > "$out/decode_llama-3.2-1b.log" 2>&1
      tail -3 "$out/decode_llama-3.2-1b.log"
      python3 bench/gpu_decode.py --shape qwen3-30b-a3b-12l --only q4 --rounds 2 --gen-tokens 128 \
        --prompt-tokens 128 --streams 8 32 --out "$out/decode_qwen3-30b-a3b-12l.json" \
        > "$out/decode_qwen3-30b-a3b-12l.log" 2>&1
      tail -3 "$out/decode_qwen3-30b-a3b-12l.log"
      python3 .gpu/b/torch_graph_peer.py > "$out/torch_graph_peer.jsonl" 2>&1
      cat "$out/torch_graph_peer.jsonl"
      ;;
    ncu)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      [ -n "$ncu" ] || { echo "no ncu on this machine" | tee "$out/ncu_missing.txt"; continue; }
      for run in "llama-3.2-1b bf16" "llama-3.2-1b q4" "qwen3-30b-a3b-12l q4"; do
        set -- $run
        name="ncu_$1_$2"
        timeout 200 "$ncu" --target-processes all --clock-control none --metrics gpu__time_duration.sum \
          --csv --log-file "$out/$name.csv" \
          python3 bench/batched_step.py --shape "$1" --weights "$2" --rows 1 8 32 --ncu-steps 3 \
          --out "$out/$name.json" > "$out/$name.log" 2>&1
        python3 bench/batched_step.py --summarize-ncu "$out/$name.csv" --out "$out/$name.json" \
          > "$out/${name}_summary.json" 2>> "$out/$name.log"
        python3 - "$out/${name}_summary.json" <<'PY'
import json, sys
for label, row in json.load(open(sys.argv[1])).items():
    gbps = row.get("achieved_GBps")
    print(f"{label}: {row['device_us_per_step']:.0f} us/step, {row['kernels_per_step']:.0f} kernels, "
          f"{gbps:.0f} GB/s" if gbps else f"{label}: {row['device_us_per_step']:.0f} us/step")
PY
        gzip -f "$out/$name.csv"
      done
      ;;
  esac
done
