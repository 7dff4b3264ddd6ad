"""The GLM family adapters (GLM-4.1V/4.5V/4.6V, GLM-OCR, GLM-5.3, GLM-Image) over the Qwen body.

The GLM towers run Qwen2.5-VL's blocks (RMSNorm, fused ``qkv``, SiLU-gated MLP, 2-D rotary,
attention per frame) and end in a post-norm, a ``merge x merge`` convolution (run as the GEMM it
is) and a merger. GLM-4.1V adds an RMSNorm and a bicubic-resampled learned position embedding
after the patch embedding; GLM-OCR drops both and normalizes queries and keys per head; GLM-5.3
clamps its SiLU-gated MLPs, which the padded-MLP and fused kernels do not, so its MLPs run as the
tower's own modules. Their models send a video as one grid row per frame; the adapters take a
row of several frames too, attending per frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .metadata import Grid
from .qwen import _norm, _patch_embed, _QwenVisionAdapter

__all__ = ["Glm4vVisionAdapter", "Glm5NextVisionAdapter", "GlmImageVisionAdapter",
           "GlmOcrVisionAdapter"]

_HF = "transformers.models."


class Glm4vVisionAdapter(_QwenVisionAdapter):
    """GLM-4.1V's ``Glm4vVisionModel`` (also GLM-4.5V's ``Glm4vMoeVisionModel``; GLM-4.6V builds
    one of the two). Output: the merged tokens (HF's ``pooler_output``)."""

    wrapped_class = (_HF + "glm4v.modeling_glm4v.Glm4vVisionModel",
                     _HF + "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionModel")

    def _item_extras(self, grid: Grid) -> dict[str, torch.Tensor]:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        table = self.tower.embeddings.position_embedding
        indices, weights = get_vision_interpolation_indices_and_weights(
            torch.tensor([grid]), num_grid_per_side=int(table.num_embeddings ** 0.5),
            mode=self.tower.embeddings.interpolated_method, align_corners=False,
            spatial_merge_size=self.merge, padding="border")
        return {"interp_indices": indices, "interp_weights": weights}

    def encoder_reference_forward(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The tower's own forward, a video row given as one row per frame (as the GLM models
        call it: the tower's position table takes one frame a grid row)."""
        grid = inputs["grid_thw"]
        rows = torch.cat([torch.ones_like(grid[:, :1]), grid[:, 1:]], 1)
        return super().encoder_reference_forward(
            {**inputs, "grid_thw": rows.repeat_interleave(grid[:, 0], 0)})

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        tower = self.tower
        hidden = _norm(tower.post_conv_layernorm,
                       _patch_embed(tower.patch_embed, values["pixel_values"]))
        return hidden + self._table_positions(values).to(hidden.dtype)

    def _table_positions(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each row's learned position, resampled from the table (in float32, as HF does)."""
        table = self.tower.embeddings.position_embedding.weight.float()
        return F.embedding_bag(values["interp_indices"], table, mode="sum",
                               per_sample_weights=values["interp_weights"].float())

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        tower, m = self.tower, self.merge
        x = _norm(tower.post_layernorm, hidden)
        # the downsample convolution (kernel = stride = merge) over each merge block's rows
        blocks = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2).reshape(-1, x.shape[-1] * m * m)
        down = tower.downsample
        return tower.merger(F.linear(blocks, down.weight.flatten(1), down.bias))


class GlmImageVisionAdapter(Glm4vVisionAdapter):
    """GLM-Image's ``GlmImageVisionModel``: no rotary embedding, a bilinear learned position table
    added to the patch embedding, LayerNorm blocks and no head. Output: one row per patch
    (``merge`` is 1), which its model's VQ tokenizer reads."""

    wrapped_class = (_HF + "glm_image.modeling_glm_image.GlmImageVisionModel",)

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        hidden = _patch_embed(self.tower.patch_embed, values["pixel_values"])
        return hidden + self._table_positions(values).to(hidden.dtype)

    def _head(self, hidden: torch.Tensor, values: Mapping[str, torch.Tensor],
              features: list[torch.Tensor]) -> Any:
        return hidden


class GlmOcrVisionAdapter(Glm4vVisionAdapter):
    """GLM-OCR's ``GlmOcrVisionModel``: GLM-4.1V's head, no learned position embedding, queries
    and keys RMS-normalized per head before the rotary embedding."""

    wrapped_class = (_HF + "glm_ocr.modeling_glm_ocr.GlmOcrVisionModel",)

    def _item_extras(self, grid: Grid) -> dict[str, torch.Tensor]:
        return {}

    def _embed(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _patch_embed(self.tower.patch_embed, values["pixel_values"])

    def _qkv(self, attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        qkv = super()._qkv(attn, x)
        return torch.stack((_norm(attn.q_norm, qkv[:, 0]), _norm(attn.k_norm, qkv[:, 1]),
                            qkv[:, 2]), 1)


class Glm5NextVisionAdapter(GlmOcrVisionAdapter):
    """GLM-5.3's ``Glm5NextVisionModel``: GLM-OCR's tower with clamped SiLU-gated MLPs (run as the
    tower's own modules: ``kernel_choices`` leaves an MLP with a ``swiglu_limit`` alone)."""

    wrapped_class = (_HF + "glm5_next.modeling_glm5_next.Glm5NextVisionModel",)
