"""Serving packed encoders: :class:`PackedGraphEncoder` and :func:`serve`.

:class:`PackedGraphEncoder` wraps a ``SupportsEncoderCudaGraph`` (usually from
:func:`~vit_graph_backend.adapters.adapt`) and routes each call's items through an
:class:`~vit_graph_backend.runtime.manager.EncoderCudaGraphManager`, returning the packed output in
the caller's item order, as the wrapped tower would.

The routing is Python over host metadata and is excluded from Dynamo
(``torch.compiler.disable``). Only ``encoder_cudagraph_forward`` meets the inner compiler: with
``"inductor"`` it is compiled once with symbolic row dimensions and every budget's graph captures
that one function (one compile per budget would be slow and would hit Dynamo's recompile limit);
TensorRT builds static shapes, so ``"tensorrt"`` compiles per budget. Options are given to
:func:`serve`, not ``torch.compile(options=...)``: Dynamo never calls a backend for a skipped frame.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import _compat
from . import adapt
from .inputs import PackedCall, grid_tensor
from ..runtime.report import summarize
from ..runtime.inner import inner_backend
from ..options import VitGraphOptions
from ..protocol import SupportsEncoderCudaGraph
from ..runtime.manager import EncoderCudaGraphManager, infer_device_dtype

__all__ = ["PackedGraphEncoder", "concat_items", "live_served", "serve"]

_served: weakref.WeakSet[PackedGraphEncoder] = weakref.WeakSet()
_served_lock = threading.Lock()

#: List grids whose tensors a served tower keeps (:meth:`PackedGraphEncoder._grid_of`).
KEPT_GRIDS = 256


def live_served() -> list[PackedGraphEncoder]:
    """The served towers still alive (for ``vit_graph_backend.report()``)."""
    with _served_lock:
        return list(_served)


class _CompiledCompute:
    """The encoder with ``encoder_cudagraph_forward`` replaced by its inner-compiled version."""

    def __init__(self, encoder: Any, options: VitGraphOptions) -> None:
        self._encoder = encoder
        self._dynamic_rows = options.inner_compiler != "tensorrt"
        self._forward = torch.compile(encoder.encoder_cudagraph_forward,
                                      backend=inner_backend(options),
                                      dynamic=None if self._dynamic_rows else False)

    def encoder_cudagraph_forward(self, values: Mapping[str, torch.Tensor]) -> Any:
        if self._dynamic_rows:  # one trace serves every budget (see the module docstring)
            for value in values.values():
                if isinstance(value, torch.Tensor) and value.dim():
                    _compat.maybe_mark_dynamic(value, 0)
        return self._forward(values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._encoder, name)


class PackedGraphEncoder(nn.Module):
    """A ``SupportsEncoderCudaGraph`` module (e.g. from ``adapt(hf_tower)``) served from budgeted
    CUDA graphs; ``options``: a :class:`VitGraphOptions`, or its fields as keyword arguments.

    Example::

        served = serve(hf_qwen25_vl.model.visual, max_items_per_graph=4)
        merged = served(pixel_values, grid_thw)       # same layout as the HF tower's output
        print(served.report())                          # graphs, memory, hits, fallbacks
    """

    def __init__(self, encoder: SupportsEncoderCudaGraph, options: VitGraphOptions | None = None,
                 **option_kwargs: Any) -> None:
        super().__init__()
        self.encoder = encoder
        self.options = options = VitGraphOptions.given(options, option_kwargs)
        # the compiled wrapper is no nn.Module: device and dtype from the encoder
        device, dtype = infer_device_dtype(encoder)
        inner = options.inner_compiler_for(cuda=device.type == "cuda", packed=True)
        compute = encoder if inner == "eager" else _CompiledCompute(encoder, options)
        # the tower's weights are the ones the graphs read (runtime.weights)
        self.manager = EncoderCudaGraphManager(compute, options, device=device, dtype=dtype,
                                               watch=getattr(encoder, "tower", encoder))
        #: grid tensors of recent list grids, by their rows (see _grid_of)
        self._grids: dict[tuple, torch.Tensor] = {}
        self._grids_lock = threading.Lock()
        with _served_lock:
            _served.add(self)

    def refresh(self) -> None:
        """Serve the tower as it is now, after a submodule was replaced, a hook added or code
        patched: graphs are captured again at the next call (``runtime.weights``)."""
        refresh = getattr(self.encoder, "refresh", None)
        if callable(refresh):
            refresh()
        self.manager.refresh()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """With ``capture="background"``: wait for the preparation to end (its graphs served,
        or it failed: ``report()`` says); True once none runs, False if ``timeout`` seconds
        passed first."""
        return self.manager.wait_prepared(timeout)

    def report(self) -> dict[str, Any]:
        """Graphs, graph memory, capture time and call counters (as ``vitgraph.report()``)."""
        return summarize([self.manager])

    @torch.compiler.disable
    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> Any:
        """Encode packed items (``pixel_values``: the ``(patches, patch_dim)`` rows the HF processor
        emits; ``grid_thw``: a tensor or a list of ``[t, h, w]`` rows); returns the packed output
        (a tensor or a tuple of tensors).

        Raises:
            InvalidInputError: (a ``ValueError``) for a bad ``grid_thw`` or ``pixel_values``,
                before any graph runs.
        """
        rows = None
        if not isinstance(grid_thw, torch.Tensor):
            grid_thw, rows = self._grid_of(grid_thw)
        outputs = self.manager.run(PackedCall(pixel_values, grid_thw, rows))
        return concat_items(outputs)

    def _grid_of(self, rows: Any) -> tuple[torch.Tensor, list[tuple[int, int, int]] | None]:
        """``grid_tensor(rows)`` and the rows as ints (``None`` unless all ints); recent rows
        reuse their tensor (:data:`KEPT_GRIDS`), as serving streams repeat sizes."""
        try:
            key = tuple(map(tuple, rows))
        except TypeError:  # not rows of sequences: grid_tensor names the problem
            return grid_tensor(rows), None
        # ints only: 4.0 == 4 and True == 1, but grid_tensor refuses floats and bools
        if not all(type(v) is int for row in key for v in row):
            return grid_tensor(rows), None
        grid = self._grids.get(key)
        if grid is None:
            grid = grid_tensor(rows)  # the shape and emptiness checks
            with self._grids_lock:
                if len(self._grids) >= KEPT_GRIDS:  # the oldest first: dicts keep their order
                    del self._grids[next(iter(self._grids))]
                self._grids[key] = grid
        return grid, list(key)

    @torch.compiler.disable
    def run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """Encode ``inputs`` (the encoder's own input mapping); one output per item, in order."""
        return self.manager.run(inputs)


def serve(model: nn.Module, options: VitGraphOptions | None = None,
          **fields: Any) -> PackedGraphEncoder:
    """Serve ``model`` (a packed tower, adapted by class, or a ``SupportsEncoderCudaGraph``) from
    CUDA graphs; ``options``: a :class:`VitGraphOptions`, or its fields as keyword arguments.

    Raises:
        UnsupportedModelError: (a ``TypeError``) if no adapter serves ``model``'s class.
        InvalidOptionError: for bad options or an unknown keyword, before anything runs.
    """
    options = VitGraphOptions.given(options, fields)
    return PackedGraphEncoder(adapt(model, options), options)


def concat_items(outputs: list[Any]) -> Any:
    """Per-item outputs (tensors, or tuples of tensors) joined along rows, as one packed call's."""
    first = outputs[0]
    if len(outputs) == 1:  # already the caller's own tensor(s), never a graph's static output
        return first
    if isinstance(first, torch.Tensor):
        return _joined(outputs)
    return type(first)(_joined([o[i] for o in outputs]) for i in range(len(first)))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, or a view when the parts lie back to back in one storage."""
    first = parts[0]
    # not for outputs with autograd history: cat's backward is the plain one
    if first.is_contiguous() and first.dim() >= 1 and not first.requires_grad:
        row = first[0].numel() * first.element_size() if first.shape[0] else 0
        end, rows = first.data_ptr(), 0
        for part in parts:
            if (part.data_ptr() != end or not part.is_contiguous() or part.dtype != first.dtype
                    or part.device != first.device or part.shape[1:] != first.shape[1:]
                    or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
                break
            end += part.shape[0] * row
            rows += part.shape[0]
        else:
            if row:
                return first.as_strided((rows, *first.shape[1:]), first.stride(),
                                        first.storage_offset())
    return torch.cat(parts)
