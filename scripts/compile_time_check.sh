#!/usr/bin/env bash
# One device call for what a Triton kernel's compiles cost a cold first pass: its compile probe
# (each variant in a fresh Triton cache, then the kernel times), CLIP ViT-L/14-336's first pass
# (benchmarks/first_pass_cache_probe.py) with fresh caches and then warm ones, for a baseline
# source tree and this one in turn, and the GPU tests of the kernel and its timing. Short table
# last.
# Usage (CUDA machine, repo root): bash scripts/compile_time_check.sh [BASELINE_TREE] [ROUNDS]
#   KERNEL=linear_act (the default: the fused linear kernel, benchmarks/linear_act_compile_probe.py,
#   the default options' first pass) or KERNEL=segment_attention (the Triton segment kernel,
#   benchmarks/segment_attention_compile_probe.py, the first pass with attention_kernel="timed")
#   PARTS="probe firstpass tests" (the default) or a subset of them
#   BASELINE_TREE: a checkout of the code to compare against (its src/ goes on PYTHONPATH), e.g.
#   made with: mkdir -p baseline && git archive <commit> src | tar -x -C baseline (an ignored
#   folder: name it in the device call's carry).
set -uo pipefail
source scripts/device_setup.sh
source scripts/clip_first_pass.sh
base=${1:-}; rounds=${2:-1}
quiet() { grep -vE "Warning|warn|^\[rank"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'device', torch.cuda.get_device_name(0))"
parts=" ${PARTS:-probe firstpass tests} "
case ${KERNEL:-linear_act} in
  linear_act) variants="specialized shipped shipped-threads"; first_pass=()
    tests="tests/gpu/test_fused_linear_gpu.py tests/gpu/test_fused_linear_choices_gpu.py tests/gpu/test_gpu_timing_gpu.py" ;;
  segment_attention) variants="before shipped shipped-threads"
    first_pass=(--attention-kernel timed)
    tests="tests/gpu/test_segment_attention_gpu.py tests/gpu/test_attention_op_gpu.py" ;;
  *) echo "KERNEL=$KERNEL: linear_act or segment_attention" >&2; exit 2 ;;
esac
probe=benchmarks/${KERNEL:-linear_act}_compile_probe.py
[[ $parts == *" probe "* ]] && for variant in $variants; do
  TRITON_CACHE_DIR=$(mktemp -d) python3 "$probe" "$variant" 2>&1 | quiet \
    | tee -a "$OUT/compile_probe.log"
done
[[ $parts == *" probe "* ]] && python3 "$probe" perf 2>&1 | quiet | tee -a "$OUT/compile_probe.log"
trees=("this:$PWD"); [ -n "$base" ] && trees=("baseline:$base" "this:$PWD")
[[ $parts == *" firstpass "* ]] && for round in $(seq "$rounds"); do
  declare -A caches=()
  for entry in "${trees[@]}"; do
    label=${entry%%:*}; caches[$label]=$(mktemp -d)
    echo "== CLIP ViT-L/14-336 first pass, round $round, $label, cold caches"
    clip_first_pass "$label cold" "${entry#*:}" "${caches[$label]}" "${first_pass[@]}" \
      | tee -a "$OUT/clip_first_pass.log"
  done
  for entry in "${trees[@]}"; do
    label=${entry%%:*}
    echo "== CLIP ViT-L/14-336 first pass, round $round, $label, warm caches"
    clip_first_pass "$label warm" "${entry#*:}" "${caches[$label]}" "${first_pass[@]}" \
      | tee -a "$OUT/clip_first_pass.log"
  done
done
[[ $parts == *" tests "* ]] && python3 -m pytest $tests -m gpu -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -5
echo "== summary"
[ -f "$OUT/compile_probe.log" ] && grep -E "compiles|side by side|images \(|equal" \
  "$OUT/compile_probe.log" | grep -vE "first launch|launch's return"
[ -f "$OUT/clip_first_pass.log" ] && grep -E "first pass|captured|call_user" "$OUT/clip_first_pass.log" \
  | sed -E 's/, of which timing fused shapes ([0-9.]+ s)[^,]*, attention shapes ([0-9.]+ s).*/ (fused shapes \1, attention shapes \2)/; s/ \(warm-up runs.*//'
[ -f "$OUT/gpu_tests.log" ] && tail -1 "$OUT/gpu_tests.log"
