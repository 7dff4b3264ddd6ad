#!/usr/bin/env bash
# One device call for the default inner compiler ("auto": Inductor inside the graphs on CUDA):
# CLIP ViT-L/14-336 first pass cold then warm (two processes, one fresh Inductor cache), the
# GPU-bound fixed batches 8/24/48 against Inductor static in one CUDA graph (reduce-overhead),
# the ViT-B/16 default stream (launch-bound), and the packed path's host time. Short table last.
# Usage (CUDA machine, repo root): bash scripts/inductor_default_check.sh [parts...]
#   parts: firstpass fixed vitb host (default: all); autotune: the fixed batches with Inductor's
#   GEMM autotuning on (Triton templates beside cuBLAS, epilogues fused where they win), for
#   every compiled mode alike; firstpass-profile: benchmarks/first_pass_cache_probe.py cold, then
#   warm under cProfile (where a warm first pass goes), then warm again without it
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
parts=${*:-firstpass fixed vitb host}
for part in $parts; do
  case $part in
  firstpass)
    cache=$(mktemp -d)
    # A bytecode cache too, as a pip-installed Python has: the device machine sets
    # PYTHONDONTWRITEBYTECODE=1, and without one every process compiles the Dynamo and Inductor
    # modules it imports at the first compile from source, inside the first pass.
    for run in cold warm; do
      echo "== first pass, $run Inductor, Triton and bytecode caches ($cache)"
      ( unset PYTHONDONTWRITEBYTECODE
        PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
          TRITON_CACHE_DIR=$cache/triton bench \
          --model clip-l14-336 --workload gpu-bound --max-batch 48 --calls 12 \
          --modes vitgraph,vitgraph-eager --json "$OUT/json/first_pass_$run.json" ) | tee -a "$OUT/firstpass.log"
    done ;;
  firstpass-profile)
    cache=$(mktemp -d)
    for run in cold warm-profiled warm; do
      echo "== first pass probe, $run ($cache)"
      ( unset PYTHONDONTWRITEBYTECODE
        export PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
        python3 benchmarks/first_pass_cache_probe.py auto $([ $run = warm-profiled ] && echo --profile 60) 2>&1 \
          | grep -vE "Warning|warn" ) | tee -a "$OUT/firstpass_profile.log"
    done ;;
  fixed)
    for b in 8 24 48; do
      echo "== CLIP ViT-L/14-336, fixed batch $b"
      bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes eager,reduce-overhead,vitgraph,vitgraph-eager --json "$OUT/json/fixed_$b.json" | tee -a "$OUT/fixed.log"
    done ;;
  autotune)
    for b in ${AUTOTUNE_BATCHES:-8 24 48}; do
      echo "== CLIP ViT-L/14-336, fixed batch $b, TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1"
      TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ENABLE_PERSISTENT_TMA_MATMUL=${TMA:-1} \
        bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes eager,reduce-overhead,vitgraph --json "$OUT/json/autotune_$b.json" | tee -a "$OUT/autotune.log"
    done ;;
  vitb)
    echo "== ViT-B/16 default stream"
    bench --modes eager,vitgraph,vitgraph-eager --json "$OUT/json/vit_b16.json" | tee -a "$OUT/vitb.log" ;;
  host)
    echo "== packed host time"
    python3 benchmarks/packed_host_overhead.py 2>&1 | tee "$OUT/host.log" | head -8 ;;
  esac
done
tar -C "$OUT" -czf "$OUT/json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
grep -hE "^(eager|reduce-overhead|vitgraph|vitgraph-eager) +ok|^== |of peak" "$OUT"/*.log 2>/dev/null | cut -c1-150
