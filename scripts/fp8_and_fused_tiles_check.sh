#!/usr/bin/env bash
# One device call for quantization="fp8" and the fused linear + GELU kernel's tiles: the FP8 and
# fused-linear GPU tests (FP8's compile-cache test among them), benchmarks/linear_act_probe.py
# occupancy (the default tile beside tiles two of which fit one SM), then CLIP ViT-L/14-336's
# first pass with quantization="fp8", cold once and then warm twice in one cache folder
# (benchmarks/first_pass_phase_probe.py, which prints what the compile caches did); coldprofile:
# that cold first pass again in a fresh cache folder under cProfile (the backend's and the inner
# compile's top functions); fixed: CLIP at fixed batches 48, 24, 8, the default beside FP8,
# Inductor static in one CUDA graph (reduce-overhead) and eager, one process per batch, all
# with one Inductor cache folder. Table last.
# Usage (CUDA machine, repo root): bash scripts/fp8_and_fused_tiles_check.sh [parts...]
#   parts: tests probe firstpass coldprofile fixed (default: tests probe firstpass)
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
quiet() { grep -vE "Warning|warn|^\[rank"; }
for part in ${*:-tests probe firstpass}; do
  case $part in
  tests)
    echo "== FP8 and fused-linear GPU tests"
    python3 -m pytest tests/gpu/test_fp8_gpu.py tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py -m gpu -q -s \
      -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" \
      | grep -E "fp8|passed|failed|Error" | cut -c1-300 | tail -20 ;;
  probe)
    echo "== fused linear + activation: tiles two to an SM"
    (cd benchmarks && python3 linear_act_probe.py occupancy 2>&1 | quiet >"$OUT/probe.log") ;;
  firstpass)
    cache=$(mktemp -d)
    for run in cold warm warm; do
      echo "== first pass $run, quantization=fp8"
      ( unset PYTHONDONTWRITEBYTECODE
        export PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
          TRITON_CACHE_DIR=$cache/triton TORCH_COMPILE_JOB_ID=fp8_first_pass
        cd benchmarks && python3 first_pass_phase_probe.py --quantization fp8 2>&1 \
          | grep -E "^first pass|^compile caches|^phase|warm-up by" | cut -c1-250 ) \
        | tee -a "$OUT/firstpass.log"
    done ;;
  coldprofile)
    cache=$(mktemp -d)
    echo "== first pass cold, quantization=fp8, cProfile of the compiles"
    ( export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
      cd benchmarks && python3 first_pass_phase_probe.py --quantization fp8 --profile 45 2>&1 \
        | quiet | cut -c1-200 ) >"$OUT/coldprofile.log"
    grep -E "^first pass|^compile caches|^phase|^dynamo" "$OUT/coldprofile.log" ;;
  fixed)
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    mkdir -p "$OUT/json"
    for b in ${BATCHES:-48 24 8}; do
      echo "== CLIP ViT-L/14-336, fixed batch $b"
      bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
        --modes eager,vitgraph,vitgraph-fp8,reduce-overhead --json "$OUT/json/fixed_$b.json" \
        | tee -a "$OUT/fixed.log" | grep -E "^(eager|reduce-overhead|vitgraph)|of peak"
    done
    tar -C "$OUT" -czf "$OUT/fixed_json.tgz" json && rm -rf "$OUT/json" ;;
  esac
done
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
grep -hE "^## |^cublas |^fused [0-9x]+ |^gated [0-9x]+ |^best" "$OUT/linear_act_probe.txt" 2>/dev/null \
  | grep -v " no act" | cut -c1-110
grep -hE "^== first|^first pass|^compile caches" "$OUT/firstpass.log" 2>/dev/null
grep -hE "^vitgraph bench|^(eager|reduce-overhead|vitgraph|vitgraph-fp8) +ok|of peak" \
  "$OUT/fixed.log" 2>/dev/null | cut -c1-150
