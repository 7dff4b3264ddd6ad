#!/usr/bin/env bash
# One device call for the full-attention kernel chosen per budget at capture (packed towers):
# the packed GPU tests, the single-image streams of the Qwen3-VL-8B and Qwen2.5-VL-3B shaped
# towers with attention="auto" beside "varlen" and HF eager, the large-image fraction of peak,
# and the stress suite's packed parts. Short table last.
# Usage (CUDA machine, repo root): bash scripts/attention_choice_check.sh [parts...]
#   parts: tests stream peak stress (default: all)
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
for part in ${*:-tests stream peak stress}; do
  case $part in
  tests)
    echo "== packed GPU tests"
    python3 -m pytest tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py -m gpu -q -s -p no:cacheprovider 2>&1 \
      | tee "$OUT/packed_tests.log" | grep -E "attention=|returned while|queued behind|passed|failed|Error" | cut -c1-400 | tail -20 ;;
  stream)
    echo "== single-image streams"
    python3 benchmarks/attention_choice_stream.py --calls 40 2>&1 | grep -vE "WARNING|Warning" | tee "$OUT/stream.log" ;;
  peak)
    echo "== large images"
    python3 benchmarks/qwen_large_image_peak.py 2>&1 | grep -vE "WARNING|Warning" | tee "$OUT/peak.log" ;;
  stress)
    echo "== stress (300 calls per part)"
    python3 -m vit_graph_backend.bench.stress --calls 300 --json "$OUT/stress.json" 2>&1 \
      | grep -v WARNING | tee "$OUT/stress.log" | tail -8 ;;
  esac
done
echo "== summary"
tail -1 "$OUT/packed_tests.log" 2>/dev/null
grep -E "^(qwen|eager|vitgraph)" "$OUT/stream.log" 2>/dev/null
sed -n 2,6p "$OUT/peak.log" 2>/dev/null
grep -E "^(part|batched|packed|clear|memory) " "$OUT/stress.log" 2>/dev/null | cut -c1-60
