#!/usr/bin/env bash
# One device call for issue 13's packed-tower targets, each mode side by side in one process:
# the Qwen2.5-VL-3B-shaped tower on one image of 1,024 / 4,096 / 16,384 patches (fraction of the
# measured matmul peak), a Qwen3-VL-8B-shaped tower on a single-image stream up to 1312 px (p99
# against eager), and the Qwen2.5-VL single-image and multi-image streams (p50). Short table last.
# Usage (CUDA machine, repo root): bash scripts/qwen_targets_check.sh [parts...]
#   parts: peak qwen3 stream (default: all); qwen3-ladders: the Qwen3-VL-8B stream with the
#   package's default ladder (49 .. 4,096 tokens, each doubling in 2 steps), with 4 steps from
#   1,024 tokens up and with 4 steps throughout, eager beside each (not in the default parts)
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
for part in ${*:-peak qwen3 stream}; do
  case $part in
  peak)
    echo "== Qwen2.5-VL-3B, one large image"
    python3 benchmarks/qwen_large_image_peak.py 2>&1 | grep -v WARNING | tee "$OUT/peak.log" ;;
  qwen3)
    echo "== Qwen3-VL-8B-shaped tower, single-image stream 224..1312 px"
    vitgraph bench --no-progress --model qwen3-vl-8b --workload mixed-sizes --calls 40 \
      --modes eager,vitgraph --json "$OUT/qwen3_vl_8b_single_image_stream.json" 2>&1 \
      | grep -vE "^WARNING|UserWarning|warnings.warn" | tee "$OUT/qwen3.log" ;;
  qwen3-ladders)
    # serve()'s own ladders for this tower (budgets.budget_ladder(49, 4096, k); 49 tokens: a
    # 224 px image), given as budgets: the bench's own ladder would start at the stream's least
    steps2=49,74,98,147,196,294,392,588,784,1176,1568,2352,3136,4096
    two_tier=49,74,98,147,196,294,392,588,784,1176,1372,1568,1960,2352,2744,3136,3920,4096
    steps4=49,62,74,86,98,123,147,172,196,245,294,343,392,490,588,686,784,980,1176,1372,1568
    steps4=$steps4,1960,2352,2744,3136,3920,4096
    for budgets in $steps2 $two_tier $steps4; do
      echo "== Qwen3-VL-8B-shaped tower, single-image stream, budgets $budgets"
      vitgraph bench --no-progress --model qwen3-vl-8b --workload mixed-sizes --calls 40 \
        --modes eager,vitgraph --budgets "$budgets" 2>&1 \
        | grep -vE "^WARNING|UserWarning|warnings.warn" | tee -a "$OUT/qwen3_ladders.log"
    done ;;
  stream)
    echo "== Qwen2.5-VL-3B streams"
    python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph --calls 60 2>&1 \
      | grep -vE "^WARNING|^(single|multi) \{" | tee "$OUT/stream.log" | tail -6 ;;
  esac
done
echo "== summary"
cat "$OUT/peak.log" 2>/dev/null | tail -5
grep -E "^(eager|vitgraph) +ok" "$OUT/qwen3.log" 2>/dev/null | cut -c1-100
grep -E "^== Qwen3|^  budgets|^(eager|vitgraph) +ok" "$OUT/qwen3_ladders.log" 2>/dev/null | cut -c1-130
tail -4 "$OUT/stream.log" 2>/dev/null
