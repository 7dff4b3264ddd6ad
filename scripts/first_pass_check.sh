#!/usr/bin/env bash
# One device call for what a first pass costs: the Qwen2.5-VL-3B-shaped tower's capture() of its
# default ladder (benchmarks/packed_capture_time_probe.py: the defaults and warmup_iters=2 in one
# process, after a first capture that pays the one-time compiles), then CLIP ViT-L/14-336's first
# pass with warm Inductor, Triton and bytecode caches (benchmarks/first_pass_cache_probe.py, one
# process per run, a compile job id set as the README advises), warmup_iters 1 and 2 in turn;
# each also for a baseline source tree when one is given. Short table last.
# Usage (CUDA machine, repo root): bash scripts/first_pass_check.sh [BASELINE_TREE]
#   BASELINE_TREE: a checkout of the code to compare against (its src/ goes on PYTHONPATH), e.g.
#   made with: mkdir -p baseline && git archive <commit> src | tar -x -C baseline (an ignored
#   folder: name it in the device call's carry). The optional wheels' PYTHONPATH is kept.
set -uo pipefail
source scripts/device_setup.sh
source scripts/clip_first_pass.sh
base=${1:-}
python3 -c "import torch; print('torch', torch.__version__, 'device', torch.cuda.get_device_name(0))"
quiet() { grep -vE "Warning|warn|^\[rank"; }
trees=("this:$PWD")
[ -n "$base" ] && trees=("baseline:$base" "this:$PWD")
for entry in "${trees[@]}"; do
  label=${entry%%:*}; tree=${entry#*:}
  order=default,default,warmup2,default,warmup2
  [ "$label" = baseline ] && order=default,default,default
  echo "== Qwen2.5-VL-3B capture, $label tree ($order)"
  PYTHONPATH="$tree/src${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/packed_capture_time_probe.py \
    --order "$order" --profile 0 2>&1 | quiet | cut -c1-200 | tee "$OUT/capture_$label.log"
done
cache=$(mktemp -d)
echo "== CLIP ViT-L/14-336 first pass, cold caches ($cache), this tree"
clip_first_pass cold "$PWD" "$cache" | tee "$OUT/clip_first_pass.log"
for round in 1 2 3; do
  echo "== CLIP ViT-L/14-336 first pass, warm caches, round $round"
  [ -n "$base" ] && clip_first_pass "baseline warm" "$base" "$cache" \
    | tee -a "$OUT/clip_first_pass.log"
  clip_first_pass "this warm" "$PWD" "$cache" | tee -a "$OUT/clip_first_pass.log"
  clip_first_pass "this warm" "$PWD" "$cache" --warmup-iters 2 | tee -a "$OUT/clip_first_pass.log"
done
echo "== summary"
for f in "$OUT"/capture_*.log; do echo "$(basename "$f" .log):"; grep -E "^ *[0-9]+  " "$f" | cut -c1-40; done
grep "first pass" "$OUT/clip_first_pass.log" | sed -E 's/, of which.*//'
