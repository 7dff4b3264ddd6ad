#!/usr/bin/env bash
# One device call for graph_launch: the device-launch executables (default) against
# CUDAGraph.replay() (graph_launch="torch") end to end, side by side in one process each: the
# Qwen2.5-VL-3B single-image and multi-image streams and the ViT-B/16 stream of `vitgraph bench`
# (launch-bound), then the launch probe's synthetic part. Short table last.
# Usage (CUDA machine, repo root): bash scripts/graph_launch_check.sh [qwen] [vit] [clip]
#   [firstpass] [probe]
#   BENCH_MODES=eager,vitgraph-torch-launch,vitgraph  the bench parts' modes, in this order
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
parts=${*:-qwen vit probe}
for part in $parts; do
  case $part in
    qwen) echo "== Qwen2.5-VL-3B streams"
      python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph,vitgraph-torch-launch 2>&1 \
        | grep -v WARNING | tee "$OUT/qwen_stream.log" | tail -12 ;;
    vit) echo "== ViT-B/16 stream (vitgraph bench)"
      vitgraph bench --modes ${BENCH_MODES:-eager,vitgraph,vitgraph-torch-launch} --no-progress \
        --json "$OUT/vit_b16_graph_launch.json" 2>&1 | grep -v WARNING | tee "$OUT/vit_bench.log" | tail -12 ;;
    clip) echo "== CLIP ViT-L/14-336 gpu-bound (vitgraph bench)"
      TORCH_COMPILE_JOB_ID=vitgraph-clip vitgraph bench --model clip-l14-336 --workload gpu-bound \
        --modes ${BENCH_MODES:-eager,vitgraph,vitgraph-torch-launch} --no-progress \
        --json "$OUT/clip_gpu_bound_graph_launch.json" 2>&1 | grep -v WARNING \
        | tee "$OUT/clip_bench.log" | tail -12 ;;
    firstpass) cache=$(mktemp -d)
      # CLIP ViT-L/14-336's first pass with a compile job id: cold, then warm with each launch
      # kind (device launch twice, around the torch one: the order's own effect shows)
      for run in cold:vitgraph warm:vitgraph warm:vitgraph-torch-launch warm:vitgraph; do
        echo "== first pass, ${run%%:*} caches, mode ${run##*:}"
        ( unset PYTHONDONTWRITEBYTECODE
          PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
            TRITON_CACHE_DIR=$cache/triton TORCH_COMPILE_JOB_ID=vitgraph-clip-first-pass \
            vitgraph bench --model clip-l14-336 --workload gpu-bound --max-batch 48 --calls 12 \
            --modes "${run##*:}" --no-progress 2>&1 ) | grep -E "^mode|^vitgraph|captured in" \
          | tee -a "$OUT/firstpass.log"
      done ;;
    probe) echo "== launch probe, synthetic"
      python3 benchmarks/graph_launch_probe.py --parts synthetic 2>&1 | grep -v Warn \
        | grep -v "    cluster:" | tee "$OUT/probe.log" | tail -14 ;;
  esac
done
echo "== summary"
for f in qwen_stream vit_bench clip_bench; do [ -f "$OUT/$f.log" ] && grep -E "vitgraph|eager|mode" "$OUT/$f.log" | tail -8; done
