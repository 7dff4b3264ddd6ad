"""The Qwen-VL family adapters: one class per HF vision tower, over ``qwen._QwenVisionAdapter``.

Each names the tower class it wraps and overrides only what its tower does differently. The MoE
variants' towers differ from the dense ones only in class name and share their adapter body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InvalidOptionError
from .metadata import Grid
from .qwen import _patch_embed, _QwenVisionAdapter

__all__ = ["Qwen2VLVisionAdapter", "Qwen2_5_VLVisionAdapter", "Qwen3VLMoeVisionAdapter",
           "Qwen3VLVisionAdapter", "Qwen3_5MoeVisionAdapter", "Qwen3_5VisionAdapter"]


class Qwen2VLVisionAdapter(_QwenVisionAdapter):
    """Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel``: full attention per frame.

    Output: the merged tokens (HF's ``pooler_output``), ``(tokens, hidden_size)``.
    """

    wrapped_class = ("transformers.models.qwen2_vl.modeling_qwen2_vl."
                     "Qwen2VisionTransformerPretrainedModel")


class Qwen2_5_VLVisionAdapter(_QwenVisionAdapter):
    """Qwen2.5-VL's ``Qwen2_5_VisionTransformerPretrainedModel``: window attention, with full
    attention per frame in ``fullatt_block_indexes``.

    Rows run in window order (gathered so on the host); the merged tokens are put back in the
    caller's order by ``reverse_index`` in the graph. Output: HF's ``pooler_output``,
    ``(tokens, out_hidden_size)``.
    """

    wrapped_class = ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl."
                     "Qwen2_5_VisionTransformerPretrainedModel")

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
    position embedding, and deepstack mergers after ``deepstack_visual_indexes``.

    Output: ``(merged, *deepstack_features)`` (HF's ``pooler_output`` and
    ``deepstack_features``), each ``(tokens, out_hidden_size)``.
    """

    wrapped_class = "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"

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
    """Qwen3-VL-MoE's ``Qwen3VLMoeVisionModel``: Qwen3-VL's tower under another class name."""

    wrapped_class = ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe."
                     "Qwen3VLMoeVisionModel")


class Qwen3_5VisionAdapter(Qwen3VLVisionAdapter):
    """Qwen3.5's ``Qwen3_5VisionModel``: Qwen3-VL's tower without deepstack mergers.

    Output: the merged tokens (HF's ``pooler_output``), ``(tokens, out_hidden_size)``.
    """

    wrapped_class = "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel"

    def _collect(self, layer: int, hidden: torch.Tensor, features: list[torch.Tensor]) -> None:
        return None

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        return self.tower.merger(hidden)

    def _from_tower(self, out: Any) -> Any:
        return out.pooler_output


class Qwen3_5MoeVisionAdapter(Qwen3_5VisionAdapter):
    """Qwen3.5-MoE's ``Qwen3_5MoeVisionModel``: Qwen3.5's tower under another class name."""

    wrapped_class = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel"
