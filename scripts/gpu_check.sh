#!/usr/bin/env bash
# The one device script: install this tree, run the GPU tests, the stress suite and the benchmarks,
# and print a short table last. Run from the repository root on a CUDA machine:
#
#   bash scripts/gpu_check.sh
#
# Environment (all optional):
#   VITGRAPH_TESTS    GPU test files or folders      (default tests/gpu; "none" skips them)
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
if [ "$tests" != "none" ]; then
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
[ -f "$OUT/gpu_tests.log" ] && tail -1 "$OUT/gpu_tests.log"
[ -f "$OUT/stress.log" ] && sed -n '/^part /,$p' "$OUT/stress.log" | cut -c1-160
exit 0
