#!/usr/bin/env bash
# One device call for issue 13's packed-tower targets, each mode side by side in one process:
# the Qwen2.5-VL-3B-shaped tower on one image of 1,024 / 4,096 / 16,384 patches (fraction of the
# measured matmul peak), a Qwen3-VL-8B-shaped tower on a single-image stream up to 1312 px (p99
# against eager), and the Qwen2.5-VL single-image and multi-image streams (p50). Short table last.
# Usage (CUDA machine, repo root): bash scripts/qwen_targets_check.sh [parts...]
#   parts: peak qwen3 stream (default: all)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vitgraph_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
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
  stream)
    echo "== Qwen2.5-VL-3B streams"
    python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph --calls 60 2>&1 \
      | grep -vE "^WARNING|^(single|multi) \{" | tee "$OUT/stream.log" | tail -6 ;;
  esac
done
echo "== summary"
cat "$OUT/peak.log" 2>/dev/null | tail -5
grep -E "^(eager|vitgraph) +ok" "$OUT/qwen3.log" 2>/dev/null | cut -c1-100
tail -4 "$OUT/stream.log" 2>/dev/null
