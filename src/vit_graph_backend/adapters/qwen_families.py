"""The Qwen-VL family adapters: one class per tower math, over ``qwen._QwenVisionAdapter``.

Each names the HF tower classes it wraps and overrides only what its towers do differently.
Towers of the same math under other class names (MoE variants, Omni thinkers, Cohere Compass,
Qwen4-Exp) share an adapter; the registry (``adapters/__init__``) maps every name to one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidOptionError
from .metadata import Grid
from .qwen import _norm, _patch_embed, _QwenVisionAdapter

__all__ = ["Ernie4_5_VLVisionAdapter", "Exaone4_5_VisionAdapter", "Qwen2VLVisionAdapter",
           "Qwen2_5OmniVisionAdapter", "Qwen2_5_VLVisionAdapter", "Qwen3VLMoeVisionAdapter",
           "Qwen3VLVisionAdapter", "Qwen3_5MoeVisionAdapter", "Qwen3_5VisionAdapter"]

_HF = "transformers.models."


class Qwen2VLVisionAdapter(_QwenVisionAdapter):
    """Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel``: full attention per frame. Output: the
    merged tokens (HF's ``pooler_output``), ``(tokens, hidden_size)``."""

    wrapped_class = (_HF + "qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel",)


class Qwen2_5_VLVisionAdapter(_QwenVisionAdapter):
    """Qwen2.5-VL's ``Qwen2_5_VisionTransformerPretrainedModel``: window attention, with full
    attention per frame in ``fullatt_block_indexes``. Rows run in window order (gathered so on the
    host); ``reverse_index`` puts the merged tokens back in the caller's order in the graph.
    Output: HF's ``pooler_output``, ``(tokens, out_hidden_size)``."""

    wrapped_class = (_HF + "qwen2_5_vl.modeling_qwen2_5_vl."
                     "Qwen2_5_VisionTransformerPretrainedModel",)

    def _window_tokens(self) -> int:
        cfg = self.tower.config
        window = int(cfg.window_size) // self.merge // self.patch_size
        if window < 1:
            raise InvalidOptionError(
                f"window_size={cfg.window_size} is smaller than one merged patch "
                f"({self.merge * self.patch_size} px); the tower cannot run")
        return window

    def _is_full_attention(self, layer: int) -> bool:
        return layer in self.tower.fullatt_block_indexes

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        merged = self.tower.merger(hidden)
        tokens = merged.shape[0]
        # real tokens back to the caller's order; padding maps to itself
        real = (values["frame_seqlens"].sum() // self.layout.unit).to(torch.int64)
        position = torch.arange(tokens, device=merged.device)
        index = torch.where(position < real, values["reverse_index"], position)
        return merged.index_select(0, index)


class Qwen3VLVisionAdapter(_QwenVisionAdapter):
    """Qwen3-VL's ``Qwen3VLVisionModel``: full attention per frame, an interpolated learned
    position embedding, and deepstack mergers after ``deepstack_visual_indexes``. Output:
    ``(merged, *deepstack_features)`` (HF's ``pooler_output`` and ``deepstack_features``), each
    ``(tokens, out_hidden_size)``."""

    wrapped_class = (_HF + "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel",
                     _HF + "cohere_compass.modeling_cohere_compass.CohereCompassVisionModel")

    def _item_extras(self, grid: Grid) -> dict[str, torch.Tensor]:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        tower = self.tower
        indices, weights = get_vision_interpolation_indices_and_weights(
            torch.tensor([grid]), num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode, align_corners=tower.interpolation_align_corners,
            spatial_merge_size=self.merge)
        return {"interp_indices": indices, "interp_weights": weights}

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        hidden = _patch_embed(self.tower.patch_embed, values["pixel_values"])
        taps = self.tower.pos_embed(values["interp_indices"])
        pos = (taps * values["interp_weights"].unsqueeze(-1)).sum(1)
        return hidden + pos.to(hidden.dtype)

    def _collect(self, layer: int, hidden: torch.Tensor, features: list[torch.Tensor]) -> None:
        indexes = list(self.tower.deepstack_visual_indexes)
        if layer in indexes:
            features.append(self.tower.deepstack_merger_list[indexes.index(layer)](hidden))

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        return (self.tower.merger(hidden), *features)

    def _from_tower(self, out: Any) -> Any:
        return (out.pooler_output, *out.deepstack_features)


class Qwen3VLMoeVisionAdapter(Qwen3VLVisionAdapter):
    """Qwen3-VL-MoE's ``Qwen3VLMoeVisionModel`` and Qwen3-Omni-MoE's ``Qwen3OmniMoeVisionEncoder``
    (its deepstack mergers renamed, ``deepstack_merger_list`` kept as a property): Qwen3-VL's tower
    under other class names."""

    wrapped_class = (_HF + "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel",
                     _HF + "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder")


class Qwen3_5VisionAdapter(Qwen3VLVisionAdapter):
    """Qwen3.5's ``Qwen3_5VisionModel``: Qwen3-VL's tower without deepstack mergers. Output: the
    merged tokens (HF's ``pooler_output``), ``(tokens, out_hidden_size)``."""

    wrapped_class = (_HF + "qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel",)

    # no deepstack: the shared body's collection, head and output
    _collect = _QwenVisionAdapter._collect
    _head = _QwenVisionAdapter._head
    _from_tower = _QwenVisionAdapter._from_tower


class Qwen3_5MoeVisionAdapter(Qwen3_5VisionAdapter):
    """Qwen3.5-MoE's ``Qwen3_5MoeVisionModel`` and Qwen4-Exp's ``Qwen4ExpVisionModel``: Qwen3.5's
    tower under other class names."""

    wrapped_class = (_HF + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel",
                     _HF + "qwen4_exp.modeling_qwen4_exp.Qwen4ExpVisionModel")


class Qwen2_5OmniVisionAdapter(Qwen2_5_VLVisionAdapter):
    """Qwen2.5-Omni's ``Qwen2_5OmniVisionEncoder``: Qwen2.5-VL's tower with separate ``q``, ``k``
    and ``v`` projections."""

    wrapped_class = (_HF + "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder",)

    def _qkv(self, attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.stack((attn.q(x), attn.k(x), attn.v(x)), 1)
        return qkv.view(x.shape[0], 3, attn.num_heads, -1)


class Exaone4_5_VisionAdapter(Qwen2_5_VLVisionAdapter):
    """EXAONE-4.5's ``Exaone4_5_VisionModel``: Qwen2.5-VL's tower with grouped-query attention
    (each key and value head repeated over its group of query heads, as HF's ``repeat_kv``)."""

    wrapped_class = (_HF + "exaone4_5.modeling_exaone4_5.Exaone4_5_VisionModel",)

    def _qkv(self, attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape[0], attn.head_dim
        q, k, v = attn.qkv(x).split([attn.q_dim, attn.kv_dim, attn.kv_dim], -1)
        groups = attn.num_key_value_groups
        k = k.view(rows, -1, dim).repeat_interleave(groups, 1)
        v = v.view(rows, -1, dim).repeat_interleave(groups, 1)
        return torch.stack((q.view(rows, -1, dim), k, v), 1)


class Ernie4_5_VLVisionAdapter(_QwenVisionAdapter):
    """ERNIE-4.5-VL's tower: Qwen2-VL's blocks over one-frame rows (a linear patch embedding),
    a final LayerNorm, no merger; the model's resampler merges outside the tower. Output: the
    normed patches, each ``merge x merge`` block as one row ``(tokens, m*m*hidden)`` (the
    resampler's own first view); HF's ``last_hidden_state`` is its ``(patches, hidden)`` view."""

    wrapped_class = (_HF + "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe."
                     "Ernie4_5_VLMoeVisionTransformerPretrainedModel",)

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        out = _norm(self.tower.ln, hidden)
        return out.view(-1, out.shape[-1] * self.merge ** 2)

    def _from_tower(self, out: Any) -> Any:
        hidden = out.last_hidden_state
        return hidden.view(-1, hidden.shape[-1] * self.merge ** 2)

    def hf_output_fields(self, out: torch.Tensor) -> dict[str, Any]:
        """HF's output as the model reads it (``integrations.hf``): the patches, unmerged."""
        return {"last_hidden_state": out.view(-1, out.shape[-1] // self.merge ** 2)}
