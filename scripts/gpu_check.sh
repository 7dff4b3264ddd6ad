#!/usr/bin/env bash
# One device call: install, GPU tests, benchmarks; prints a short table last.
# Usage (on a CUDA machine, repo root): bash scripts/gpu_check.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vitgraph_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 - <<'PY'
import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("vitgraph registered:", "vitgraph" in torch.compiler.list_backends(exclude_tags=()))
PY
python3 -m pytest tests/gpu -m gpu -q -s -p no:cacheprovider --hypothesis-profile=gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "max abs error|memory report|passed|failed|error|Error" | tail -40
for b in ${VITGRAPH_BENCHES:-}; do
  echo "== bench $b"; python3 $b 2>&1 | tee -a "$OUT/bench.log" | tail -30
done
echo "== summary"; tail -1 "$OUT/gpu_tests.log"
