#!/usr/bin/env bash
# One device call for attention_kernel="timed" (each attention of a torch.compile graph timed per
# shape, SDPA against the Triton segment kernel: attention_op.py): its GPU tests with the HF and fused
# linear GPU tests, the kernel probe at the batched ViTs' shapes, CLIP ViT-L/14-336 at fixed
# batches with the choice on and off (the default, SDPA) beside eager, the
# kernel time by kind at batch 48, the ViT-B/16 default stream (launch-bound) and the stress
# suite. Short table last.
# Usage (CUDA machine, repo root): bash scripts/attention_op_check.sh [parts...]
#   parts: tests probe fixed profile vitb stress   (default: all)
#   BATCHES="48 24 8" for fixed; STRESS_CALLS=300 for stress
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
source scripts/optional_wheels.sh
for part in ${*:-tests probe fixed profile vitb stress}; do
  case $part in
  tests)
    echo "== attention op GPU tests (with the HF and fused linear GPU tests)"
    python3 -m pytest tests/gpu/test_attention_op_gpu.py tests/unit/test_attention_op.py \
      tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py tests/gpu/test_hf_gpu.py -q -p no:cacheprovider 2>&1 \
      | tee "$OUT/tests.log" | grep -vE "Warning|warn" | tail -25 ;;
  probe)
    echo "== attention kernels at the batched ViTs' shapes"
    (cd benchmarks && python3 segment_attention_kernel_probe.py --cases vit --config 64,64,4,3 \
      --config 128,64,4,3 2>&1 | tee "$OUT/probe.log" | tail -30) ;;
  fixed)
    for b in ${BATCHES:-48 24 8}; do
      modes=eager,vitgraph,vitgraph-timed-attention
      [ "$b" = 48 ] && modes=eager,reduce-overhead,vitgraph,vitgraph-timed-attention
      echo "== CLIP ViT-L/14-336, fixed batch $b"
      bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes "$modes" --json "$OUT/json/fixed_$b.json" | tee -a "$OUT/fixed.log"
    done ;;
  profile)
    echo "== kernel time by kind, batch 48"
    python3 benchmarks/clip_kernel_profile.py --batch 48 --modes bf16,bf16-timed-attention \
      --json "$OUT/json/profile_48.json" 2>&1 | grep -vE "Warning|warn" | tee "$OUT/profile.log" ;;
  vitb)
    echo "== ViT-B/16 default stream"
    bench --modes eager,vitgraph,vitgraph-timed-attention --json "$OUT/json/vit_b16.json" | tee -a "$OUT/vitb.log" ;;
  stress)
    echo "== stress (${STRESS_CALLS:-300} calls a part)"
    python3 -m vit_graph_backend.bench.stress --calls "${STRESS_CALLS:-300}" \
      --json "$OUT/stress.json" 2>&1 | tee "$OUT/stress.log" | grep -v WARNING | tail -12 ;;
  esac
done
tar -C "$OUT" -czf "$OUT/json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
grep -hE "^(mode|eager|reduce|vitgraph)" "$OUT/fixed.log" "$OUT/vitb.log" 2>/dev/null | grep -E "ok|mode" | cut -c1-110
grep -hE "of peak" "$OUT/fixed.log" 2>/dev/null
grep -hE "ms of kernels|attention" "$OUT/profile.log" 2>/dev/null | head -6
tail -4 "$OUT/stress.log" 2>/dev/null
