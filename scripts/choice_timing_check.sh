#!/usr/bin/env bash
# One device call for how kernel choices are timed (gpu_timing.graph_ms): its GPU tests and those
# of the choices it drives, the per-shape probe (single launches against graph replays), then
# end to end for a baseline tree and this tree, one process each, alternating: the ViT-B/16
# default stream, CLIP ViT-L/14-336 at fixed batches, the Qwen2.5-VL-3B single-image stream, and
# the CLIP first pass with warm caches. Short table last.
# Usage (CUDA machine, repo root): bash scripts/choice_timing_check.sh [parts...]
#   parts: tests probe e2e firstpass (default: all)
#   E2E="vitb clip qwen25 qwen3": the end-to-end runs (default: all); BATCHES="8 24 48": CLIP's
#   BASELINE=dir: a checkout of the code to compare against (its src/ goes on PYTHONPATH), e.g.
#   made with: mkdir -p baseline && git archive <commit> src | tar -x -C baseline
set -uo pipefail
source scripts/device_setup.sh
mkdir -p "$OUT/json"
source scripts/optional_wheels.sh
site=${PYTHONPATH:-}  # the optional wheels, kept beside each tree's src/
trees="${BASELINE:+$BASELINE} $PWD"
label() { [ "$1" = "$PWD" ] && echo this || echo baseline; }
bench() { python3 -m vit_graph_backend bench --no-progress "$@" 2>&1 | grep -vE "^WARNING|^\[rank|UserWarning|warnings.warn"; }
for part in ${*:-tests probe e2e firstpass}; do
  case $part in
  tests)
    echo "== timer, fused linear, short-segment and packed GPU tests"
    python3 -m pytest tests/gpu/test_gpu_timing_gpu.py tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py \
      tests/gpu/test_short_attention_gpu.py tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py -m gpu -q -s \
      -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" \
      | grep -E "graph_ms|chose|passed|failed|Error" | cut -c1-300 | tail -20 ;;
  probe)
    echo "== fused linear choice: single launches vs graph replays"
    (cd benchmarks && python3 linear_act_choice_timing.py 2>&1 | grep -v WARNING | tee "$OUT/probe.log") ;;
  e2e)
    # ORDER="baseline this baseline this": each tree's runs in this order (the later runs of a
    # tree find warm compile caches, so alternate and compare like with like)
    run_ix=0
    for name in ${ORDER:-${BASELINE:+baseline} this}; do
      tree=$PWD; [ "$name" = baseline ] && tree=$BASELINE
      run_ix=$((run_ix + 1)); tag=${name}_$run_ix
      export PYTHONPATH="$tree/src${site:+:$site}"
      python3 -c "import vit_graph_backend as v; print('== $name tree (run $run_ix):', v.__file__)"
      for item in ${E2E:-vitb clip qwen25 qwen3}; do
        case $item in
        vitb)
          echo "== $name: ViT-B/16 default stream"
          bench --modes eager,vitgraph --json "$OUT/json/vitb_$tag.json" | tee -a "$OUT/e2e_$name.log" | tail -4 ;;
        clip)
          for b in ${BATCHES:-8 24 48}; do
            echo "== $name: CLIP ViT-L/14-336, fixed batch $b"
            bench --model clip-l14-336 --workload fixed-batch --max-batch "$b" --calls 10 \
              --modes eager,vitgraph --json "$OUT/json/clip_${b}_$tag.json" | tee -a "$OUT/e2e_$name.log" | tail -3
          done ;;
        qwen25)
          echo "== $name: Qwen2.5-VL-3B single-image stream"
          python3 benchmarks/qwen_stream.py --modes hf-eager,vitgraph --workloads single --calls 60 2>&1 \
            | grep -vE "^WARNING|^(single|multi) \{" | tee -a "$OUT/e2e_$name.log" | tail -4 ;;
        qwen3)
          echo "== $name: Qwen3-VL-8B-shaped tower, single-image stream (mixed sizes)"
          bench --model qwen3-vl-8b --workload mixed-sizes --calls 40 --modes eager,vitgraph \
            --json "$OUT/json/qwen3_$tag.json" | tee -a "$OUT/e2e_$name.log" | tail -4 ;;
        esac
      done
    done
    export PYTHONPATH=$site ;;
  firstpass)
    cache=$(mktemp -d)
    for run in cold $(for t in $trees; do echo "warm:$t"; done); do
      tree=${run#warm:}; [ "$run" = cold ] && tree=$PWD
      echo "== first pass probe, $run ($(label "$tree") tree)"
      ( unset PYTHONDONTWRITEBYTECODE
        export PYTHONPATH="$tree/src${site:+:$site}" PYTHONPYCACHEPREFIX=$cache/pyc TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
        python3 benchmarks/first_pass_cache_probe.py auto 2>&1 | grep -vE "Warning|warn" | head -4 ) | tee -a "$OUT/firstpass.log"
    done ;;
  esac
done
tar -C "$OUT" -czf "$OUT/json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
tail -1 "$OUT/tests.log" 2>/dev/null
grep -E "^[a-z]" "$OUT/probe.log" 2>/dev/null | grep -v "^    " | cut -c1-130
for f in "$OUT"/e2e_*.log; do
  [ -f "$f" ] || continue; echo "-- $(basename "$f" .log)"
  grep -hE "^(eager|vitgraph|single) +|^== |of peak" "$f" | cut -c1-140
done
grep -E "^==|first pass" "$OUT/firstpass.log" 2>/dev/null
