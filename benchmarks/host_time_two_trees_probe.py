"""A packed call's host time with this tree's package against another tree's, in one process.

Across processes the host time of one call varies by more than most changes to it
(``benchmarks/results/packed_call_host_time_*``), so this probe imports a second build of the
package from another source tree (``--baseline``, a folder holding ``vit_graph_backend/``; copied
under the name ``vit_graph_backend_then``: the package imports itself relatively), serves the same
tower with each, and alternates the two call by call (``_interleaved_calls.py``: time to the
launch, the call's host time, and the call with a sync after it, right after a sync and back to
back). The Qwen2.5-VL-3B-shaped tower, random weights, bf16, defaults, one image of ``side`` x
``side`` patches a call, the grid as a list. Each build must serve with its own adapter (a mix of
two builds' code returns wrong numbers: one's runtime does not know the other's buffer types);
each build's output is compared once with HF's eager output, and its counts of items served from
graphs and eagerly are printed: both must serve from graphs. The builds share the ``vitgraph::``
custom ops (``fused_linear.py``, ``attention_op.py``): the later registration, the baseline's,
serves both, so the probe compares the host code around them. A third mode serves this tree's
tower with its native checks' loops set aside (``native_checks.py``: the Python checks), so
the loops' share is measured in the same run; the loops are built before the first call.

Usage: python benchmarks/host_time_two_trees_probe.py --baseline baseline/src [--sides 32,64]
[--calls 60] [--name NAME]. Text to stdout and to $OUT/NAME.txt when $OUT is set.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MODES = ("baseline", "this tree", "python checks")


def _baseline_package(source: str):
    folder = Path(source) / "vit_graph_backend"
    if not (folder / "__init__.py").is_file():
        raise SystemExit(f"--baseline {source!r} holds no vit_graph_backend package")
    copy = Path(tempfile.mkdtemp()) / "vit_graph_backend_then"
    shutil.copytree(folder, copy)
    # trees before the package named itself by __name__ name it in full: the copy would serve
    # with this tree's adapters, whose buffers its runtime does not know, and its code watch
    # would take its own code for a patch
    for path in copy.rglob("*.py"):
        text = path.read_text()
        for quoted in ('"vit_graph_backend.', '"vit_graph_backend"'):
            text = text.replace(quoted, quoted.replace("backend", "backend_then"))
        path.write_text(text)
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module("vit_graph_backend_then")


def main() -> None:
    from _interleaved_calls import arguments, header, interleaved, table_lines

    args = arguments(__doc__, "32,64", "host_time_two_trees_probe",
                     [("--baseline", "a folder holding the other tree's vit_graph_backend/")])
    import torch
    from _bench_out import emit
    from qwen_stream import tower, warm_image

    import vit_graph_backend

    from vit_graph_backend import native_checks

    built = native_checks.build()
    then = _baseline_package(args.baseline)
    hf = tower()
    ours = vit_graph_backend.serve(hf)
    served = {"baseline": then.serve(hf), "this tree": ours, "python checks": ours}
    for (mode, one), package in zip(served.items(), (then, vit_graph_backend, vit_graph_backend)):
        adapter = type(one.encoder).__module__
        if not adapter.startswith(package.__name__ + "."):
            raise SystemExit(f"{mode} serves with {adapter}, not its own build's adapter")
    lines = []
    for side in map(int, args.sides.split(",")):
        for one in served.values():
            pv, grid = warm_image(one, side)
        with torch.inference_mode():
            outs = [one(pv, grid).float() for one in (served["baseline"], ours)]
            ref = hf(pv, grid_thw=torch.tensor(grid, device=pv.device))
            ref = getattr(ref, "pooler_output", ref).float()
        errors = ", ".join(f"{(out - ref).abs().max().item():.3g}" for out in outs)
        largest = ref.abs().max().item()
        def set_mode(mode: str) -> None:
            native_checks.loops = (lambda: None) if mode == "python checks" else loops

        loops = native_checks.loops
        try:
            rows = interleaved(served, pv, grid, MODES, set_mode, args.calls)
        finally:
            native_checks.loops = loops
        counts = [(one.manager.stats.graph_items, one.manager.stats.eager_items)
                  for one in (served["baseline"], ours)]
        lines += [f"side {side}: largest difference from HF's eager output per build {errors} "
                  f"(bf16; its largest magnitude {largest:.3g}); (graph, eager) items per build "
                  f"{counts}",
                  header("build", 10), *table_lines(rows, side * side, MODES, 10)]
    emit([f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one "
          f"Qwen2.5-VL-3B-shaped tower served by two builds: baseline {then.__file__}, this tree "
          f"{vit_graph_backend.__file__} (native checks: {native_checks.status()}, "
          f"{getattr(built, '__name__', None)}; 'python checks': this tree's tower with them set "
          f"aside); {args.calls} calls per build and condition, "
          "interleaved call by call; us, median", *lines], args.name)


if __name__ == "__main__":
    main()
