"""The Triton segment kernel (``kernels/_segment_attention_triton.py``) run by Triton's CPU
interpreter against the block-diagonal reference (``_packed_attention.masked_attention``).

Runs where Triton imports on a CPU machine and its interpreter works with the installed NumPy
(Triton 3.6's needs NumPy below 2.3); CI's CPU wheels have no Triton, so it is skipped there and
the kernel is checked on the GPU (``tests/gpu/test_segment_attention_gpu.py``). The interpreter
is chosen when a kernel is defined, so the check runs in a fresh process with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def _skip_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (CPU wheels of PyTorch do not bring it)"
    import numpy

    major, minor = (int(part) for part in numpy.__version__.split(".")[:2])
    if (major, minor) >= (2, 3):
        return f"Triton's interpreter fails with NumPy {numpy.__version__} (needs < 2.3)"
    return None


CHECK = r'''
import torch
from vit_graph_backend.kernels import _segment_attention_triton as kernel
from vit_graph_backend.kernels.packed_attention import masked_attention

torch.manual_seed(0)
cases = [([100], 2, 80, 32, 16), ([37, 0, 64, 5, 90], 2, 80, 32, 16),
         ([37, 0, 64, 5, 90], 2, 72, 32, 16), ([130, 2, 1, 1, 40], 1, 64, 32, 32),
         ([16] * 7, 2, 128, 32, 16), ([3, 3, 3, 3, 50, 1, 7], 2, 40, 16, 32),
         ([0, 77, 0], 1, 80, 64, 16), ([1] * 20 + [33, 0, 0, 17], 1, 80, 16, 16)]
worst = 0.0
for lengths, heads, dim, block_m, block_n in cases:
    rows = sum(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    q, k, v = torch.randn(rows, 3, heads, dim).unbind(1)  # views of one packed projection
    out = kernel.attend(q, k, v, offsets, dim ** -0.5, block_m=block_m, block_n=block_n)
    ref = masked_attention(q, k, v, offsets, dim ** -0.5)
    worst = max(worst, (out - ref).abs().max().item())
print(worst)
'''


@pytest.mark.skipif(_skip_reason() is not None, reason=f"{_skip_reason()}")
def test_the_kernel_matches_the_reference_in_the_interpreter():
    """Segments empty, of one row, shorter and longer than a block, a head of 80, 72 (a tail of
    8 real columns), 64, 128 and 40, q/k/v as strided views: max abs error below 1e-4 in
    float32."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    worst = float(done.stdout.strip().splitlines()[-1])
    assert worst < 1e-4, worst
