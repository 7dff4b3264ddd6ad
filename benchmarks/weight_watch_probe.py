"""Host time of the weight check before every packed call (``weight_watch.py``), in process.

The Qwen2.5-VL-3B-shaped tower (random weights, bf16) served with the defaults and called once;
then ``WeightWatch.moved()`` of its manager, timed when nothing changed, and beside it the
adapter's own checks: the padded MLP copies' (``AlignedMLPs.refresh``), and where the tree has
them, the lookup of every submodule inside ``moved()`` and the MLP modules' check of the kernel
choices (``KernelChoices._follow``, ``adapters/_qwen_kernels.py``; ``_follow`` reads the
submodules through the watch, so it also shows that check), and the check of the
classes' code inside ``hooked()`` (``code_watch.py``). In process, so a change of a few
microseconds is not lost in the call-to-call spread of a whole packed call's host time between
processes (``benchmarks/packed_host_overhead.py``). To compare two source trees, run it once per
tree with ``PYTHONPATH=<tree>/src``. Where the tree has native checks' loops
(``native_checks.py``), they are built first and each check is timed with them and with them set
aside (the Python checks), in the same process.

Usage: python benchmarks/weight_watch_probe.py (CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _per_call import per_call_us  # noqa: E402
from qwen_stream import tower  # noqa: E402

import vit_graph_backend  # noqa: E402


def main() -> None:
    try:
        from vit_graph_backend import native_checks
    except ImportError:  # a tree without them
        native_checks = None
    else:
        native_checks.build()
    hf = tower()
    served = vit_graph_backend.serve(hf)
    pixels = torch.randn(32 * 32, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        served(pixels, [[1, 32, 32]])
    torch.cuda.synchronize()
    manager = served.manager
    watch = manager.checks.watch if hasattr(manager, "checks") else manager._watch
    slots = getattr(watch, "_slots", None)
    watched = len(slots[1]) if slots is not None else 1
    checked = getattr(watch, "_checked", slots)   # less those left to the MLP copies' check
    checked = len(checked[1]) if checked is not None else 1
    print(f"source {Path(vit_graph_backend.__file__).parent}; device "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; tensors watched {watched}"
          f", checked before the launch {checked}")
    kids = getattr(watch, "_kids", None)
    kernels = getattr(served.encoder, "kernels", None)
    checks = [("WeightWatch.moved()", watch.moved)]
    if hasattr(watch, "_tables_changed"):  # the module tables compared whole
        checks.append((f"  of which the {len(kids[1])} submodules' {len(watch._tables)} tables"
                       " compared whole", watch._tables_changed))
    elif kids is not None:
        checks.append((f"  of which the {len(kids[1])} submodule lookups",
                       lambda: tuple(map(dict.get, *kids)) != watch._tree))
    if hasattr(watch, "hooked"):
        checks.append((f"WeightWatch.hooked(refresh=False), {len(watch._dicts)} instance dicts",
                       lambda: watch.hooked(refresh=False)))
        checks.append((f"  and the {len(watch._hooks)} hook tables, after a hook registration",
                       lambda: any(watch._hooks)))
    code = getattr(watch, "_code", None)
    if code is not None:
        checks.append((f"  of which the code check ({len(code._state())} objects)",
                       code.replaced))
    if getattr(kernels, "aligned", None) is not None:
        checks.append(("AlignedMLPs.refresh()", kernels.aligned.refresh))
    if hasattr(kernels, "_follow"):
        checks.append(("KernelChoices._follow()", kernels._follow))
    modes = [("", None)]
    if native_checks is not None:
        loops = native_checks.loops
        print(f"native checks: {native_checks.status()}")
        modes = [("native loops: ", loops), ("Python checks: ", lambda: None)]
    for label, mode in modes:
        if native_checks is not None:
            native_checks.loops = mode
        for name, fn in checks:
            print(f"{label}{name}, nothing changed: "
                  + " / ".join(f"{us:.1f}" for us in per_call_us(fn, 3000)) + " us per call")
    if native_checks is not None:
        native_checks.loops = loops


if __name__ == "__main__":
    main()
