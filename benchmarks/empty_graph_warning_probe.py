"""Whether ``gpu_timing.graph_ms`` leaves PyTorch's "The CUDA Graph is empty" warning behind when
its work runs out of memory inside the capture before launching anything: once with the write
into the abandoned capture (``gpu_timing._write_in_capture``) turned off, once with it.

Usage: python benchmarks/empty_graph_warning_probe.py (a CUDA GPU)."""

import warnings

import torch

from vit_graph_backend.runtime import timing as gpu_timing

for label in ("without the write into the capture", "with it"):
    saved = gpu_timing._write_in_capture
    if label.startswith("without"):
        gpu_timing._write_in_capture = lambda mark: None
    runs = []

    def fn():
        runs.append(1)
        if len(runs) > 1:
            return torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        return None

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            gpu_timing.graph_ms(fn)
        except torch.OutOfMemoryError as exc:
            print(label, "- raised:", type(exc).__name__)
    gpu_timing._write_in_capture = saved
    print(label, "- warnings:", [str(w.message)[:90] for w in seen])
