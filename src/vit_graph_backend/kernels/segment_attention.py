"""Full attention over segments through one Triton flash-attention kernel that tiles a head of 80
or 72 as 64 + 16 columns (``_segment_attention_kernel``).

cuDNN's ragged kernel, which the packed graphs' full-attention layers run otherwise
(``_cudnn_attention``), computes heads of 80 and 72 at the cost of 128. Timed from CUDA graphs
on an H100 at the Qwen2.5-VL-3B tower's shapes (16 heads of 80), in two runs, this kernel took
0.213 against 0.238 ms for one image of 4,096 patches, 0.121 to 0.122 against 0.136 to 0.137 ms
for two images in a 4,096-row budget, 0.028 to 0.029 against 0.036 ms for an image of 1,024 and
its padding; as fast to 9 % faster for one image of 16,384 (3.32 to 3.43 against 3.42 to 3.64
ms) and for an image of 12,000 and its padding; as fast for an image of 2,730 in a budget of
4,096 and 5 % faster for 16 frames of 1,024, but 4 to 5 % slower for 64 frames of 256. At the
Qwen3-VL-8B tower's shapes (16 heads of 72) it was 7 to 8 % slower on one image of 6,724
patches and 5 to 7 % faster on one of 4,900 in 7,168 rows
(``benchmarks/results/segment_attention_kernel_*``). Which one serves each budget is therefore
measured at capture (``_attention_choice``).

:class:`SegmentFlashAttention` is called like ``_cudnn_attention.RaggedAttention`` and returns
``None`` where it does not serve (the caller then runs cuDNN or flash varlen): tensors not on
CUDA, a GPU without TMA (compute capability below 9.0), a dtype other than float16/bfloat16, a
head size not a multiple of 8 or above :data:`MAX_HEAD_DIM`, more than :data:`MAX_SEGMENTS`
segment slots, a head not contiguous within its row, rows or heads not 16-byte aligned (TMA's
rule), or Triton missing. It compiles outside
CUDA-graph capture and remembers a shape it failed on (``_triton_calls``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._triton_calls import TritonKernelCalls, inputs_reason, layout_reason

__all__ = ["MAX_HEAD_DIM", "MAX_SEGMENTS", "SegmentFlashAttention", "segment_unserved_reason"]

#: Widest head the kernel takes (a 128-wide part and a tail of up to 128).
MAX_HEAD_DIM = 256
#: Most segment slots the kernel takes: each program scans every slot's offsets to find its own.
MAX_SEGMENTS = 4096


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def segment_unserved_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            offsets: torch.Tensor) -> str | None:
    """Why the kernel cannot serve these ``(rows, heads, head_dim)`` tensors within the segments
    at ``offsets``, or ``None`` if it can (on any device: the caller checks CUDA first, and the
    GPU's compute capability is checked on CUDA only)."""
    rows, heads, dim = q.shape
    why = inputs_reason(q, k, v, offsets, "segment kernel")
    if why is not None:
        return why
    if offsets.numel() - 1 > MAX_SEGMENTS:
        return (f"{offsets.numel() - 1} segment slots (the kernel takes up to {MAX_SEGMENTS})")
    if dim % 8 or dim > MAX_HEAD_DIM:
        return f"head size {dim} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    if rows >= 2 ** 31:
        return f"{rows} rows (TMA coordinates are 32-bit)"
    why = layout_reason(q, k, v)
    if why is not None:
        return why
    for name, x in zip("qkv", (q, k, v), strict=True):
        if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            return (f"{name} with row stride {x.stride(0)} at address {x.data_ptr():#x} (TMA "
                    "needs rows 16-byte aligned)")
    if q.is_cuda and _capability(q.device.index) < (9, 0):
        major, minor = _capability(q.device.index)
        return (f"compute capability {major}.{minor} (the kernel reads through TMA, 9.0 and "
                "newer)")
    return None


class SegmentFlashAttention(TritonKernelCalls):
    """Full attention within segments through ``_segment_attention_kernel`` (module docstring).

    Call it with ``(rows, heads, head_dim)`` q, k, v, the segments' cumulative int32 ``offsets``
    (the last equal to ``rows``), ``max_seqlen`` and ``cache`` (unused: the kernel walks each
    segment and derives nothing from the offsets) and the scale; it returns the output, or
    ``None`` where it does not serve. Thread-safe.
    """

    def __init__(self) -> None:
        super().__init__("vit_graph_backend.kernels._segment_attention_triton",
                         "segment attention kernel", "cuDNN or flash varlen")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 offsets: torch.Tensor, max_seqlen: int, scale: float,
                 cache: dict[Any, torch.Tensor] | None = None) -> torch.Tensor | None:
        if not q.is_cuda or segment_unserved_reason(q, k, v, offsets) is not None:
            return None
        key = (q.device.index, q.dtype, q.shape[-1])
        return self._launch(key, q.device,
                            lambda kernel: kernel.attend(q, k, v, offsets, scale))
