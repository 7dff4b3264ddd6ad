"""`SupportsEncoderCudaGraph`: what a packed encoder implements to be served from CUDA graphs.

Packed encoders (one ``[total_patches, D]`` sequence plus per-item grids) need model knowledge to
pad, so they implement this protocol or ship an adapter (example: docs/adapters.md). An encoder
whose graphs read weight copies may add ``refresh_encoder_cudagraph_weights() -> bool``, called
after each call's first launch (True: a copy changed, replay again).

Layout contract (the runtime relies on it):
    - Items of a batch lie back to back, in ``item_indices`` order, from output row 0.
    - ``encoder_cudagraph_forward`` returns a tensor (or tuple of tensors) whose leading dim is
      output tokens, at least ``budget`` rows; rows past the real tokens are never read.
    - Replay buffers have the capture inputs' keys; a shorter one is copied into the head and the
      tail zeroed. Offsets must make padding its own segment so real tokens never attend to it.
    - A replay buffer may be a pinned host tensor of the capture shape (copied without a host
      sync); allocate it fresh per call and never write it after returning it.
    - Buffers that depend only on item sizes may come as :class:`StampedBuffers`, copied only when
      the stamp changes.
    - Host work on ``grid_thw`` happens outside ``encoder_cudagraph_forward``, which is captured
      and may not call ``.item()`` or ``.tolist()``.
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

    def get_encoder_cudagraph_item_specs(self, inputs: Mapping[str, torch.Tensor]
                                         ) -> list[EncoderItemSpec]:
        """One spec per item of ``inputs``, in the caller's order. Runs on the host."""
        ...

    def get_encoder_cudagraph_budget_range(self) -> tuple[int, int]:
        """``(min_budget, max_budget)`` in output tokens: the smallest and largest sensible graph."""
        ...

    def prepare_encoder_cudagraph_capture_inputs(
        self, budget: int, max_batch_size: int, max_frames_per_batch: int | None,
        device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Dummy inputs for capturing ``budget``'s graph (``max_batch_size`` slots, sized with
        :func:`~vit_graph_backend.budgets.capture_layout`); they become its static buffers."""
        ...

    def prepare_encoder_cudagraph_replay_buffers(
        self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int], budget: int
    ) -> Mapping[str, torch.Tensor]:
        """Values for the static buffers that run ``item_indices`` in ``budget``'s graph, padding
        included (module docstring's layout contract): a dict or :class:`StampedBuffers`."""
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
    """Replay buffers, some of which are a pure function of ``stamp`` (any object standing for
    the loaded values).

    The mapping holds the ``varying`` buffers, written every call; ``load()`` returns the others
    (same rules as any replay buffer, the same keys every time) and is called only when the
    budget's static buffers were not last filled from this ``stamp`` (by identity; the runtime
    keeps a reference, so its ``id`` is not reused). Give a new stamp whenever the loaded values
    could differ."""

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
