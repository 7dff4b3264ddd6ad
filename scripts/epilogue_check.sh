#!/usr/bin/env bash
# One device call for epilogue_fusion (linear + GELU as one op, fused_linear.py): its GPU tests,
# the kernel probe, CLIP ViT-L/14-336 at fixed batches 8/24/48 with the fusion on (default) and
# off beside eager and Inductor static in one CUDA graph, the kernel time by kind at batch 48,
# and the ViT-B/16 default stream (launch-bound); for the gated form (Qwen2.5-VL's SiLU-gated MLP):
# the gated probe, the 3B-shaped tower's fraction of peak on one large image and its kernel time by
# kind with the fusion on and off, and its single-image stream. Short table last.
# Usage (CUDA machine, repo root): bash scripts/epilogue_check.sh [parts...]
#   parts: tests probe fixed profile vitb gated qwen-peak qwen-profile qwen-stream
#   (default: all but the gated ones, which the qwen parts cover)
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
source scripts/optional_wheels.sh
for part in ${*:-tests probe fixed profile vitb}; do
  case $part in
  tests)
    echo "== fused linear GPU tests"
    python3 -m pytest tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py tests/unit/test_fused_linear.py \
      tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py tests/unit/test_adapters_qwen.py tests/unit/test_adapters_qwen_serving.py -q -p no:cacheprovider 2>&1 \
      | tee "$OUT/tests.log" | grep -vE "Warning|warn" | tail -25 ;;
  probe)
    echo "== linear + activation probe"
    (cd benchmarks && python3 linear_act_probe.py 2>&1 | grep -E "^(#|##|best)" | tee "$OUT/probe.log") ;;
  fixed)
    for b in ${BATCHES:-48 24 8}; do
      echo "== CLIP ViT-L/14-336, fixed batch $b"
      bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes eager,reduce-overhead,vitgraph,vitgraph-epilogue-off --json "$OUT/json/fixed_$b.json" | tee -a "$OUT/fixed.log"
    done ;;
  profile)
    echo "== kernel time by kind, batch 48"
    python3 benchmarks/clip_kernel_profile.py --batch 48 --modes bf16-epilogue-off,bf16 \
      --json "$OUT/json/profile_48.json" 2>&1 | grep -vE "Warning|warn" | tee "$OUT/profile.log" ;;
  vitb)
    echo "== ViT-B/16 default stream"
    bench --modes eager,vitgraph,vitgraph-epilogue-off --json "$OUT/json/vit_b16.json" | tee -a "$OUT/vitb.log" ;;
  gated)
    echo "== gated linear probe (Qwen2.5-VL MLP)"
    (cd benchmarks && python3 linear_act_probe.py gated 2>&1 | grep -E "^(#|##|best)" | tee "$OUT/gated.log") ;;
  qwen-peak)
    echo "== Qwen2.5-VL-3B, one large image, epilogue fusion on vs off"
    python3 benchmarks/qwen_large_image_peak.py --modes vitgraph,epilogue-off 2>&1 | grep -v WARNING | tee "$OUT/qwen_peak.log" ;;
  qwen-profile)
    echo "== Qwen2.5-VL-3B, 16384 patches, kernel time by kind"
    python3 benchmarks/packed_kernel_profile.py --parts qwen25,qwen25-epilogue-off 2>&1 | grep -v WARNING | tee "$OUT/qwen_profile.log" ;;
  qwen-stream)
    echo "== Qwen2.5-VL-3B single-image stream"
    python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph,vitgraph-epilogue-off --workloads single --calls 60 2>&1 \
      | grep -vE "^WARNING|^(single|multi) \{" | tee "$OUT/qwen_stream.log" | tail -6 ;;
  esac
done
tar -C "$OUT" -czf "$OUT/json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
grep -h "^best" "$OUT/probe.log" "$OUT/gated.log" 2>/dev/null
tail -4 "$OUT/qwen_peak.log" 2>/dev/null | head -3
grep -hE "ms of kernels|^    (gemm|attention|triton)" "$OUT/qwen_profile.log" 2>/dev/null
tail -4 "$OUT/qwen_stream.log" 2>/dev/null
grep -hE "^(eager|reduce-overhead|vitgraph|vitgraph-epilogue-off) +ok|^== |of peak|ms of kernels" "$OUT"/fixed.log "$OUT"/profile.log "$OUT"/vitb.log 2>/dev/null | cut -c1-150
