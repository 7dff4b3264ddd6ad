#!/usr/bin/env bash
# The one device script: install this tree, run the GPU tests, the stress suite and the benchmarks,
# and print a short table last. Run from the repository root on a CUDA machine:
#
#   bash scripts/gpu_check.sh
#
# Environment (all optional):
#   VITGRAPH_TESTS    GPU test files or folders      (default tests/gpu; "none" skips them;
#                     on a machine of several GPUs, one pytest per GPU, the tests dealt in
#                     turn)
#   VITGRAPH_STRESS   checked calls per stress part  (default 2500, 4 threads; 0 skips it)
#   VITGRAPH_BENCHES  benchmark commands, separated by ";", each run as `python3 benchmarks/...`
#                     (default: none; e.g. "batch_invariance.py;ab_trees.py --baseline .baseline")
#
# Optional kernel libraries travel as wheels in .whl/ (ignored by git; e.g. nvidia-cudnn-frontend
# for the packed towers' cuDNN attention) and are installed into /tmp/site first. Logs and JSON
# land in $OUT (the device tool's folder, else /tmp/vitgraph_out).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vitgraph_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    && export PATH=/tmp/site/bin:$PATH
fi
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers
print("torch", torch.__version__, "| cuda", torch.version.cuda, "|",
      torch.cuda.get_device_name(0), "x", torch.cuda.device_count(),
      "| transformers", transformers.__version__,
      "| vitgraph registered:", "vitgraph" in torch.compiler.list_backends(exclude_tags=()))
PY
tests=${VITGRAPH_TESTS:-tests/gpu}
rm -f "$OUT"/gpu_tests*.log
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$tests" != "none" ] && [ "$gpus" -gt 1 ]; then
  # One pytest per GPU, the collected tests dealt in turn (a heavy file's cases spread over
  # every lane); each lane sees every GPU with its own first, so tests needing two still run.
  echo "== GPU tests: $tests in $gpus lanes"
  # shellcheck disable=SC2086
  python3 -m pytest $tests -m gpu --collect-only -q -p no:cacheprovider >/tmp/vitgraph_collect.txt 2>&1 \
    || { echo "collection failed:"; tail -20 /tmp/vitgraph_collect.txt; }
  mapfile -t cases < <(grep "::" /tmp/vitgraph_collect.txt)
  IFS=',' read -ra visible <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"
  for ((lane = 0; lane < gpus; lane++)); do
    mine=(); for ((i = lane; i < ${#cases[@]}; i += gpus)); do mine+=("${cases[i]}"); done
    [ ${#mine[@]} -gt 0 ] || continue   # none dealt: pytest alone would run every test
    order=${visible[lane]}
    for ((g = 0; g < gpus; g++)); do [ "$g" -eq "$lane" ] || order+=",${visible[g]}"; done
    CUDA_VISIBLE_DEVICES=$order python3 -m pytest "${mine[@]}" -m gpu -q -p no:cacheprovider \
      --hypothesis-profile=gpu >"$OUT/gpu_tests_$lane.log" 2>&1 &
  done
  wait
  for log in "$OUT"/gpu_tests_*.log; do
    echo "-- $log"; grep -E "passed|failed|error|Error" "$log" | tail -8
  done
elif [ "$tests" != "none" ]; then
  echo "== GPU tests: $tests"
  python3 -m pytest $tests -m gpu -q -p no:cacheprovider --hypothesis-profile=gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|Error" | tail -15
fi
calls=${VITGRAPH_STRESS:-2500}
if [ "$calls" != "0" ]; then
  echo "== stress: $calls checked calls per part, 4 threads"
  PYTHONPATH=tests${PYTHONPATH:+:$PYTHONPATH} python3 -m stress --calls "$calls" --threads 4 \
    --json "$OUT/stress.json" >"$OUT/stress.log" 2>&1
  grep -vE "^WARNING|warnings.warn|UserWarning" "$OUT/stress.log" | tail -12
fi
IFS=';' read -ra benches <<< "${VITGRAPH_BENCHES:-}"
for bench in "${benches[@]}"; do
  [ -n "${bench// }" ] || continue
  echo "== benchmarks/$bench"
  # shellcheck disable=SC2086
  python3 benchmarks/$bench 2>&1 | tee -a "$OUT/benches.log" \
    | grep -vE "^WARNING|warnings.warn|UserWarning|^W[0-9]" | tail -40
done
echo "== summary"
cat "$OUT/versions.txt"
for log in "$OUT"/gpu_tests*.log; do [ -f "$log" ] && tail -1 "$log"; done
[ -f "$OUT/stress.log" ] && sed -n '/^part /,$p' "$OUT/stress.log" | cut -c1-160
exit 0
