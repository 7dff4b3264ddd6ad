#!/usr/bin/env bash
# Sourced by scripts/first_pass_check.sh and scripts/compile_time_check.sh.
# clip_first_pass LABEL TREE CACHE [PROBE ARGUMENTS]: CLIP ViT-L/14-336's first pass
# (benchmarks/first_pass_cache_probe.py auto [PROBE ARGUMENTS]) in a process of its own, with
# Inductor's, Triton's and Python's bytecode caches in the folder CACHE and a compile job id set
# (as the README advises), TREE's src/ first on PYTHONPATH (the optional wheels' entries kept).
# Prints the probe's first-pass, capture and Dynamo-phase lines, each after "LABEL: ".
clip_first_pass() {
  ( unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=$3/pyc TORCHINDUCTOR_CACHE_DIR=$3/inductor \
      TRITON_CACHE_DIR=$3/triton TORCH_COMPILE_JOB_ID=clip_first_pass \
      PYTHONPATH="$2/src${PYTHONPATH:+:$PYTHONPATH}"
    python3 benchmarks/first_pass_cache_probe.py auto "${@:4}" 2>&1 \
      | grep -E "first pass|graphs captured|bytecode_tracing|call_user_compiler" \
      | sed "s/^/$1: /" )
}
