"""Tiny packed Qwen-VL towers on CUDA in bf16 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and the helpers the
packed GPU tests share: random calls, HF's own outputs, the worst error of a served tower against
HF's over a stream of calls (``tests/gpu/test_packed*_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

#: every packed test builds HF towers
pytest.importorskip("transformers")

DEV, DT = "cuda", torch.bfloat16
PATCH, MERGE = 14, 2
PATCH_DIM = 3 * 2 * PATCH * PATCH


def _tower(kind):
    torch.manual_seed(0)
    if kind == "qwen2":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as M)
        cfg = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=96, num_heads=2, mlp_ratio=2)
    elif kind == "qwen2_5":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as M)
        # intermediate 122 is not a multiple of 8 (like the 3B tower's 3420): the adapter's
        # padded MLP copies are in use on CUDA
        cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=64, intermediate_size=122, num_heads=2,
                                     out_hidden_size=96, window_size=112,
                                     fullatt_block_indexes=[1, 3])
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as M
        cfg = Qwen3VLVisionConfig(depth=3, hidden_size=64, intermediate_size=120, num_heads=2,
                                  out_hidden_size=96, patch_size=16, num_position_embeddings=256,
                                  deepstack_visual_indexes=[0, 2])
    return M(cfg).to(DEV, DT).eval()


def _call(rng, n_images, patch):
    grids = [[1, 2 * rng.randint(4, 16), 2 * rng.randint(4, 16)] for _ in range(n_images)]
    rows = sum(t * h * w for t, h, w in grids)
    dim = 3 * 2 * patch * patch
    return (torch.randn(rows, dim, device=DEV, dtype=DT),
            torch.tensor(grids, device=DEV, dtype=torch.long))


def _hf(tower, pv, grid):
    out = tower(pv, grid)
    return (out.pooler_output, *(getattr(out, "deepstack_features", None) or ()))


def _worst_error_vs_hf(served, tower, rng, calls, images, patch):
    """Max over ``calls`` calls of ``images(rng)`` images each of every output's max abs error
    against HF's, relative to HF's max abs value (at least 1); every output finite."""
    worst = 0.0
    for _ in range(calls):
        pv, grid = _call(rng, images(rng), patch)
        got = served(pv, grid)
        got = got if isinstance(got, tuple) else (got,)
        for g, r in zip(got, _hf(tower, pv, grid), strict=True):
            assert torch.isfinite(g).all()
            worst = max(worst, (g.float() - r.float()).abs().max().item()
                        / max(r.float().abs().max().item(), 1.0))
    return worst
