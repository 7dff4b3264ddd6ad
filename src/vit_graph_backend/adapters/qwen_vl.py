"""The shared body of the adapters that serve HF Qwen-VL vision towers from budgeted CUDA graphs.

The adapter classes, one per tower, are in ``qwen_families.py``. Each adapter is a ``torch.nn.Module`` wrapping one tower (``adapter.tower``) and reusing its own
submodules and weights (patch embedding, blocks' norms/qkv/proj/MLP, rotary ``inv_freq``,
mergers), so ``.to()``, ``.eval()`` and loaded weights act on both. One exception, for speed:
when the MLP width is not a multiple of 8 (Qwen2.5-VL's 3420), the adapter runs the MLPs from
zero-padded copies of their weights on CUDA (``align_mlp``; see ``_aligned_mlp``), re-copied
before any call after the tower's MLP parameters change. Each
implements :class:`~vit_graph_backend.protocol.SupportsEncoderCudaGraph`, plus
``forward(pixel_values, grid_thw)`` and ``graph_unsupported_reason()``.

What the towers return in transformers 5.x, and what the adapters return:

- ``Qwen2VisionTransformerPretrainedModel`` and ``Qwen2_5_VisionTransformerPretrainedModel`` return
  ``BaseModelOutputWithPooling``: ``last_hidden_state`` holds the unmerged patch rows (for
  Qwen2.5-VL still in window order) and ``pooler_output`` the merged per-token features in the
  caller's order, which the language model consumes (``get_image_features`` splits it). The
  adapters return ``pooler_output``: a ``(tokens, out_hidden)`` tensor.
- ``Qwen3VLVisionModel`` (and Qwen3-VL-MoE's) returns ``BaseModelOutputWithDeepstackFeatures``;
  the adapter returns the tuple ``(pooler_output, *deepstack_features)``, every tensor
  ``(tokens, out_hidden)``. Qwen3.5's towers have no deepstack mergers: ``pooler_output`` only.

Inputs are a mapping with ``"pixel_values"`` (``(patches, C * temporal_patch * patch**2)``, as the
HF processor emits) and ``"grid_thw"`` (``(items, 3)``, or a list of ``[t, h, w]`` rows), checked
by ``_packed_inputs`` before anything else runs. Static buffers and how padding works: see
``_qwen_metadata``. Attention: ``_packed_attention``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _compat
from ..budgets import capture_layout, ceil_div
from ..errors import InvalidOptionError, UnsupportedGraphError
from ..specs import EncoderItemSpec, check_positive_int
from ._aligned_mlp import AlignedMLPs
from ._fused import Ops, fusion_available, ops
from ._qwen_ops import _add_norm, _is_rms_norm, _norm, _patch_embed, _signed_sin  # noqa: F401
from ._packed_attention import Segments, packed_attention, varlen_supported
from ._packed_inputs import PackedInputs, check_packed_inputs, grid_tensor
from ._qwen_metadata import (
    Grid,
    MetadataCache,
    PackedMetadata,
    QwenLayout,
    SegmentSlots,
    pack_metadata,
    segment_slots,
)

__all__ = ["DEFAULT_MAX_BUDGET", "MIN_BUDGET_IMAGE_SIDE"]

#: Default largest budget in output tokens (a 1792 x 1792 image at patch 14, merge 2).
DEFAULT_MAX_BUDGET = 4096
#: The smallest default budget is the token count of a square image of this side, in pixels.
MIN_BUDGET_IMAGE_SIDE = 224


class _QwenVisionAdapter(nn.Module):
    """Shared code of the three adapters; subclasses fill in the family hooks.

    Args:
        model: the HF vision tower.
        min_budget, max_budget: output tokens of the smallest and largest graph (default: a
            224 px square image, and 4096).
        align_mlp: run the MLPs from weight copies zero-padded to a multiple of 8 in width
            (same numbers, 2-3x faster GEMMs when the width is misaligned); ``None`` (default)
            does so on CUDA when the width needs it; ``True`` also on CPU; ``False`` never.
            ``aligned_mlp_bytes`` reports the copies' size (803 MiB for the 3B tower on an H100).
        fuse: inside captured graphs, run each block's elementwise work (rotary embedding,
            residual add + norm, gated activation) as Inductor-fused kernels compiled once per
            process (see ``_fused``; 37 % less GPU time per 1024-token graph of the 3B tower on
            an H100); ``None``
            (default) does so on CUDA with Triton installed; ``True`` also on CPU (Inductor's
            C++ code); ``False`` never. Eager calls always run the ops unfused.
    """

    #: fully qualified name of the wrapped class (checked at construction).
    wrapped_class: str = ""

    def __init__(self, model: nn.Module, *, min_budget: int | None = None,
                 max_budget: int | None = None, align_mlp: bool | None = None,
                 fuse: bool | None = None) -> None:
        super().__init__()
        names = {f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__}
        if self.wrapped_class not in names:
            raise InvalidOptionError(
                f"{type(self).__name__} wraps {self.wrapped_class}, got "
                f"{type(model).__module__}.{type(model).__qualname__}; use "
                "vit_graph_backend.adapters.adapt(model) to pick the adapter by class")
        self.tower = model
        self.training = model.training  # a new wrapper mirrors the tower (nn.Module says True)
        cfg = model.config
        self.merge = int(cfg.spatial_merge_size)
        self.patch_size = int(cfg.patch_size)
        self.patch_dim = int(cfg.in_channels) * int(cfg.temporal_patch_size) * self.patch_size ** 2
        self.layout = QwenLayout(self.merge, self._window_tokens())
        self._metadata_cache = MetadataCache(self.layout, self._item_extras)
        self._varlen = _compat.get_varlen_attn() if _compat.varlen_attention_available() else None
        self._captured_slots: dict[int, SegmentSlots] = {}
        side = max(1, MIN_BUDGET_IMAGE_SIDE // (self.patch_size * self.merge))
        low = side * side if min_budget is None else check_positive_int("min_budget", min_budget)
        high = (max(DEFAULT_MAX_BUDGET, low) if max_budget is None
                else check_positive_int("max_budget", max_budget))
        if low > high:
            raise InvalidOptionError(f"min_budget={low} is larger than max_budget={high}")
        self._budget_range = (low, high)
        if align_mlp is not None and not isinstance(align_mlp, bool):
            raise InvalidOptionError(
                f"align_mlp={align_mlp!r} is invalid: must be True, False or None (auto: pad on "
                "CUDA when the MLP width is not a multiple of 8)")
        self.align_mlp = align_mlp
        if fuse is not None and not isinstance(fuse, bool):
            raise InvalidOptionError(
                f"fuse={fuse!r} is invalid: must be True, False or None (auto: fuse on CUDA "
                "when Triton is installed)")
        self.fuse = fuse
        self._fusion_reason: dict[str, str | None] = {}
        mlps = [block.mlp for block in model.blocks]
        self._aligned = AlignedMLPs(mlps) if AlignedMLPs.needed(mlps) else None
        self._use_aligned = False

    # ------------------------------------------------------------------ family hooks
    def _window_tokens(self) -> int:
        return 0

    def _item_extras(self, grid: Grid) -> dict[str, torch.Tensor]:
        return {}

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _patch_embed(self.tower.patch_embed, values["pixel_values"])

    def _is_full_attention(self, layer: int) -> bool:
        return True

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        return self.tower.merger(hidden)

    def _collect(self, layer: int, hidden: torch.Tensor, features: list[torch.Tensor]) -> None:
        pass

    # ------------------------------------------------------------------ protocol
    def get_encoder_cudagraph_item_specs(self, inputs: Mapping[str, torch.Tensor]
                                         ) -> list[EncoderItemSpec]:
        """One spec per ``grid_thw`` row: ``(t*h*w, t*(h//m)*(w//m), t)``.

        Raises:
            InvalidInputError: (a ``ValueError``) for a bad ``grid_thw`` or ``pixel_values``,
                before the runtime plans the call (see ``_packed_inputs``).
        """
        m = self.merge
        grids = self._checked(inputs).grids
        return [EncoderItemSpec(t * h * w, t * (h // m) * (w // m), t) for t, h, w in grids]

    def get_encoder_cudagraph_budget_range(self) -> tuple[int, int]:
        """``(tokens of a 224 px square image, 4096)`` unless given to the constructor."""
        return self._budget_range

    def prepare_encoder_cudagraph_capture_inputs(
        self, budget: int, max_batch_size: int, max_frames_per_batch: int | None,
        device: torch.device, dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        """Static buffers of ``budget``'s graph: ``max_batch_size`` slots of
        ``ceil(budget / max_batch_size)`` tokens (one ``1 x m*tokens`` strip of patches per slot),
        and segment buffers for ``max_frames_per_batch`` frames (one per slot if ``None``)."""
        self._sync_mlp(device)
        layout = capture_layout(budget, max_batch_size, max_frames_per_batch)
        m = self.merge
        grids = [(1, m, m * layout.tokens_per_slot)] * layout.slots
        slots = segment_slots(self.layout, layout.capacity, layout.slots * layout.frames_per_slot)
        meta = self._pack(grids, range(len(grids)), slots)
        self._captured_slots[budget] = slots
        values = {key: value.to(device) for key, value in meta.values.items()}
        values["pixel_values"] = torch.zeros(meta.rows, self.patch_dim, device=device, dtype=dtype)
        return values

    def prepare_encoder_cudagraph_replay_buffers(
        self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int], budget: int,
    ) -> dict[str, torch.Tensor]:
        """The items' rows and metadata, back to back, unpadded: the runtime copies each buffer
        into the head of its static buffer and zeroes the tail (zero-length segments, zero
        pixels); the graph gives the padding rows their own segments."""
        meta, pixels = self._batch(inputs, item_indices)
        self._sync_mlp(pixels.device)
        if meta.tokens > budget:
            raise UnsupportedGraphError(
                f"items {list(item_indices)} have {meta.tokens} tokens, more than budget {budget}")
        slots = self._captured_slots.get(budget)
        if slots is not None:
            frames = meta.values["frame_seqlens"].numel()
            windows = meta.values["window_seqlens"].numel() if self.layout.window else 0
            if frames > slots.frames or windows > slots.windows:
                raise UnsupportedGraphError(
                    f"items {list(item_indices)} have {frames} frames and {windows} windows; "
                    f"budget {budget} was captured for {slots.frames} frames and "
                    f"{slots.windows} windows: set max_frames_per_batch so the planner caps the "
                    "frames of a batch (without it, capture assumes one frame per item)")
        values = {key: value.to(pixels.device) for key, value in meta.values.items()}
        values["pixel_values"] = pixels
        return values

    def encoder_cudagraph_forward(self, values: Mapping[str, torch.Tensor]) -> Any:
        """The captured computation over the static buffers (pure tensor code: every Python int
        comes from a static shape, ``max_seqlen`` is the buffer's row count)."""
        return self._run(values, None)

    def encoder_eager_forward(self, inputs: Mapping[str, torch.Tensor],
                              item_indices: Sequence[int]) -> Any:
        """``item_indices`` packed back to back without padding, exact segment lengths."""
        meta, pixels = self._batch(inputs, item_indices)
        self._sync_mlp(pixels.device)
        values = {key: value.to(pixels.device) for key, value in meta.values.items()}
        values["pixel_values"] = pixels
        return self._run(values, meta)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> Any:
        """The tower's packed output for all items (see the module docstring for which);
        ``grid_thw`` may also be a list of ``[t, h, w]`` rows."""
        inputs = {"pixel_values": pixel_values, "grid_thw": grid_tensor(grid_thw)}
        return self.encoder_eager_forward(inputs, range(len(self._checked(inputs).grids)))

    def graph_unsupported_reason(self) -> str | None:
        """Why this tower cannot be served from CUDA graphs right now, or ``None`` if it can."""
        if self.tower.training:
            return "the vision tower is in training mode; CUDA graphs serve eval() inference"
        param = next(self.tower.parameters())
        if param.device.type != "cuda":
            return None  # the runtime runs its CPU path without graphs
        if self._varlen is None:
            return (f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                    "(PyTorch 2.11+), which the packed graph needs on CUDA")
        head_dim = self.tower.blocks[0].attn.head_dim
        if not varlen_supported(param.dtype, head_dim):
            return (f"varlen flash attention needs float16/bfloat16 weights and head_dim a "
                    f"multiple of 8 up to 256; got {param.dtype} and head_dim={head_dim} "
                    "(a dense budget x budget mask would be used instead)")
        return None

    @property
    def aligned_mlp_bytes(self) -> int:
        """Bytes held by the zero-padded MLP weight copies (0 when not in use)."""
        return self._aligned.nbytes if self._aligned is not None and self._use_aligned else 0

    # ------------------------------------------------------------------ internals
    def _sync_mlp(self, device: torch.device) -> None:
        """Decide whether the padded MLP weights are used and bring them up to date; runs
        outside the graph before every capture, replay and eager batch (see _aligned_mlp)."""
        if self._aligned is None:
            return
        use = self.align_mlp if self.align_mlp is not None else torch.device(device).type == "cuda"
        self._use_aligned = use
        if use:
            self._aligned.refresh()

    def _mlp(self, fns: Ops, layer: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._use_aligned and self._aligned is not None:
            return self._aligned.forward(layer, x, fns.silu_mul)
        return block.mlp(x)

    def _fns(self, device: torch.device, graph: bool) -> Ops:
        """The compiled fused ops for the graph path where ``fuse`` allows, else plain ops."""
        # inside an inner compiler's trace, the compiler fuses the plain ops itself (and state
        # read here would become guards)
        if not graph or self.fuse is False or torch.compiler.is_compiling():
            return ops(False)
        if self.fuse is None:
            kind = torch.device(device).type
            if kind not in self._fusion_reason:
                self._fusion_reason[kind] = fusion_available(device)
            if self._fusion_reason[kind] is not None:
                return ops(False)
        return ops(True)

    @property
    def fusion_state(self) -> dict[str, Any]:
        """Whether graphs use fused kernels: ``fuse`` as given, the reason fusion is off per
        device type seen (``None``: on), and compile failures (functions then run unfused)."""
        return {"fuse": self.fuse, "unavailable": dict(self._fusion_reason),
                "compile_failures": ops(True).failures() if self.fuse is not False else {}}

    def _checked(self, inputs: Mapping[str, Any]) -> PackedInputs:
        # the one input check of specs, eager and replay (see _packed_inputs)
        return check_packed_inputs(inputs, merge=self.merge, patch_dim=self.patch_dim)

    def _pack(self, grids: Sequence[Grid], indices: Sequence[int],
              slots: SegmentSlots | None = None) -> PackedMetadata:
        starts, row = [], 0
        for t, h, w in grids:
            starts.append(row)
            row += t * h * w
        return pack_metadata([self._metadata_cache(grids[i]) for i in indices], self.layout,
                             [starts[i] for i in indices], slots)

    def _batch(self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int]
               ) -> tuple[PackedMetadata, torch.Tensor]:
        checked = self._checked(inputs)
        grids, pixels = checked.grids, checked.pixel_values
        meta = self._pack(grids, list(item_indices))
        index = meta.row_index
        if not self.layout.window and index.numel() and bool(
                (index == torch.arange(int(index[0]), int(index[0]) + index.numel())).all()):
            gathered = pixels.narrow(0, int(index[0]), index.numel())
        else:
            gathered = pixels.index_select(0, index.to(pixels.device))
        return meta, gathered

    def _segments(self, values: Mapping[str, torch.Tensor], meta: PackedMetadata | None
                  ) -> tuple[Segments, Segments | None]:
        """Offsets for full and window attention. The padding rows after the real ones form
        one segment (full attention) or window-sized chunks (window attention, so that the
        window ``max_seqlen`` stays one window), computed from the static row count."""
        rows = values["pixel_values"].shape[0]
        lengths = values["frame_seqlens"].cumsum(0, dtype=torch.int32)
        # the padding segment ends at the static row count; built with a tensor op, not
        # F.pad(value=rows), which would specialize a symbolic row count (one trace per budget)
        end = torch.full((1,), rows, dtype=lengths.dtype, device=lengths.device)
        full_offsets = torch.cat([F.pad(lengths, (1, 0)), end])
        if meta is not None:
            full = Segments(full_offsets, max(meta.max_frame_rows, 1), meta.frame_offsets)
        else:
            full = Segments(full_offsets, rows)
        if not self.layout.window:
            return full, None
        wins = F.pad(values["window_seqlens"].cumsum(0, dtype=torch.int32), (1, 0))
        if meta is not None:
            return full, Segments(wins, max(meta.max_window_rows, 1), meta.window_offsets)
        chunk = self.layout.window_rows
        # ceil(rows / chunk) + 1 chunk ends (the surplus ones clamp to rows: zero-length
        # segments). The +1 keeps the count >= 2 for every budget: with a symbolic row count,
        # Dynamo guards elementwise ops on whether such a size is 1, and a count that is 1 for
        # the smallest budget only would cost a second trace.
        steps = torch.arange(1, ceil_div(rows, chunk) + 2, device=wins.device, dtype=torch.int32)
        pad_offsets = torch.clamp(wins[-1] + chunk * steps, max=rows)
        # max_seqlen: one window's rows (an upper bound even when the buffer is shorter; a
        # Python min() with the row count would make Dynamo specialize on the comparison)
        return full, Segments(torch.cat([wins, pad_offsets]), chunk)

    def _attention(self, fns: Ops, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        rows = x.shape[0]
        qkv = attn.qkv(x).reshape(rows, 3, attn.num_heads, -1)
        # q and k rotated together: half the launches of rotating them one by one
        q, k = fns.rotate_qk(qkv, cos.unsqueeze(1), sin.unsqueeze(1))
        v = qkv[:, 2]
        out = packed_attention(q, k, v, segments, attn.scaling, self._varlen)
        return attn.proj(out.reshape(rows, -1))

    def _run(self, values: Mapping[str, torch.Tensor], meta: PackedMetadata | None) -> Any:
        hidden = self._embed(values)
        fns = self._fns(hidden.device, graph=meta is None)
        cos, sin = self.tower.rotary_pos_emb(hidden, values["position_ids"])
        cos, sin = cos.unsqueeze(-2).float(), _signed_sin(sin.unsqueeze(-2).float())
        full, window = self._segments(values, meta)
        features: list[torch.Tensor] = []
        blocks = list(self.tower.blocks)
        # each residual add is fused with the norm that reads its result (the next block's norm1
        # after an MLP), so hidden and its normed copy come out of one kernel
        normed = _norm(blocks[0].norm1, hidden) if blocks else hidden
        for layer, block in enumerate(blocks):
            segments = full if window is None or self._is_full_attention(layer) else window
            update = self._attention(fns, block.attn, normed, cos, sin, segments)
            hidden, normed = _add_norm(fns, block.norm2, hidden, update)
            after = blocks[layer + 1].norm1 if layer + 1 < len(blocks) else None
            hidden, normed = _add_norm(fns, after, hidden, self._mlp(fns, layer, block, normed))
            self._collect(layer, hidden, features)
        return self._head(hidden, values, features)
