"""Host time of checking that N tensors still have the addresses they had: the Python loop the
weight watch runs (``map`` of ``dict.get`` and ``Tensor.data_ptr``, ``weight_watch.py``) against
PyTorch's C++ helper that Inductor's graph trees use
(``torch._C._tensors_data_ptrs_at_indices_equal``), on the CPU.

Usage: python benchmarks/data_ptr_check_probe.py [--tensors 392]. Text to stdout and to
$OUT/data_ptr_check_probe.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from _per_call import timed_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=392)
    args = parser.parse_args()
    tensors = [torch.zeros(3) for _ in range(args.tensors)]
    tables, names = [{"weight": t} for t in tensors], ["weight"] * len(tensors)
    then = tuple(t.data_ptr() for t in tensors)
    index = list(range(len(tensors)))
    helper = torch._C._tensors_data_ptrs_at_indices_equal
    checks = {
        "map(dict.get) + map(data_ptr), tuple ==":
            lambda: tuple(map(torch.Tensor.data_ptr, map(dict.get, tables, names))) == then,
        "map(dict.get) + C++ helper":
            lambda: helper(list(map(dict.get, tables, names)), list(then), index),
        "C++ helper alone (tensors listed)": lambda: helper(tensors, list(then), index),
        "map(data_ptr) alone": lambda: tuple(map(torch.Tensor.data_ptr, tensors)) == then,
    }
    lines = [f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
             f"{args.tensors} tensors; us per check, 3 runs of 5000"]
    lines += timed_rows(checks, 5000, 42, 1)
    emit(lines, "data_ptr_check_probe")


if __name__ == "__main__":
    main()
