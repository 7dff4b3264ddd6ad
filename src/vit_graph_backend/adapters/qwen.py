"""The shared body of the adapters that serve HF Qwen-VL vision towers from budgeted CUDA graphs.

The family classes are in ``qwen_families``; ``packing`` lays inputs out into graph buffers,
``kernel_choices`` decides the kernels, and this module's class runs the blocks and implements
:class:`~vit_graph_backend.protocol.SupportsEncoderCudaGraph` (plus ``forward(pixel_values,
grid_thw)`` and ``graph_unsupported_reason()``). An adapter wraps one tower (``adapter.tower``)
and reuses its submodules and weights, so ``.to()``, ``.eval()`` and loaded weights act on both;
the one exception is the zero-padded MLP weight copies (``aligned_mlp``).

Each family's output is in its class docstring. Inputs (``pixel_values``, ``grid_thw``) are
checked by ``inputs``; attention runs in ``kernels.packed_attention``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _compat
from ..budgets import packed_budget_range
from ..errors import InvalidOptionError
from ..options import VitGraphOptions
from ..specs import EncoderItemSpec
from ..runtime.weights import python_outside_graphs
from ..kernels.attention_choice import AttentionChoice
from ..kernels.fused_ops import Ops
from ..kernels.packed_attention import (Segments, dense_sdpa, packed_attention, varlen_supported,
                                        widen_for_dense)
from .inputs import grid_tensor
from .kernel_choices import KernelChoices
from .metadata import Grid, PackedMetadata, QwenLayout
from .packing import ROW_INDEX, QwenPacker

__all__: list[str] = []


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so that ``rotate_half(x) * sin`` (HF) equals
    ``roll(x, half) * signed_sin``: ``cat(-x2, x1) * cat(s1, s2) == cat(x2, x1) * cat(-s1, s2)``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _is_rms_norm(norm: nn.Module) -> bool:
    return (type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon")
            and isinstance(getattr(norm, "weight", None), torch.Tensor))


def _add_norm(fns: Ops, norm: nn.Module | None, hidden: torch.Tensor, update: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden + update`` and ``norm`` of it (``None`` when there is no next norm), as one
    fused kernel where ``fns`` is compiled and the norm is an RMSNorm or affine LayerNorm."""
    if norm is None:
        return hidden + update, None
    if _is_rms_norm(norm):
        return fns.add_rms_norm(hidden, update, norm.weight, norm.variance_epsilon)
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine:
        return fns.add_layer_norm(hidden, update, norm.weight, norm.bias, norm.eps)
    hidden = hidden + update
    return hidden, _norm(norm, hidden)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # HF's RMSNorm in one kernel; F.rms_norm rounds once after the weight (HF: before), <= 1 ulp
    if _is_rms_norm(norm):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def _patch_embed(embed: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """HF's patch embedding (a Conv3d, or GLM-Image's Conv2d, with stride == kernel over
    whole-window rows) as the GEMM it is, in one cuBLAS call; others run as they are."""
    proj = getattr(embed, "proj", None)
    if (isinstance(proj, (nn.Conv2d, nn.Conv3d)) and tuple(proj.kernel_size) == tuple(proj.stride)
            and not any(proj.padding) and set(proj.dilation) == {1}
            and proj.groups == 1 and pixels.dim() == 2
            and pixels.shape[1] == proj.weight[0].numel()):
        weight = proj.weight.flatten(1)
        return F.linear(pixels.to(weight.dtype), weight, proj.bias)
    return embed(pixels)


class _QwenVisionAdapter(nn.Module):
    """Shared code of the family adapters; subclasses fill in the family hooks.

    Args:
        model: the HF vision tower.
        options: the :class:`~vit_graph_backend.options.VitGraphOptions` it is served with;
            the adapter reads ``min_budget``/``max_budget`` (default: a 224 px square image to
            4096 tokens, 16384 for a tower without a merger), ``align_mlp``, ``fuse`` (graphs
            only), ``packed_attention``, ``epilogue_fusion`` and ``batch_invariant`` (no
            choice made by timing).

    Raises:
        InvalidOptionError: for a model of another class, or ``min_budget > max_budget``.
    """

    #: fully qualified names of the classes it wraps (checked at construction): towers of the
    #: same math under other names share one adapter
    wrapped_class: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, options: VitGraphOptions | None = None) -> None:
        super().__init__()
        names = {f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__}
        if names.isdisjoint(self.wrapped_class):
            raise InvalidOptionError(
                f"{type(self).__name__} wraps {' or '.join(self.wrapped_class)}, got "
                f"{type(model).__module__}.{type(model).__qualname__}; use "
                "vit_graph_backend.adapters.adapt(model) to pick the adapter by class")
        self.tower = model
        self.training = model.training  # a new wrapper mirrors the tower (nn.Module says True)
        cfg = model.config
        self.merge = int(cfg.spatial_merge_size)
        self.patch_size = int(cfg.patch_size)
        # towers without a temporal patch (ERNIE-4.5-VL) embed one frame a row
        temporal = int(getattr(cfg, "temporal_patch_size", None) or 1)
        self.patch_dim = int(cfg.in_channels) * temporal * self.patch_size ** 2
        self.layout = QwenLayout(self.merge, self._window_tokens())
        self.packer = QwenPacker(self.layout, self.patch_dim, self._item_extras)
        options = options if options is not None else VitGraphOptions()
        invariant = options.batch_invariant  # nothing chosen by timing
        self.kernels = KernelChoices(model, options.align_mlp, options.fuse,
                                     "off" if invariant else options.epilogue_fusion)
        #: (hook registrations seen, why the tower's own forward must run) (``runtime.weights``)
        self._outside: tuple[int, str | None] = (-1, None)
        self._varlen = _compat.get_varlen_attn()
        self.attention = AttentionChoice("varlen" if invariant else options.packed_attention)
        #: where the static buffers were last made (``None``: no graph reads the MLP copies)
        self._device: torch.device | None = None
        low, high = packed_budget_range(self.patch_size, self.merge)
        low = low if options.min_budget is None else options.min_budget
        high = max(high, low) if options.max_budget is None else options.max_budget
        if low > high:
            raise InvalidOptionError(f"min_budget={low} is larger than max_budget={high}")
        self._budget_range = (low, high)

    # ------------------------------------------------------------------ family hooks
    def _window_tokens(self) -> int:
        return 0

    def _item_extras(self, grid: Grid) -> dict[str, torch.Tensor]:
        return {}

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _patch_embed(self.tower.patch_embed, values["pixel_values"])

    def _is_full_attention(self, layer: int) -> bool:
        return True

    def _qkv(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Queries, keys and values of ``x`` as ``(rows, 3, heads, head_dim)``."""
        return attn.qkv(x).reshape(x.shape[0], 3, attn.num_heads, -1)

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        return self.tower.merger(hidden)

    def _collect(self, layer: int, hidden: torch.Tensor, features: list[torch.Tensor]) -> None:
        pass

    def _from_tower(self, out: Any) -> Any:
        """This adapter's output from the output of the tower's own forward."""
        return out.pooler_output

    # ------------------------------------------------------------------ protocol
    def get_encoder_cudagraph_item_specs(self, inputs: Mapping[str, torch.Tensor]
                                         ) -> list[EncoderItemSpec]:
        """One spec per ``grid_thw`` row: ``(t*h*w, t*(h//m)*(w//m), t)``. Raises
        ``InvalidInputError`` (a ``ValueError``) for a bad ``grid_thw`` or ``pixel_values``."""
        return self.packer.item_specs(inputs)

    def get_encoder_cudagraph_budget_range(self) -> tuple[int, int]:
        """``budgets.packed_budget_range`` of the tower's patch and merge unless given to the
        constructor."""
        return self._budget_range

    def prepare_encoder_cudagraph_capture_inputs(
        self, budget: int, max_batch_size: int, max_frames_per_batch: int | None,
        device: torch.device, dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        """Static buffers of ``budget``'s graph (see :meth:`QwenPacker.capture_values`)."""
        self._device = torch.device(device)
        self.kernels.sync(device, capture=True)
        values = self.packer.capture_values(budget, max_batch_size, max_frames_per_batch, device,
                                            dtype)
        attn = self.tower.blocks[0].attn
        slots = self.packer.captured_slots[budget]
        windows = (self.layout.window_rows, slots.windows) if self.layout.window else None
        self.attention.prepare(
            values["pixel_values"].shape[0], attn.num_heads, attn.head_dim, attn.scaling,
            one_segment=slots.frames == 1, device=device, dtype=values["pixel_values"].dtype,
            varlen=self._varlen, windows=windows, frames=slots.frames)
        return values

    def prepare_encoder_cudagraph_replay_buffers(
        self, inputs: Mapping[str, torch.Tensor], item_indices: Sequence[int], budget: int,
    ) -> dict[str, torch.Tensor]:
        """The items' rows and metadata, back to back, unpadded (the runtime zeroes the tail)."""
        return self.packer.replay_values(inputs, item_indices, budget)

    def refresh_encoder_cudagraph_weights(self) -> bool:
        """Bring the padded MLP copies up to date with in-place writes; True if one was copied
        (the runtime then replays again). Called after a call's first launch."""
        return self._device is not None and self.kernels.sync(self._device, replay=True)

    def refresh(self) -> None:
        """Make the kernel choices again for the tower as it is now (``served.refresh()``)."""
        kernels = self.kernels
        self.kernels = KernelChoices(self.tower, kernels.align_mlp, kernels.fuse,
                                     kernels.epilogue_fusion)
        self._outside = (-1, None)

    def encoder_cudagraph_forward(self, values: Mapping[str, torch.Tensor]) -> Any:
        """The captured computation over the static buffers (pure tensor code)."""
        return self._run(values, None)

    def encoder_eager_forward(self, inputs: Mapping[str, torch.Tensor],
                              item_indices: Sequence[int]) -> Any:
        """``item_indices`` packed back to back with exact segment lengths; through the tower's
        own forward while hooks or patched forwards inside it would be skipped by the adapter."""
        made = _compat.hook_handles_made()
        if self._outside[0] != made:
            self._outside = (made, python_outside_graphs(self.tower))
        if self._outside[1] is not None:
            pixels, grids = self.packer.rows(inputs, item_indices)
            grid = torch.tensor(grids, dtype=torch.int64, device=pixels.device)
            return self.encoder_reference_forward({"pixel_values": pixels, "grid_thw": grid})
        values, meta = self.packer.eager_values(inputs, item_indices)
        self.kernels.sync(values["pixel_values"].device)
        return self._run(values, meta)

    def encoder_reference_forward(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The tower's own forward on ``inputs``, in this adapter's output layout (the reference
        of ``vit_graph_backend.testing.check_adapter``)."""
        # the class's forward: served in place (integrations.hf), the instance's is ours
        out = type(self.tower).forward(self.tower, inputs["pixel_values"],
                                       grid_thw=inputs["grid_thw"])
        return self._from_tower(out)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> Any:
        """The tower's packed output for all items; ``grid_thw`` may be a list of rows."""
        inputs = {"pixel_values": pixel_values, "grid_thw": grid_tensor(grid_thw)}
        return self.encoder_eager_forward(inputs, range(len(self.packer.check(inputs).grids)))

    def graph_unsupported_reason(self) -> str | None:
        """Why this tower cannot be served from CUDA graphs right now, or ``None`` if it can."""
        if self.tower.training:
            return "the vision tower is in training mode; CUDA graphs serve eval() inference"
        param = next(self.tower.parameters())
        if param.device.type != "cuda":
            return None  # the runtime runs its CPU path without graphs
        head_dim = self.tower.blocks[0].attn.head_dim
        if not varlen_supported(param.dtype, head_dim):
            return (f"varlen flash attention needs float16/bfloat16 weights and head_dim a "
                    f"multiple of 8 up to 256; got {param.dtype} and head_dim={head_dim} "
                    "(a dense budget x budget mask would be used instead)")
        return None

    # ------------------------------------------------------------------ settings, as given
    @property
    def align_mlp(self) -> bool | None:
        """The ``align_mlp`` setting (see :class:`KernelChoices`)."""
        return self.kernels.align_mlp

    @property
    def fuse(self) -> bool | None:
        """The ``fuse`` setting (see :class:`KernelChoices`)."""
        return self.kernels.fuse

    @property
    def aligned_mlp_bytes(self) -> int:
        """Bytes held by the zero-padded MLP weight copies (0 when not in use)."""
        return self.kernels.aligned_bytes

    @property
    def staged_metadata_bytes(self) -> int:
        """GPU bytes held by the recent batches' metadata records (``packing``, <= 64 MiB)."""
        return self.packer.staged_bytes

    @property
    def attention_state(self) -> dict[str, Any]:
        """The ``packed_attention`` setting and the kernels chosen per captured budget: full
        attention (``"segments"``, ``"by_rows"``, ``"full"``) and window layers
        (``"windows"``), with the timings ``"auto"`` measured. Under
        ``inner_compiler="inductor"`` graphs always run flash varlen, whatever is recorded."""
        return self.attention.state

    @property
    def fusion_state(self) -> dict[str, Any]:
        """``fuse`` as given, why fusion is off per device type, and compile failures."""
        return self.kernels.state

    # ------------------------------------------------------------------ the blocks
    def _attention(self, fns: Ops, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, segments: Segments, full: bool) -> torch.Tensor:
        rows = x.shape[0]
        qkv = self._qkv(attn, x)
        # cos is None: a tower without rotary embedding (GLM-Image)
        if segments.dense and cos is None:
            wide = widen_for_dense(qkv[:, 0], qkv[:, 1], qkv[:, 2], segments.offsets[1:2])
            out = dense_sdpa(wide, qkv.shape[-1], attn.scaling)
        elif segments.dense:  # the rotary embedding and the widening in one fused kernel
            wide = fns.rotate_qk_wide(qkv, cos.unsqueeze(1), sin.unsqueeze(1),
                                      segments.offsets[1:2])
            out = dense_sdpa(wide, qkv.shape[-1], attn.scaling)
        else:  # rotary: q and k rotated together, half the launches of one by one
            q, k = ((qkv[:, 0], qkv[:, 1]) if cos is None
                    else fns.rotate_qk(qkv, cos.unsqueeze(1), sin.unsqueeze(1)))
            # the kernel chosen for this budget (kernels.attention_choice)
            kernel = (self.attention.graph_kernel(rows) if full
                      else self.attention.window_kernel(rows))
            out = packed_attention(q, k, qkv[:, 2], segments, attn.scaling, self._varlen, kernel)
        return attn.proj(out.reshape(rows, -1))

    def _run(self, values: Mapping[str, torch.Tensor], meta: PackedMetadata | None) -> Any:
        if meta is None and ROW_INDEX in values:  # a graph's rows, given in caller order
            values = {**values,
                      "pixel_values": values["pixel_values"].index_select(0, values[ROW_INDEX])}
        hidden = self._embed(values)
        fns = self.kernels.ops_for(hidden.device, graph=meta is None)
        cos = sin = None
        if getattr(self.tower, "rotary_pos_emb", None) is not None:
            cos, sin = self.tower.rotary_pos_emb(hidden, values["position_ids"])
            cos, sin = cos.unsqueeze(-2).float(), _signed_sin(sin.unsqueeze(-2).float())
        full, window = self.packer.segments(values, meta)
        if meta is None and self.attention.dense(hidden.shape[0]):  # chosen at this capture
            full = dataclasses.replace(full, dense=True)
        features: list[torch.Tensor] = []
        blocks = list(self.tower.blocks)
        # each residual add is fused with the norm that reads its result
        normed = _norm(blocks[0].norm1, hidden) if blocks else hidden
        for layer, block in enumerate(blocks):
            is_full = window is None or self._is_full_attention(layer)
            update = self._attention(fns, block.attn, normed, cos, sin,
                                     full if is_full else window, is_full)
            hidden, normed = _add_norm(fns, block.norm2, hidden, update)
            after = blocks[layer + 1].norm1 if layer + 1 < len(blocks) else None
            update = self.kernels.mlp(fns, layer, block, normed)
            hidden, normed = _add_norm(fns, after, hidden, update)
            self._collect(layer, hidden, features)
        return self._head(hidden, values, features)
