"""`SupportsEncoderCudaGraph`: what a packed encoder implements to be served from CUDA graphs.

Batched encoders (``[B, C, H, W]`` in, rows independent) need no code: the ``vitgraph`` backend
pads their batch axis itself. Packed encoders (one ``[total_patches, D]`` sequence plus per-item
grids, as in Qwen2-VL, Qwen2.5-VL, Qwen3-VL and NaViT-style towers) need model knowledge to pad:
attention boundaries, rotary tables, window indices. They implement this protocol, or the package
ships an adapter that does (``vit_graph_backend.adapt``).

Six methods, all driven by :class:`~vit_graph_backend.specs.EncoderItemSpec`. Four would cover
capture and replay; the two others (budget range and eager forward) are kept because without them
the runtime would need model-specific defaults or a second code path for oversize items, which is
harder on the person writing an adapter than two short methods.

An encoder whose graphs read copies of its weights (padded or packed, as the Qwen adapters' MLP
copies) may add ``refresh_encoder_cudagraph_weights() -> bool``: bring the copies up to date
with weights written in place, True if one was copied. The runtime calls it once per call it
serves from graphs, after the call's first launch (the graph read the old copies, still valid
memory, and is replayed again when it returns True). Weights given new storage are the
runtime's to see before any launch (``weights.py``). Whoever replays the graphs by hand calls it
before each replay.

Layout contract (the runtime relies on it):
    - Items of a batch are laid out back to back in the order of ``item_indices``; item ``k``'s
      output rows start where item ``k-1``'s end, from row 0.
    - ``encoder_cudagraph_forward`` returns a tensor (or a tuple of tensors) whose leading
      dimension is output tokens, at least ``budget`` rows; rows past the batch's real tokens are
      padding and are never read.
    - Replay buffers have the capture inputs' keys. A buffer of the capture buffer's exact shape is
      copied whole; a shorter one (fewer leading rows) is copied into the head and the tail is
      zeroed by the runtime. Offsets must make padding its own segment (repeat the last cumulative
      offset, or add a dummy segment) so real tokens never attend to padding.
    - A replay buffer may also be a host tensor of the capture buffer's exact shape in pinned
      memory (``torch.empty(..., pin_memory=True)``, padding written on the host): the runtime
      copies it without a host sync, so the host can run ahead of a busy GPU. Allocate it fresh
      per call and never write it after returning it (``adapters/_staging.py`` does this).
    - Replay buffers that depend only on the batch's item sizes (offsets, rotary tables) may be
      returned as :class:`StampedBuffers`: the runtime then skips their copies when the budget's
      static buffers were last filled from the same stamp (``adapters/_qwen_packing.py`` stamps
      each staged batch).
    - Everything computed from ``grid_thw`` on the host (offsets, rotary tables, window indices)
      is computed *outside* ``encoder_cudagraph_forward``: that function is traced and captured
      and may not call ``.item()`` or ``.tolist()``.

Example::

    class MyPackedEncoder(nn.Module):
        # a tower whose forward(pixel_values, grid_thw) packs images of any size
        def get_encoder_cudagraph_item_specs(self, inputs):
            return [EncoderItemSpec(t * h * w, t * (h // 2) * (w // 2), t)
                    for t, h, w in inputs["grid_thw"].tolist()]

        def get_encoder_cudagraph_budget_range(self):
            return (64, 4096)          # output tokens of the smallest and largest graph

        def prepare_encoder_cudagraph_capture_inputs(self, budget, max_batch_size,
                                                     max_frames_per_batch, device, dtype):
            layout = capture_layout(budget, max_batch_size, max_frames_per_batch)
            grids = dummy grids, one per slot, each with layout.tokens_per_slot output tokens
            return self._metadata(pixel_values=zeros(...), grids=grids)   # dict of tensors

        def prepare_encoder_cudagraph_replay_buffers(self, inputs, item_indices, budget):
            return self._metadata(pixel_values=the items' rows, grids=the items' grids,
                                  pad_to=budget)                          # same keys

        def encoder_cudagraph_forward(self, values):
            return self.blocks_and_merger(values)   # pure tensor code, no .item()

        def encoder_eager_forward(self, inputs, item_indices):
            return self.forward(the items' rows, the items' grids)        # packed output
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .specs import EncoderItemSpec

if TYPE_CHECKING:
    import torch

__all__ = ["EncoderOutput", "StampedBuffers", "SupportsEncoderCudaGraph",
           "supports_encoder_cudagraph"]

#: A tensor, or a tuple of tensors sharing the leading (token) dimension (e.g. deepstack features).
EncoderOutput = Any


@runtime_checkable
class SupportsEncoderCudaGraph(Protocol):
    """A packed encoder that can be replayed from budgeted CUDA graphs."""

    def get_encoder_cudagraph_item_specs(
        self, inputs: Mapping[str, torch.Tensor]
    ) -> list[EncoderItemSpec]:
        """One spec per item of ``inputs``, in the caller's order. Runs on the host."""
        ...

    def get_encoder_cudagraph_budget_range(self) -> tuple[int, int]:
        """``(min_budget, max_budget)`` in output tokens: the smallest and largest sensible graph."""
        ...

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        budget: int,
        max_batch_size: int,
        max_frames_per_batch: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        """Dummy inputs for capturing ``budget``'s graph: ``max_batch_size`` slots, sized with
        :func:`~vit_graph_backend.budgets.capture_layout` (ceil division). These tensors become
        the graph's static buffers."""
        ...

    def prepare_encoder_cudagraph_replay_buffers(
        self,
        inputs: Mapping[str, torch.Tensor],
        item_indices: Sequence[int],
        budget: int,
    ) -> Mapping[str, torch.Tensor]:
        """Values for the static buffers that run ``item_indices`` (in that order) in ``budget``'s
        graph, padding included (see the layout contract in the module docstring): a dict, or a
        :class:`StampedBuffers` whose stamped buffers the runtime copies only when they are not
        in place already."""
        ...

    def encoder_cudagraph_forward(self, values: Mapping[str, torch.Tensor]) -> EncoderOutput:
        """The captured computation: pure tensor code over the static buffers."""
        ...

    def encoder_eager_forward(
        self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int]
    ) -> EncoderOutput:
        """Run ``item_indices`` without a graph; packed output in the same layout as the graph's."""
        ...


class StampedBuffers(dict):
    """Replay buffers, some of which are a pure function of ``stamp``.

    The mapping itself holds the buffers that change every call (e.g. ``pixel_values``);
    ``load()`` returns the others, and is called only when the budget's static buffers were not
    last filled from this very ``stamp`` object (compared by identity; the runtime keeps a
    reference to it, so it cannot be collected and its ``id`` reused). The encoder must give a
    new stamp whenever the loaded values could differ, and ``load()`` must return the same keys
    every time.

    Args:
        varying: the buffers written every call.
        stamp: any object standing for the loaded values.
        load: returns the other buffers (same rules as any replay buffer).
    """

    __slots__ = ("load", "stamp")

    def __init__(self, varying: Mapping[str, torch.Tensor], stamp: object,
                 load: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        super().__init__(varying)
        self.stamp, self.load = stamp, load

    def merged(self) -> dict[str, torch.Tensor]:
        """Every buffer, the loaded ones and the varying ones, as one plain dict."""
        return {**self.load(), **self}


def supports_encoder_cudagraph(model: object) -> bool:
    """True if ``model`` implements every method of :class:`SupportsEncoderCudaGraph`."""
    return isinstance(model, SupportsEncoderCudaGraph)
