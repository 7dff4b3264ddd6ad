#!/usr/bin/env bash
# One device call for the packed path's host time: the host-overhead benchmark for a baseline
# source tree (optional) and this tree, side by side in one process sequence, the per-step
# breakdown of this tree (graph_launch_probe.py --parts parts), then the GPU tests of the packed
# path, the graph launch and the stream ordering. Short table last.
# Usage (CUDA machine, repo root): bash scripts/packed_host_check.sh [BASELINE_TREE]
#   BASELINE_TREE: a checkout of the code to compare against (its src/ goes on PYTHONPATH), e.g.
#   made with: mkdir -p baseline && git archive <commit> src | tar -x -C baseline
set -uo pipefail
source scripts/device_setup.sh
base=${1:-}
python3 -c "import torch; print('torch', torch.__version__, 'device', torch.cuda.get_device_name(0))"
if [ -n "$base" ]; then
  echo "== host time, baseline tree $base"
  PYTHONPATH="$base/src" python3 benchmarks/packed_host_overhead.py --label baseline --no-profile 2>&1 \
    | grep -v WARNING | tee "$OUT/host_baseline.log" | head -10
fi
echo "== host time, this tree"
PYTHONPATH="$PWD/src" python3 benchmarks/packed_host_overhead.py --label this 2>&1 | grep -v WARNING \
  | tee "$OUT/host_this.log" | head -10
echo "== where the host time goes, this tree"
(cd benchmarks && PYTHONPATH="$PWD/../src" python3 graph_launch_probe.py --parts parts 2>&1) \
  | grep -v WARNING | tee "$OUT/parts_this.log" | tail -34
echo "== packed, graph launch and stream order GPU tests"
PYTHONPATH="$PWD/src" python3 -m pytest tests/gpu/test_packed_gpu.py tests/gpu/test_packed_followed_gpu.py tests/gpu/test_graph_launch_gpu.py \
  tests/gpu/test_concurrency_gpu.py -m gpu -q -s -p no:cacheprovider 2>&1 \
  | tee "$OUT/packed_tests.log" | grep -E "returned while|queued behind|max relative|passed|failed|Error" | cut -c1-300 | tail -20
echo "== summary"
for f in "$OUT"/host_baseline.log "$OUT"/host_this.log; do [ -f "$f" ] && sed -n 2,9p "$f"; done
tail -1 "$OUT/packed_tests.log"
