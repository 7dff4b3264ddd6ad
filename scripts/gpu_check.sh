#!/usr/bin/env bash
# One device call: install, GPU tests, the stress suite, benchmarks; prints a short table last.
# Usage (on a CUDA machine, repo root): bash scripts/gpu_check.sh
#   VITGRAPH_TESTS="tests/gpu/test_x.py"  run only these GPU test files (default: tests/gpu)
#   VITGRAPH_STRESS_CALLS=5000            checked calls per stress part (0: no stress run)
#   VITGRAPH_BENCHES="benchmarks/a.py"    extra benchmark scripts to run after
set -uo pipefail
source scripts/device_setup.sh
source scripts/optional_wheels.sh
python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("vitgraph registered:", "vitgraph" in torch.compiler.list_backends(exclude_tags=()))
PY
python3 -m pytest ${VITGRAPH_TESTS:-tests/gpu} -m gpu -q -s -p no:cacheprovider --hypothesis-profile=gpu 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "max abs error|memory report|stress|under pressure|bounded|after failed|pool of the largest|passed|failed|Error" | cut -c1-400 | tail -40
calls=${VITGRAPH_STRESS_CALLS:-5000}
if [ "$calls" != "0" ]; then
  echo "== stress ($calls calls per part)"
  python3 -m vit_graph_backend.bench.stress --calls "$calls" --json "$OUT/stress.json" 2>&1 | tee "$OUT/stress.log" | grep -v WARNING | tail -12
fi
for b in ${VITGRAPH_BENCHES:-}; do
  echo "== bench $b"; python3 $b 2>&1 | tee -a "$OUT/bench.log" | tail -30
done
echo "== summary"; tail -1 "$OUT/gpu_tests.log"; [ -f "$OUT/stress.log" ] && tail -8 "$OUT/stress.log"
