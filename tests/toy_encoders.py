"""A tiny packed encoder implementing ``SupportsEncoderCudaGraph``, for runtime tests, and a
wrapper tensor subclass to hold its weights in (``Wrapper``).

Each row goes through a linear layer, then gets the mean of its own item's rows added (a stand-in
for attention: rows of one item interact, rows of different items must not), then a second linear
layer. Padding rows get their own dummy segment, as the protocol's layout contract asks.
"""

from __future__ import annotations

import torch
from torch import nn

from vit_graph_backend import EncoderItemSpec, capture_layout


class ToyPackedEncoder(nn.Module):
    def __init__(self, dim: int = 16, budget_range: tuple[int, int] = (8, 64)) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.dim = dim
        self.budget_range = budget_range
        self.sync_in_forward = False  # set True to make capture fail (host sync)
        self.sync_above_rows: int | None = None  # host sync only for more rows than this

    # inputs: {"x": [total_rows, dim], "lengths": [n_0, n_1, ...]}
    def get_encoder_cudagraph_item_specs(self, inputs):
        return [EncoderItemSpec(n, n) for n in inputs["lengths"]]

    def get_encoder_cudagraph_budget_range(self):
        return self.budget_range

    def prepare_encoder_cudagraph_capture_inputs(self, budget, max_batch_size,
                                                 max_frames_per_batch, device, dtype):
        layout = capture_layout(budget, max_batch_size, max_frames_per_batch)
        seg = torch.arange(layout.capacity, device=device) // layout.tokens_per_slot
        return {
            "x": torch.zeros(layout.capacity, self.dim, device=device, dtype=dtype),
            "seg": seg,
            "slots": torch.zeros(max_batch_size + 1, device=device),
        }

    def prepare_encoder_cudagraph_replay_buffers(self, inputs, item_indices, budget):
        offsets = [0]
        for n in inputs["lengths"]:
            offsets.append(offsets[-1] + n)
        x = torch.cat([inputs["x"][offsets[i]:offsets[i + 1]] for i in item_indices])
        seg = torch.cat([torch.full((inputs["lengths"][i],), k, dtype=torch.long)
                         for k, i in enumerate(item_indices)])
        return {"x": x, "seg": seg}

    def encoder_cudagraph_forward(self, values):
        # values["seg"] of the capture buffer: rows past the copied ones keep their capture ids
        # unless the replay buffer covers them, so the replay path pads seg itself (below).
        return self._forward(values["x"], values["seg"], values["slots"].shape[0])

    def encoder_eager_forward(self, inputs, item_indices):
        values = ToyPackedEncoder.prepare_encoder_cudagraph_replay_buffers(self, inputs, item_indices, None)
        x, seg = values["x"], values["seg"].to(values["x"].device)
        return self._forward(x, seg, len(item_indices))

    def _forward(self, x, seg, num_segments):
        h = self.lin1(x)
        if self.sync_in_forward or (self.sync_above_rows is not None
                                    and x.shape[0] > self.sync_above_rows):
            h = h + float(h.sum().item()) * 0  # a host sync: illegal while capturing
        sums = h.new_zeros(num_segments, self.dim).index_add_(0, seg, h)
        counts = h.new_zeros(num_segments).index_add_(0, seg, torch.ones_like(h[:, 0]))
        mean = sums / counts.clamp(min=1).unsqueeze(1)
        return self.lin2(torch.relu(h + mean[seg]))

    def forward(self, x, lengths):
        return self.encoder_eager_forward({"x": x, "lengths": list(lengths)},
                                          list(range(len(lengths))))


class PaddedSegToyEncoder(ToyPackedEncoder):
    """The toy encoder with replay buffers padded to full size: padding rows get the dummy
    segment id ``max_batch_size`` (their own segment), never a real item's id."""

    def __init__(self, *args, max_batch_size: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_batch_size = max_batch_size

    def prepare_encoder_cudagraph_replay_buffers(self, inputs, item_indices, budget):
        values = super().prepare_encoder_cudagraph_replay_buffers(inputs, item_indices, budget)
        layout = capture_layout(budget, self.max_batch_size)
        pad = layout.capacity - values["seg"].shape[0]
        values["seg"] = torch.cat([values["seg"],
                                   torch.full((pad,), self.max_batch_size, dtype=torch.long)])
        return values


def run_alone(model, inputs):
    """Each item of a toy call through the plain model on its own: the eager reference."""
    out, start = [], 0
    for n in inputs["lengths"]:
        out.append(model(inputs["x"][start:start + n], [n]))
        start += n
    return out


def fill_static_floats_with_nan(manager) -> None:
    """Every floating static buffer of ``manager``'s captured budgets filled with NaN, as stale
    memory would leave them: a replay must write every one of them that its graph reads."""
    for entry in manager.graphs.entries.values():
        for t in entry.static.values():
            if t.is_floating_point():
                t.fill_(float("nan"))


def randomize_weights(model: nn.Module, seed: int) -> nn.Module:
    """Seeded weights with std 0.2, so outputs are O(10) and every path matters; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


class Wrapper(torch.Tensor):
    """A wrapper tensor subclass holding one tensor, as quantized weights (torchao's) and
    ``DTensor`` hold theirs: its own ``data_ptr()`` says nothing of where that tensor lives."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inners, ctx, size, stride) -> Wrapper:
        return Wrapper(inners["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter keeps the subclass
            return type(args[0])(args[0].inner.detach())
        unwrap = [a.inner if isinstance(a, Wrapper) else a for a in args]
        return func(*unwrap, **(kwargs or {}))


class Nested(Wrapper):
    """A wrapper holding a wrapper (a DTensor of quantized shards, say)."""

    @staticmethod
    def __tensor_unflatten__(inners, ctx, size, stride) -> Nested:
        return Nested(inners["inner"])
