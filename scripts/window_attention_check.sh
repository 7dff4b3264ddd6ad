#!/usr/bin/env bash
# One device call for the window layers' short-segment attention kernel
# (adapters/_short_attention.py): its GPU tests with the packed and cuDNN ones, then the
# Qwen2.5-VL-3B-shaped tower with the kernel (defaults) beside the same defaults with the window
# layers on flash varlen, in one process each: one large image (fraction of the measured matmul
# peak), kernel time by kind at 16,384 patches, and the single- and multi-image streams. Short
# table last.
# Usage (CUDA machine, repo root): bash scripts/window_attention_check.sh [parts...]
#   parts: tests probe peak profile stream (default: tests peak profile)
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
for part in ${*:-tests peak profile}; do
  case $part in
  tests)
    echo "== short-segment, packed and cuDNN attention GPU tests"
    python3 -m pytest tests/gpu/test_short_attention_gpu.py tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py \
      tests/gpu/test_cudnn_attention_gpu.py -q -s -p no:cacheprovider 2>&1 \
      | tee "$OUT/tests.log" | grep -E "short-segment|served qwen2.5|window layers|passed|failed|Error" | tail -30 ;;
  probe)
    echo "== attention kernel probe"
    (cd benchmarks && python3 attention_kernel_probe.py 2>&1 | tee "$OUT/probe.log") ;;
  peak)
    echo "== Qwen2.5-VL-3B, one large image: short-segment kernel vs flash varlen in window layers"
    python3 benchmarks/qwen_large_image_peak.py --modes vitgraph,windows-flash 2>&1 \
      | grep -v WARNING | tee "$OUT/peak.log" ;;
  profile)
    echo "== Qwen2.5-VL-3B, 16384 patches, kernel time by kind"
    python3 benchmarks/packed_kernel_profile.py --parts qwen25,qwen25-windows-flash 2>&1 \
      | grep -v WARNING | tee "$OUT/profile.log" ;;
  stream)
    echo "== Qwen2.5-VL-3B streams"
    python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph,vitgraph-windows-flash --calls 60 2>&1 \
      | grep -vE "^WARNING|^(single|multi) \{" | tee "$OUT/stream.log" | tail -8 ;;
  esac
done
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
tail -6 "$OUT/peak.log" 2>/dev/null | head -4
grep -hE "ms of kernels|^    (gemm|attention|triton)" "$OUT/profile.log" 2>/dev/null
tail -7 "$OUT/stream.log" 2>/dev/null
