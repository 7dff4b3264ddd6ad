"""Tiny random vision towers of every packed family the adapters serve (float32, CPU), by family
name as transformers names its model folder: the six Qwen towers of ``qwen_towers`` and the
families served on the same body (``adapters/qwen_families.py``, ``adapters/glm_families.py``).
Each entry: ``(build, patch, max_frames)``: the most temporal patches of a drawn video."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from qwen_towers import FAMILIES as QWEN, PATCH  # noqa: E402


def _hf(family: str, config: str, model: str, **fields):
    def build() -> torch.nn.Module:
        cfg_mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return getattr(mod, model)(getattr(cfg_mod, config)(**fields))
    return build


_QWEN25 = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
               patch_size=PATCH, window_size=4 * PATCH, fullatt_block_indexes=[1])
_QWEN3 = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
              patch_size=PATCH, num_position_embeddings=16)
_GLM = dict(depth=2, hidden_size=64, num_heads=4, out_hidden_size=48, intermediate_size=96,
            image_size=8 * PATCH, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2)

#: family -> (build, patch, max_frames)
FAMILIES = {name: (build, PATCH, 2) for name, build in QWEN.items()}
FAMILIES.update({
    "qwen2_5_omni": (_hf("qwen2_5_omni", "Qwen2_5OmniVisionEncoderConfig",
                         "Qwen2_5OmniVisionEncoder", **_QWEN25), PATCH, 2),
    "exaone4_5": (_hf("exaone4_5", "Exaone4_5_VisionConfig", "Exaone4_5_VisionModel",
                      **dict(_QWEN25, hidden_size=64, num_heads=4, num_key_value_heads=2)),
                  PATCH, 2),
    "qwen3_omni_moe": (_hf("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoderConfig",
                           "Qwen3OmniMoeVisionEncoder", **_QWEN3,
                           deepstack_visual_indexes=[0, 2]), PATCH, 2),
    "cohere_compass": (_hf("cohere_compass", "CohereCompassVisionConfig",
                           "CohereCompassVisionModel", **_QWEN3,
                           deepstack_visual_indexes=[0, 2]), PATCH, 2),
    "qwen4_exp": (_hf("qwen4_exp", "Qwen4ExpVisionConfig", "Qwen4ExpVisionModel", **_QWEN3),
                  PATCH, 2),
    "ernie4_5_vl_moe": (_hf("ernie4_5_vl_moe", "Ernie4_5_VLMoeVisionConfig",
                            "Ernie4_5_VLMoeVisionTransformerPretrainedModel", depth=2,
                            hidden_size=64, num_heads=4, intermediate_size=128,
                            patch_size=PATCH), PATCH, 2),
    "glm4v": (_hf("glm4v", "Glm4vVisionConfig", "Glm4vVisionModel", **_GLM), PATCH, 2),
    "glm4v_moe": (_hf("glm4v_moe", "Glm4vMoeVisionConfig", "Glm4vMoeVisionModel", **_GLM),
                  PATCH, 2),
    "glm_ocr": (_hf("glm_ocr", "GlmOcrVisionConfig", "GlmOcrVisionModel", **_GLM), PATCH, 2),
    "glm_image": (_hf("glm_image", "GlmImageVisionConfig", "GlmImageVisionModel", depth=2,
                      hidden_size=64, num_heads=4, intermediate_size=96, image_size=8 * PATCH,
                      patch_size=PATCH), PATCH, 1),
    "glm5_next": (_hf("glm5_next", "Glm5NextVisionConfig", "Glm5NextVisionModel", **_GLM,
                      projection_intermediate_size=80, swiglu_limit=0.5), PATCH, 2),
})


def tower(name: str, seed: int = 0) -> torch.nn.Module:
    """Family ``name``'s tiny tower with random weights (std 0.3: clamps and norms matter)."""
    torch.manual_seed(seed)
    model = FAMILIES[name][0]()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1)
    return model.eval()
