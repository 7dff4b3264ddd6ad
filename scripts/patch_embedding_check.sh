#!/usr/bin/env bash
# One device call for patch_embedding="gemm" (a ViT's patch convolution as one GEMM over its
# patches, patch_rewrite.py): its GPU and CPU tests, the probe (cuDNN's convolution against the
# GEMM per model shape and batch, and each one's first call at a new batch size), CLIP
# ViT-L/14-336 at fixed batches with the option off (default) and on beside eager, the ViT-B/16
# default stream (launch-bound), and CLIP's warm first pass by phase with the option off and on
# in turn (cold once first, all in one cache folder). Short table last.
# Usage (CUDA machine, repo root): bash scripts/patch_embedding_check.sh [parts...]
#   parts: tests probe fixed vitb firstpass (default: all)
#   BATCHES="48 24 8"   fixed batches; MODES adds modes to the fixed part (e.g. ,reduce-overhead)
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
source scripts/optional_wheels.sh
for part in ${*:-tests probe fixed vitb firstpass}; do
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
        --modes "eager,vitgraph,vitgraph-patch-gemm${MODES:-}" --json "$OUT/json/fixed_$b.json" | tee -a "$OUT/fixed.log"
    done ;;
  vitb)
    echo "== ViT-B/16 default stream"
    bench --modes eager,vitgraph,vitgraph-patch-gemm --json "$OUT/json/vit_b16.json" | tee -a "$OUT/vitb.log" ;;
  firstpass)
    cache=$(mktemp -d)
    for run in cold:conv warm:conv warm:gemm warm:conv warm:gemm; do
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
grep -hE "^(eager|reduce-overhead|vitgraph|vitgraph-patch-gemm) +ok|^== |of peak" \
  "$OUT"/fixed.log "$OUT"/vitb.log 2>/dev/null | cut -c1-150
grep -hE "^== first|^first pass|warm-up runs" "$OUT/firstpass.log" 2>/dev/null
