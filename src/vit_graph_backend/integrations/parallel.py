"""Data-parallel encoders over a ``torch.distributed`` process group: :func:`data_parallel`.

SPMD: every rank calls the wrapper with the same full inputs, encodes only its share, and gets
back all outputs in the caller's order.

- **Packed** (a :class:`~vit_graph_backend.adapters.serve.PackedGraphEncoder`): items are assigned
  by :func:`~vit_graph_backend.integrations.assignment.assign_items`; every rank knows every
  share's output rows from the specs, so outputs return through one padded ``all_gather`` per
  tensor, with no exchange of sizes.
- **Batched** (any ``[B, ...] -> [B, ...]`` callable): near-equal contiguous chunks, the last
  zero-padded so every rank sees the same shapes; outputs may be tensors, tuples, mappings or
  ``ModelOutput``.

A call with fewer items than ranks runs whole on every rank, without collectives; without a
group, or in a world of 1, the encoder is called as it is.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .assignment import assign_items
from ..budgets import ceil_div
from ..adapters.inputs import grid_tensor
from ..adapters.serve import PackedGraphEncoder
from ..runtime.replay_io import output_tensors

__all__ = ["DataParallelEncoder", "data_parallel"]


def data_parallel(encoder: Callable[..., Any], group: Any = None, *,
                  record_busy: bool = False) -> DataParallelEncoder:
    """Wrap ``encoder`` so the ranks of ``group`` share each call's items (module docstring).

    Args:
        encoder: a served packed tower (``serve(...)``) or a batched encoder callable.
        group: a ``torch.distributed`` process group; ``None`` for the default group when
            ``torch.distributed`` is initialized, else no data parallelism.
        record_busy: time this rank's own share of every call (CUDA events, no sync per call),
            for :meth:`DataParallelEncoder.busy_seconds`: the ranks' imbalance.
    """
    return DataParallelEncoder(encoder, group, record_busy=record_busy)


class DataParallelEncoder(nn.Module):
    """See :func:`data_parallel`."""

    def __init__(self, encoder: Callable[..., Any], group: Any = None, *,
                 record_busy: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        self.group = group
        self.packed = isinstance(encoder, PackedGraphEncoder)
        self.record_busy = record_busy
        self._spans: list[tuple[Any, Any]] = []   # (start, end): CUDA events or perf_counter
        self._busy_s = 0.0

    def busy_seconds(self) -> float:
        """Seconds this rank spent encoding its own shares since the last call of this method
        (the collectives' waits excluded); synchronizes once. Needs ``record_busy=True``."""
        if not self.record_busy:
            raise RuntimeError("busy_seconds() needs data_parallel(..., record_busy=True)")
        self._fold(len(self._spans))
        busy, self._busy_s = self._busy_s, 0.0
        return busy

    def _fold(self, n: int) -> None:
        for start, end in self._spans[:n]:
            if isinstance(start, float):
                self._busy_s += end - start
            else:
                end.synchronize()
                self._busy_s += start.elapsed_time(end) / 1e3
        del self._spans[:n]

    def _local(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's share through the wrapped encoder, timed when ``record_busy``."""
        if not self.record_busy:
            return self.encoder(*args, **kwargs)
        cuda = next((a.device for a in list(args) + list(kwargs.values())
                     if isinstance(a, torch.Tensor) and a.is_cuda), None)
        if cuda is None:
            start = time.perf_counter()
            out = self.encoder(*args, **kwargs)
            self._spans.append((start, time.perf_counter()))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(cuda))
        out = self.encoder(*args, **kwargs)
        end.record(torch.cuda.current_stream(cuda))
        self._spans.append((start, end))
        if len(self._spans) > 4096:  # a long stream never read: fold the oldest, long finished
            self._fold(2048)
        return out

    def _world(self) -> tuple[int, int]:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rank, world = self._world()
        if world == 1:
            return self._local(*args, **kwargs)
        if self.packed:
            return self._packed(rank, world, *args, **kwargs)
        return self._batched(rank, world, *args, **kwargs)

    # ----------------------------------------------------------------------------- packed items
    def _packed(self, rank: int, world: int, pixel_values: torch.Tensor, grid_thw: Any) -> Any:
        served = self.encoder
        if not isinstance(grid_thw, torch.Tensor):
            grid_thw = grid_tensor(grid_thw)
        # one read of a device grid for the whole call
        grid_thw = grid_thw.cpu()
        inputs = {"pixel_values": pixel_values, "grid_thw": grid_thw}
        specs = served.manager.model.get_encoder_cudagraph_item_specs(inputs)  # checks inputs
        if len(specs) < world:
            return self._local(pixel_values, grid_thw)
        assignment = assign_items(specs, world)
        # an item's patch rows are its spec's input_size (no host sync)
        starts = list(itertools.accumulate((s.input_size for s in specs), initial=0))
        mine = list(assignment.ranks[rank])
        local_pixels = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in mine])
        local = self._local(local_pixels, grid_thw[mine])
        tokens = [s.output_tokens for s in specs]
        gathered = [_gather_rows(t, [sum(tokens[i] for i in items) for items in assignment.ranks],
                                 self.group) for t in output_tensors(local)]
        out = [_reorder(parts, assignment.ranks, tokens) for parts in gathered]
        return out[0] if isinstance(local, torch.Tensor) else type(local)(out)

    # ------------------------------------------------------------------------------ batched rows
    def _batched(self, rank: int, world: int, *args: Any, **kwargs: Any) -> Any:
        batch = next((a for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if batch is None or batch.shape[0] < world:
            return self._local(*args, **kwargs)
        rows = batch.shape[0]
        # equal chunks, the last zero-padded: the same shapes everywhere, so collectives match
        chunk = ceil_div(rows, world)
        lo = rank * chunk

        def mine(value: Any) -> Any:
            if not (isinstance(value, torch.Tensor) and value.dim() > 0
                    and value.shape[0] == rows):
                return value
            part = value[lo:lo + chunk]
            if part.shape[0] < chunk:
                part = torch.cat([part, part.new_zeros((chunk - part.shape[0], *part.shape[1:]))])
            return part

        local = self._local(*[mine(a) for a in args], **{k: mine(v) for k, v in kwargs.items()})

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or t.shape[0] != chunk:
                raise ValueError(
                    f"data_parallel: an output of shape {tuple(t.shape)} does not carry the "
                    f"batch axis at dim 0 (a chunk of {chunk} rows gave it): rows cannot be "
                    "split across ranks for this encoder")
            return torch.cat(_gather_rows(t, [chunk] * world, self.group))[:rows]

        return _map_tensors(local, gather)


def _gather_rows(local: torch.Tensor, sizes: Sequence[int], group: Any) -> list[torch.Tensor]:
    """Every rank's rows of one output, rank ``r``'s first ``sizes[r]`` (padded ``all_gather``)."""
    import torch.distributed as dist

    most = max(sizes)
    padded = local.new_zeros((most, *local.shape[1:]))
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return [part[:n] for part, n in zip(parts, sizes)]


def _reorder(parts: Sequence[torch.Tensor], ranks: Sequence[Sequence[int]],
             tokens: Sequence[int]) -> torch.Tensor:
    """The packed output in caller order from each rank's rows (its items in caller order)."""
    pieces: dict[int, torch.Tensor] = {}
    for part, items in zip(parts, ranks):
        offset = 0
        for item in items:
            pieces[item] = part[offset:offset + tokens[item]]
            offset += tokens[item]
    return torch.cat([pieces[i] for i in range(len(tokens))])


def _map_tensors(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` over every tensor of an output: a tensor, tuple/list, mapping or ``ModelOutput``."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, Mapping):
        values = {k: _map_tensors(v, fn) for k, v in out.items()}
        return type(out)(**values) if hasattr(out, "to_tuple") else type(out)(values)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(v, fn) for v in out)
    return out
