"""``errors.out_of_memory``: the one test of "memory ran out" that the kernel choices, the cuDNN
plans and the capture share (a failure it accepts is tried again later, not refused for good)."""

from __future__ import annotations

import pytest
import torch

from vit_graph_backend.errors import out_of_memory


@pytest.mark.parametrize(("error", "expected"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"), True),
    (RuntimeError("cudnnCreate failed: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
     True),
    (RuntimeError("CUDNN_STATUS_ALLOC_FAILED"), True),
    # Triton's compile-time limits and other failures belong to the kernel or the shape
    (RuntimeError("out of resources: shared memory, Required: 262144, Hardware limit: 232448"),
     False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("head size 300 is not served"), False),
])
def test_out_of_memory_tells_memory_from_other_failures(error, expected):
    assert out_of_memory(error) is expected


def test_pytorchs_error_counts_whatever_its_message():
    assert out_of_memory(torch.OutOfMemoryError("no message of the usual kind"))
