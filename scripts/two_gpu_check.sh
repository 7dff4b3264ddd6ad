#!/usr/bin/env bash
# One call on a two-GPU machine: the NCCL data-parallel test, then `vitgraph bench --data-parallel`
# under torchrun for a Qwen2.5-VL-3B-shaped tower (calls of 8, 16, 32 mixed-size images and a
# video stream) and CLIP ViT-L/14-336 (calls of 8, 16, 32 images); prints a table last.
# Also the tests of operands and towers on the second GPU while the first is current.
# Usage (repo root, 2 GPUs): bash scripts/two_gpu_check.sh      VITGRAPH_DP_CALLS=8 calls per run;
#   VITGRAPH_SECOND_GPU_ONLY=1: the tests only
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/dp"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest tests/gpu/test_parallel_gpu.py -m gpu -q -s -p no:cacheprovider 2>&1 \
  | tee "$OUT/parallel_gpu_tests.log" | grep -E "data_parallel on CUDA|passed|failed|Error" | tail -8
# operands and towers on the second GPU while the first is current (fused ops, packed serving)
python3 -m pytest tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py -m gpu -q -s \
  -p no:cacheprovider -k "whichever" 2>&1 | tee "$OUT/second_gpu_tests.log" \
  | grep -E "on cuda:1|passed|failed|Error" | tail -8
[ "${VITGRAPH_SECOND_GPU_ONLY:-0}" = 1 ] && exit 0
calls=${VITGRAPH_DP_CALLS:-8}
bench() {  # name, then bench arguments
  local name=$1; shift
  echo "== $name"
  timeout 240 torchrun --nproc-per-node 2 -m vit_graph_backend bench --data-parallel --no-progress \
    --modes eager,vitgraph --calls "$calls" --json "$OUT/dp/$name.json" "$@" \
    >"$OUT/dp/$name.txt" 2>"$OUT/dp/$name.err" || { echo "failed: $name"; tail -5 "$OUT/dp/$name.err"; }
}
for n in 16 32 8; do
  bench "qwen2.5-vl_mixed-batch_$n" --model qwen2.5-vl --workload mixed-batch --max-batch "$n"
  bench "clip-l14-336_fixed-batch_$n" --model clip-l14-336 --workload fixed-batch --max-batch "$n"
done
bench "qwen2.5-vl_video" --model qwen2.5-vl --workload video
python3 benchmarks/data_parallel_summary.py "$OUT"/dp/*.json | tee "$OUT/dp_summary.txt"
# the device tool returns at most 8 files: every run's JSON, text and log in one archive
tar czf "$OUT/dp_runs.tar.gz" -C "$OUT" dp && rm -rf "$OUT/dp"
