#!/usr/bin/env bash
# One device call for patch_embedding (patch_rewrite.py: a ViT's patch convolution as one GEMM
# over its patches, the default, against "conv", cuDNN's convolution): its GPU and CPU tests, the
# probe (the convolution against the GEMM per model shape and batch, and each one's first call
# at a new batch size), CLIP ViT-L/14-336 at fixed batches with each beside eager, CLIP's
# kernel time by kind at 48 images with each, the ViT-B/16 default stream (launch-bound), and
# CLIP's first pass by phase with each in turn (each cold once first, all in one cache folder).
# Short table last.
# Usage (CUDA machine, repo root): bash scripts/patch_embedding_check.sh [parts...]
#   parts: tests probe fixed profile vitb firstpass (default: all)
#   BATCHES="48 24 8"   fixed batches; MODES adds modes to the fixed part (e.g. ,reduce-overhead)
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
source scripts/optional_wheels.sh
for part in ${*:-tests probe fixed profile vitb firstpass}; do
  case $part in
  tests)
    echo "== patch embedding tests"
    python3 -m pytest tests/gpu/test_patch_rewrite_gpu.py tests/unit/test_patch_rewrite.py -q \
      -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | grep -vE "Warning|warn" | tail -15 ;;
  probe)
    echo "== patch embedding probe"
    (cd benchmarks && python3 patch_embedding_probe.py 2>&1 | grep -vE "Warning|warn" | tee "$OUT/probe.log") ;;
  fixed)
    for b in ${BATCHES:-48 24 8}; do
      echo "== CLIP ViT-L/14-336, fixed batch $b"
      bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes "eager,vitgraph,vitgraph-patch-conv${MODES:-}" --json "$OUT/json/fixed_$b.json" | tee -a "$OUT/fixed.log"
    done ;;
  profile)
    echo "== CLIP ViT-L/14-336 kernel time by kind, 48 images"
    (cd benchmarks && python3 clip_kernel_profile.py --batch 48 --modes bf16-patch-conv,bf16 \
      --top 14 --json "$OUT/json/clip_kernel_profile.json" 2>&1 | grep -vE "Warning|warn" \
      | tee "$OUT/profile.log") ;;
  vitb)
    echo "== ViT-B/16 default stream"
    bench --modes eager,vitgraph,vitgraph-patch-conv --json "$OUT/json/vit_b16.json" | tee -a "$OUT/vitb.log" ;;
  firstpass)
    cache=$(mktemp -d)
    for run in cold:gemm cold:conv warm:gemm warm:conv warm:gemm warm:conv; do
      echo "== first pass ${run%%:*}, patch_embedding=${run##*:}"
      ( unset PYTHONDONTWRITEBYTECODE
        export PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
          TRITON_CACHE_DIR=$cache/triton TORCH_COMPILE_JOB_ID=patch_embedding_first_pass
        cd benchmarks && python3 first_pass_phase_probe.py --patch-embedding "${run##*:}" 2>&1 \
          | grep -E "^first pass|warm-up|^phase" ) | tee -a "$OUT/firstpass.log"
    done ;;
  esac
done
tar -C "$OUT" -czf "$OUT/json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
grep -hE "^(conv|gemm) |^clip|^vit-b|^siglip" "$OUT/probe.log" 2>/dev/null | cut -c1-150
grep -hE "^(eager|reduce-overhead|vitgraph|vitgraph-patch-conv) +ok|^== |of peak" \
  "$OUT"/fixed.log "$OUT"/vitb.log 2>/dev/null | cut -c1-150
grep -hE "^== |ms of kernels|^   [a-z]" "$OUT/profile.log" 2>/dev/null
grep -hE "^== first|^first pass|warm-up runs" "$OUT/firstpass.log" 2>/dev/null
