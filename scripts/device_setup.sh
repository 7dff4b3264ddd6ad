# Sourced first by every device check script (after `set -uo pipefail`): unbuffered Python
# output, $OUT (the device tool's folder, else /tmp/vitgraph_out) made, and this tree installed
# in editable mode (stops the script with pip's log when the install fails); defines bench().
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/vitgraph_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# bench ARGS: `vitgraph bench --no-progress ARGS` without the warnings' lines (the check scripts'
# runs of the main job).
bench() { vitgraph bench --no-progress "$@" 2>&1 | grep -vE "^WARNING|^\[rank|UserWarning|warnings.warn"; }
