"""cuDNN's ragged (THD) attention for the packed graphs' full-attention layers, through
``nvidia-cudnn-frontend`` (optional, imported on first use).

It beats flash varlen on full attention at the Qwen head sizes but not on window layers
(docs/performance.md), so only full attention comes here. Segments are device tensors, so one
cuDNN graph per shape serves every call and captures; PyTorch's own entry to the kernel fails
CUDA-graph capture in torch 2.11. Graphs are built outside capture; refused shapes are remembered,
out-of-memory builds are tried again.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

import torch

from ..errors import error_line, out_of_memory

__all__ = ["RaggedAttention", "cudnn_frontend_reason"]

log = logging.getLogger(__name__)

_INT32_MAX = 2 ** 31 - 1

def cudnn_frontend_reason() -> str | None:
    """Why cuDNN ragged attention cannot be used in this process, or ``None`` if it can."""
    try:
        importlib.import_module("cudnn")
    except Exception as exc:  # ImportError, or a native library that fails to load
        return (f"nvidia-cudnn-frontend is not importable ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); pip install "
                "'vit-graph-backend[cudnn]'")
    return None


def element_offsets(offsets: torch.Tensor, row_stride: int) -> torch.Tensor:
    """Ragged offsets in elements, as cuDNN reads them: ``offsets`` (cumulative rows, int32)
    times the tensor's row stride, shaped ``(n + 1, 1, 1, 1)``."""
    return (offsets * row_stride).view(-1, 1, 1, 1)


def segment_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Each segment's rows, ``(n, 1, 1, 1)`` int32 (0 for a repeated offset)."""
    return (offsets[1:] - offsets[:-1]).view(-1, 1, 1, 1)


class _Plan:
    """One built cuDNN graph and its tensor descriptors."""

    def __init__(self, cudnn: Any, handle: Any, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slots: int, max_len: int, scale: float) -> None:
        dtype = {torch.bfloat16: cudnn.data_type.BFLOAT16,
                 torch.float16: cudnn.data_type.HALF}[q.dtype]
        graph = cudnn.pygraph(io_data_type=dtype, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        heads, dim = q.shape[1], q.shape[2]
        dims = [slots, heads, max_len, dim]
        index = dict(stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        self.seq = graph.tensor(name="seq", dim=[slots, 1, 1, 1], **index)
        #: row stride -> the ragged offset descriptor of the tensors with that stride
        self.offsets: dict[int, Any] = {}
        self.inputs = []
        for name, x in zip("qkv", (q, k, v), strict=True):
            row, head = x.stride(0), x.stride(1)
            desc = graph.tensor(name=name, dim=dims, stride=[max_len * row, head, row, 1],
                                data_type=dtype)
            desc.set_ragged_offset(self._offset(graph, row, slots, index))
            self.inputs.append(desc)
        out, _ = graph.sdpa(name="sdpa", q=self.inputs[0], k=self.inputs[1], v=self.inputs[2],
                            generate_stats=False, attn_scale=scale, use_padding_mask=True,
                            seq_len_q=self.seq, seq_len_kv=self.seq)
        row = heads * dim  # the output is a fresh contiguous (rows, heads, head_dim) tensor
        out.set_output(True).set_dim(dims).set_stride([max_len * row, dim, row, 1])
        out.set_ragged_offset(self._offset(graph, row, slots, index))
        self.out = out
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.workspace = graph, int(graph.get_workspace_size())

    def _offset(self, graph: Any, row: int, slots: int, index: dict[str, Any]) -> Any:
        if row not in self.offsets:
            self.offsets[row] = graph.tensor(name=f"ragged_{row}", dim=[slots + 1, 1, 1, 1],
                                             **index)
        return self.offsets[row]


class RaggedAttention:
    """Packed segment attention through cuDNN, one built graph per shape (thread-safe).

    Call it with ``(rows, heads, head_dim)`` q, k, v (any row and head strides), cumulative int32
    ``offsets`` and a static ``max_seqlen``; returns the output, or ``None`` where cuDNN cannot
    serve the shape (flash varlen then runs). Layout tensors derived from ``offsets`` go into
    ``cache`` when given, so layers sharing the offsets compute them once."""

    def __init__(self) -> None:
        self._cudnn: Any = None
        self._handles: dict[int, Any] = {}
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        #: shape key -> why cuDNN does not serve it (flash varlen does)
        self.refused: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()

    @property
    def state(self) -> dict[str, Any]:
        """Shapes served (count) and shapes refused with their reasons."""
        with self._lock:
            return {"plans": len(self._plans),
                    "refused": {str(key): why for key, why in self.refused.items()}}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 offsets: torch.Tensor, max_seqlen: int, scale: float,
                 cache: dict[Any, torch.Tensor] | None = None) -> torch.Tensor | None:
        if not q.is_cuda:
            return None
        slots = offsets.numel() - 1
        key = (q.device.index, q.dtype, slots, max_seqlen, tuple(q.shape[1:]),
               *(tuple(x.stride()[:2]) for x in (q, k, v)), scale)
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                if key in self.refused or torch.cuda.is_current_stream_capturing():
                    return None  # never built inside a capture: its warm-up runs build it
                plan = self._build(key, q, k, v, slots, max_seqlen, scale)
                if plan is None:
                    return None
            cache = {} if cache is None else cache
            if "lengths" not in cache:
                cache["lengths"] = segment_lengths(offsets)
            out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
            feeds = {plan.inputs[0]: q, plan.inputs[1]: k, plan.inputs[2]: v, plan.out: out,
                     plan.seq: cache["lengths"]}
            for row, desc in plan.offsets.items():
                if row not in cache:
                    cache[row] = element_offsets(offsets, row)
                feeds[desc] = cache[row]
            workspace = torch.empty(max(plan.workspace, 1), device=q.device, dtype=torch.uint8)
            handle = self._handles[q.device.index]
            # the handle belongs to the tensors' device: launch on that device's stream
            with torch.cuda.device(q.device):
                self._cudnn.set_stream(handle=handle,
                                       stream=torch.cuda.current_stream(q.device).cuda_stream)
                plan.graph.execute(feeds, workspace, handle=handle)
            return out

    def _build(self, key: tuple[Any, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: int, max_len: int, scale: float) -> _Plan | None:
        largest = max(x.stride(0) for x in (q, k, v)) * q.shape[0]
        if q.dtype not in (torch.bfloat16, torch.float16):
            reason = f"dtype {q.dtype} (cuDNN ragged attention takes float16/bfloat16)"
        elif largest > _INT32_MAX:
            reason = f"{largest} elements overflow the int32 ragged offsets"
        else:
            try:
                if self._cudnn is None:
                    self._cudnn = importlib.import_module("cudnn")
                with torch.cuda.device(q.device):
                    if q.device.index not in self._handles:
                        self._handles[q.device.index] = self._cudnn.create_handle()
                    plan = _Plan(self._cudnn, self._handles[q.device.index], q, k, v, slots,
                                 max_len, scale)
            except Exception as exc:  # cuDNN refuses the shape, or the library is unusable
                reason = error_line(exc)
                if out_of_memory(exc):  # not remembered: tried again
                    log.warning("vitgraph: cuDNN ragged attention for %d segments of up to %d "
                                "rows: %s; flash varlen serves this call", slots, max_len, reason)
                    return None
            else:
                self._plans[key] = plan
                return plan
        self.refused[key] = reason
        log.warning("vitgraph: cuDNN ragged attention refused %d segments of up to %d rows, "
                    "%d heads of %d (%s); flash varlen serves them", slots, max_len,
                    q.shape[1], q.shape[2], reason)
        return None
