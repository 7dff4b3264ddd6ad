"""Tensor helpers of the Qwen-VL adapters (``qwen_vl.py``): fused norms, the patch embedding as
a GEMM, and the signed sine of the rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._fused import Ops

__all__ = ["_add_norm", "_is_rms_norm", "_norm", "_patch_embed", "_signed_sin"]


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
    # HF's Qwen2RMSNorm as one fused kernel: F.rms_norm keeps float32 statistics for bf16/fp16
    # input, as HF does, and applies the weight before its one rounding to the input dtype
    # (HF rounds the normalized value, then multiplies by the weight in the input dtype: at most
    # one unit in the last place apart). HF's version costs five kernels and two float32 copies.
    if _is_rms_norm(norm):
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def _patch_embed(embed: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """HF's patch embedding (a Conv3d whose stride equals its kernel, over rows that each hold
    one whole kernel window) as the GEMM it is: ``pixels @ weight.flatten(1).T``. The same
    products and sums as the convolution in one cuBLAS call; on an H100 it took 0.5 ms off the
    3B tower's 1024-token graph (``benchmarks/qwen_floor.py``). Other patch embeddings run as
    they are."""
    proj = getattr(embed, "proj", None)
    if (isinstance(proj, nn.Conv3d) and tuple(proj.kernel_size) == tuple(proj.stride)
            and tuple(proj.padding) == (0, 0, 0) and tuple(proj.dilation) == (1, 1, 1)
            and proj.groups == 1 and pixels.dim() == 2
            and pixels.shape[1] == proj.weight[0].numel()):
        weight = proj.weight.flatten(1)
        return F.linear(pixels.to(weight.dtype), weight, proj.bias)
    return embed(pixels)
