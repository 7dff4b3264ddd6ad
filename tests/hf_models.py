"""Tiny random Hugging Face vision-language models and their prompts, for the ``serve_vision_``
tests on CPU (``tests/unit/integrations/test_hf_serve_vision.py``) and GPU (``tests/gpu/test_hf_gpu.py``).

Each prompt holds two images and one video of two temporal patches, laid out as the family's
processor lays them out (Qwen3-VL: one vision segment per temporal patch; GLM-V: every temporal
patch an image segment between begin/end-of-video tokens), with ``mm_token_type_ids`` where the
installed transformers asks for it. :data:`PACKED` holds the Qwen-VL families; :data:`PACKED_MORE`
the other packed towers (both tested on CPU and, through :data:`ALL_PACKED`, on the GPU): the Omni thinkers, EXAONE 4.5,
Cohere Compass, Qwen4-Exp, ERNIE-4.5-VL, the GLM-V family (GLM-4.1V, 4.5V, 4.6V and OCR: images
and the video in two prompts, see :data:`IMAGES_OR_VIDEO`), GLM-Image (an image-to-image prompt:
two source images, which its tower reads for the VQ tokenizer), ColQwen2 (documents of one image,
no ``generate``) and Cosmos3-Omni. :data:`TOWER_CLASS` names each family's tower.
"""

from __future__ import annotations

import functools
import inspect

import torch

IMG, VID, VS, VE = 290, 291, 292, 293
_TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_TOKENS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
               vision_end_token_id=VE)


def _rope(**extra):
    return {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, **extra}


def qwen2():
    import transformers as tr

    return tr.Qwen2VLForConditionalGeneration(tr.Qwen2VLConfig(
        text_config=dict(_TEXT, rope_parameters=_rope()),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=2), **_TOKENS))


def qwen2_5():
    import transformers as tr

    return tr.Qwen2_5_VLForConditionalGeneration(tr.Qwen2_5_VLConfig(
        text_config=dict(_TEXT, rope_parameters=_rope()),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, window_size=8,
                           fullatt_block_indexes=[1]), **_TOKENS))


def qwen3():
    import transformers as tr

    return tr.Qwen3VLForConditionalGeneration(tr.Qwen3VLConfig(
        text_config=dict(_TEXT, head_dim=16, rope_parameters=_rope(mrope_interleaved=True)),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 2]), **_TOKENS))


def qwen3_moe():
    import transformers as tr

    return tr.Qwen3VLMoeForConditionalGeneration(tr.Qwen3VLMoeConfig(
        text_config=dict(_TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32,
                         rope_parameters=_rope(mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[1]), **_TOKENS))


def qwen3_5():
    import transformers as tr

    return tr.Qwen3_5ForConditionalGeneration(tr.Qwen3_5Config(
        text_config=dict(_TEXT, head_dim=16, layer_types=["linear_attention", "full_attention"],
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         rope_parameters=_rope(mrope_interleaved=True,
                                               partial_rotary_factor=1.0)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, num_position_embeddings=16),
        **_TOKENS))


def qwen3_5_moe():
    import transformers as tr

    text = {k: v for k, v in _TEXT.items() if k != "intermediate_size"}
    return tr.Qwen3_5MoeForConditionalGeneration(tr.Qwen3_5MoeConfig(
        text_config=dict(text, head_dim=16, layer_types=["linear_attention", "full_attention"],
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32,
                         rope_parameters=_rope(mrope_interleaved=True,
                                               partial_rotary_factor=1.0)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, num_position_embeddings=16),
        **_TOKENS))


def llava():
    import transformers as tr

    return tr.LlavaForConditionalGeneration(tr.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=32,
                           patch_size=8),
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
        image_token_id=IMG, vision_feature_layer=-1, vision_feature_select_strategy="default"))


def idefics3():
    import transformers as tr

    return tr.Idefics3ForConditionalGeneration(tr.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
        image_token_id=IMG, scale_factor=2))


def gemma3():
    import transformers as tr

    return tr.Gemma3ForConditionalGeneration(tr.Gemma3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, sliding_window=16),
        mm_tokens_per_image=4, image_token_id=IMG, boi_token_index=VS, eoi_token_index=VE))


# ---- the other packed towers (PACKED_MORE): token ids beyond Qwen's, shared sub-configs --------

#: begin/end of an image and of a video (GLM-V's ``<|begin_of_image|>`` ..., ERNIE's start/end
#: tokens), and the Omni thinkers' audio placeholder and audio start (never in a prompt here)
BOI, EOI, BOV, EOV, AUDIO, AUDIO_START = 294, 295, 296, 297, 298, 299
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                     out_hidden_size=64, patch_size=2, num_position_embeddings=16)
_OMNI_AUDIO = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2,
                   encoder_ffn_dim=16, d_model=16, output_dim=64, n_window=4,
                   max_source_positions=16)
_OMNI_TOKENS = dict(vision_start_token_id=VS, vision_end_token_id=VE,
                    audio_start_token_id=AUDIO_START)
# patch 2 and a 4x4 learned position table (image_size // patch_size): GLM-4.1V resamples it
_GLM_VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                   out_hidden_size=64, patch_size=2, image_size=8)
_GLM_TOKENS = dict(image_token_id=IMG, video_token_id=VID, image_start_token_id=BOI,
                   image_end_token_id=EOI, video_start_token_id=BOV, video_end_token_id=EOV)


def qwen2_5_omni():
    """Qwen2.5-Omni's thinker (the talker and the token2wav model hold no vision tower)."""
    import transformers as tr

    return tr.Qwen2_5OmniThinkerForConditionalGeneration(tr.Qwen2_5OmniThinkerConfig(
        text_config=dict(_TEXT, rope_parameters=_rope()),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           out_hidden_size=64, patch_size=2, window_size=8,
                           fullatt_block_indexes=[1]),
        audio_config=_OMNI_AUDIO, image_token_index=IMG, video_token_index=VID,
        audio_token_index=AUDIO, **_OMNI_TOKENS))


def qwen3_omni_moe():
    """Qwen3-Omni-MoE's thinker."""
    import transformers as tr

    return tr.Qwen3OmniMoeThinkerForConditionalGeneration(tr.Qwen3OmniMoeThinkerConfig(
        text_config=dict(_TEXT, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32,
                         rope_parameters=_rope(mrope_interleaved=True)),
        vision_config=dict(_QWEN3_VISION, deepstack_visual_indexes=[0]),
        audio_config=dict(_OMNI_AUDIO, downsample_hidden_size=8, conv_chunksize=8,
                          n_window_infer=8),
        image_token_id=IMG, video_token_id=VID, audio_token_id=AUDIO, **_OMNI_TOKENS))


def exaone4_5():
    import transformers as tr

    # layer_types given: Exaone4Config derives them from sliding_window_pattern, which is 0
    # (a modulo by zero) when sliding_window is None
    return tr.Exaone4_5_ForConditionalGeneration(tr.Exaone4_5_Config(
        text_config=dict(_TEXT, model_type="exaone4",
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=4,
                           num_key_value_heads=2, out_hidden_size=64, patch_size=2,
                           window_size=8, fullatt_block_indexes=[1]),
        image_token_id=IMG, video_token_id=VID))


def cohere_compass():
    import transformers as tr

    # rope parameters per layer type; its mrope_section is (h, w, t), ERNIE's order
    return tr.CohereCompassForConditionalGeneration(tr.CohereCompassConfig(
        text_config=dict(_TEXT, rope_parameters={"full_attention": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}}),
        vision_config=dict(_QWEN3_VISION, deepstack_visual_indexes=[0]), **_TOKENS))


def qwen4_exp():
    import transformers as tr

    text = {k: v for k, v in _TEXT.items() if k != "intermediate_size"}
    return tr.Qwen4ExpForConditionalGeneration(tr.Qwen4ExpConfig(
        text_config=dict(text, head_dim=16,
                         layer_types=["linear_attention", "qwen_sparse_attention"],
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=8,
                         indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                         indexer_budget=16, indexer_compress_ratio=4,
                         rope_parameters=_rope(mrope_interleaved=True,
                                               partial_rotary_factor=1.0)),
        vision_config=_QWEN3_VISION, **_TOKENS))


def ernie4_5_vl_moe():
    """ERNIE-4.5-VL: the tower returns its patches; the model's resampler merges them."""
    import transformers as tr

    return tr.Ernie4_5_VLMoeForConditionalGeneration(tr.Ernie4_5_VLMoeConfig(
        text_config=dict(_TEXT, moe_intermediate_size=[32, 32], moe_k=2, moe_num_experts=4,
                         moe_num_shared_experts=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [3, 3, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=2),
        **_GLM_TOKENS))


def glm4v():
    import transformers as tr

    return tr.Glm4vForConditionalGeneration(tr.Glm4vConfig(
        text_config=dict(_TEXT, rope_parameters=_rope(partial_rotary_factor=1.0)),
        vision_config=_GLM_VISION, **_GLM_TOKENS))


def glm4v_moe():
    import transformers as tr

    return tr.Glm4vMoeForConditionalGeneration(tr.Glm4vMoeConfig(
        text_config=dict(_TEXT, moe_intermediate_size=32, num_experts_per_tok=2,
                         n_routed_experts=4, first_k_dense_replace=1,
                         rope_parameters=_rope(partial_rotary_factor=1.0)),
        vision_config=_GLM_VISION, **_GLM_TOKENS))


def glm46v():
    """GLM-4.6V: no tower class of its own; its vision config names GLM-4.1V's."""
    import transformers as tr

    return tr.Glm46VForConditionalGeneration(tr.Glm46VConfig(
        text_config=dict(_TEXT, rope_parameters=_rope(partial_rotary_factor=1.0)),
        vision_config=dict(_GLM_VISION, model_type="glm4v_vision"), **_GLM_TOKENS))


def glm_ocr():
    import transformers as tr

    return tr.GlmOcrForConditionalGeneration(tr.GlmOcrConfig(
        text_config=dict(_TEXT, rope_parameters=_rope(partial_rotary_factor=1.0)),
        vision_config=_GLM_VISION, **_GLM_TOKENS))


def glm5_next():
    """GLM-5.3: 1-D positions in its text model; a swiglu_limit small enough that the clamps of
    the tower's MLPs bite (about a fifth of the gates, a third of the up projections)."""
    import transformers as tr

    return tr.Glm5NextForConditionalGeneration(tr.Glm5NextConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                         kv_lora_rank=16, q_lora_rank=32, v_head_dim=16, qk_nope_head_dim=16,
                         index_topk=16, index_head_dim=16, index_n_heads=2, linear_head_dim=16,
                         linear_num_heads=4, hc_mult=2, mlp_layer_types=["dense", "sparse"],
                         layer_types=["linear_attention", "full_attention"], pad_token_id=0,
                         max_position_embeddings=512),
        vision_config=dict(_GLM_VISION, projection_intermediate_size=48, swiglu_limit=0.1),
        **_GLM_TOKENS))


def glm_image():
    """GLM-Image (image generation): its tower reads the source images of an image-to-image
    prompt, a VQ codebook turns each patch into an image token id (< ``num_embeddings``, so
    within the text vocabulary) written over the placeholders; ``lm_head`` scores the vision
    vocabulary. ``spatial_merge_size`` 1: one token a patch."""
    import transformers as tr

    return tr.GlmImageForConditionalGeneration(tr.GlmImageConfig(
        text_config=dict(_TEXT, vision_vocab_size=300, pad_token_id=0, eos_token_id=EOI,
                         rope_parameters=_rope()),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2,
                           patch_size=2, image_size=8),
        vq_config=dict(embed_dim=16, num_embeddings=64, latent_channels=32),
        image_token_id=IMG, image_start_token_id=BOI, image_end_token_id=EOI))


def colqwen2():
    """ColQwen2 (retrieval: no ``generate``) over a Qwen2-VL model, its tower at ``vlm.visual``."""
    import transformers as tr

    return tr.ColQwen2ForRetrieval(tr.ColQwen2Config(embedding_dim=16, vlm_config=dict(
        model_type="qwen2_vl", text_config=dict(_TEXT, rope_parameters=_rope()),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=2), **_TOKENS)))


def cosmos3_omni():
    """Cosmos3-Omni: Qwen3-VL's architecture and tower class."""
    import transformers as tr

    return tr.Cosmos3OmniForConditionalGeneration(tr.Cosmos3OmniConfig(
        text_config=dict(_TEXT, head_dim=16, rope_parameters=_rope(mrope_interleaved=True)),
        vision_config=dict(_QWEN3_VISION, deepstack_visual_indexes=[0]), **_TOKENS))


PACKED = {"qwen2": qwen2, "qwen2_5": qwen2_5, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
          "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe}
PACKED_MORE = {"qwen2_5_omni": qwen2_5_omni, "qwen3_omni_moe": qwen3_omni_moe,
               "exaone4_5": exaone4_5, "cohere_compass": cohere_compass, "qwen4_exp": qwen4_exp,
               "ernie4_5_vl_moe": ernie4_5_vl_moe, "glm4v": glm4v, "glm4v_moe": glm4v_moe,
               "glm46v": glm46v, "glm_ocr": glm_ocr, "glm5_next": glm5_next,
               "glm_image": glm_image, "colqwen2": colqwen2, "cosmos3_omni": cosmos3_omni}
ALL_PACKED = {**PACKED, **PACKED_MORE}

#: The class of each family's vision tower (GLM-4.6V, ColQwen2 and Cosmos3-Omni build towers of
#: other families); :func:`tower_name` finds it in a model.
TOWER_CLASS = {
    "qwen2": "Qwen2VisionTransformerPretrainedModel",
    "qwen2_5": "Qwen2_5_VisionTransformerPretrainedModel",
    "qwen3": "Qwen3VLVisionModel", "qwen3_moe": "Qwen3VLMoeVisionModel",
    "qwen3_5": "Qwen3_5VisionModel", "qwen3_5_moe": "Qwen3_5MoeVisionModel",
    "qwen2_5_omni": "Qwen2_5OmniVisionEncoder", "qwen3_omni_moe": "Qwen3OmniMoeVisionEncoder",
    "exaone4_5": "Exaone4_5_VisionModel", "cohere_compass": "CohereCompassVisionModel",
    "qwen4_exp": "Qwen4ExpVisionModel",
    "ernie4_5_vl_moe": "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
    "glm4v": "Glm4vVisionModel", "glm4v_moe": "Glm4vMoeVisionModel", "glm46v": "Glm4vVisionModel",
    "glm_ocr": "GlmOcrVisionModel", "glm5_next": "Glm5NextVisionModel",
    "glm_image": "GlmImageVisionModel",
    "colqwen2": "Qwen2VisionTransformerPretrainedModel", "cosmos3_omni": "Qwen3VLVisionModel",
}

#: Families without ``generate()``: the field of their forward output compared instead of logits.
NO_GENERATE = {"colqwen2": "embeddings"}
#: The tower's ``spatial_merge_size`` where it is not 2 (GLM-Image: no merger, a token a patch).
SPATIAL_MERGE = {"glm_image": 1}

#: Families that write one vision segment per temporal patch of a video, each after its
#: timestamp (Qwen3-VL's processor and those copied from it).
SEGMENT_PER_FRAME = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "cohere_compass",
                     "qwen4_exp", "cosmos3_omni")
#: GLM-V processors: an image between begin/end-of-image tokens; a video between
#: begin/end-of-video tokens, each temporal patch an image segment (the image token, no video
#: token) followed by its timestamp; ``mm_token_type_ids`` 2 inside the video.
GLM_LAYOUT = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glm5_next")
#: Families whose HF model takes images or a video in one prompt, not both: with ``input_ids``
#: their ``get_placeholder_mask`` counts the image token for images and for videos alike
#: (``special_video_mask = input_ids == image_token_id``, transformers 5.17 and 5.24), so a
#: prompt with both fails its token count check. They get two prompts (GLM-5.3 tells the two
#: apart by the video's begin/end tokens and takes one).
IMAGES_OR_VIDEO = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
#: Families whose model hands its tower a video as one grid row per temporal patch.
VIDEO_AS_FRAMES = ("glm4v", "glm4v_moe", "glm46v")


def tower_name(family, model):
    """The module name of ``family``'s vision tower in ``model`` (transformers 5.17's Omni
    thinkers hold it as ``visual``, 5.24's as ``model.visual``)."""
    (name,) = [n for n, m in model.named_modules()
               if type(m).__name__ == TOWER_CLASS[family]]
    return name


def vision_config(model):
    """The config of ``model``'s vision tower (ColQwen2: of its ``vlm``)."""
    config = model.config
    return getattr(config, "vlm_config", config).vision_config


def _patch_dim(model):
    """Width of a ``pixel_values`` row: ERNIE's rows are single frames (no temporal patch)."""
    vision = vision_config(model)
    return (vision.in_channels * getattr(vision, "temporal_patch_size", 1)
            * vision.patch_size ** 2)


# ---- the same models at a released checkpoint's shape (GPU tests and benchmarks/families.py) ----

_QWEN25_7B = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, depth=32)
#: family -> (the checkpoint whose vision tower it is shaped as, overrides of the family's
#: default vision config; the defaults are transformers' reference checkpoint's, except where
#: overridden). The tower's output width is always the text model's (:func:`at_real_shape`).
REAL_VISION = {
    "qwen2": ("Qwen2-VL-7B", {}),
    "qwen2_5": ("Qwen2.5-VL-3B", dict(hidden_size=1280)),
    "qwen2_5_omni": ("Qwen2.5-Omni-7B", _QWEN25_7B),
    "exaone4_5": ("EXAONE-4.5 (Qwen2.5-VL-7B's tower, 8 kv heads)",
                  dict(_QWEN25_7B, num_key_value_heads=8)),
    "qwen3": ("Qwen3-VL-8B", {}),
    "qwen3_moe": ("Qwen3-VL-30B-A3B", {}),
    "qwen3_omni_moe": ("Qwen3-Omni-30B-A3B", {}),
    "cohere_compass": ("Cohere Compass", {}),
    "qwen3_5": ("Qwen3.5", {}),
    "qwen3_5_moe": ("Qwen3.5-MoE", {}),
    "qwen4_exp": ("Qwen4-Exp", {}),
    "cosmos3_omni": ("Cosmos3-Omni", {}),
    "ernie4_5_vl_moe": ("ERNIE-4.5-VL-28B-A3B", {}),
    "glm4v": ("GLM-4.1V-9B", {}),
    "glm4v_moe": ("GLM-4.5V", {}),
    "glm46v": ("GLM-4.6V", {}),
    "glm_ocr": ("GLM-OCR", {}),
    "glm5_next": ("GLM-5.3", {}),
    "glm_image": ("GLM-Image", {}),
    "colqwen2": ("ColQwen2 (Qwen2-VL-2B)", {}),
}
#: Text configs where the family's default is not a checkpoint that fits one GPU (Qwen2-VL's
#: and Qwen2.5-VL's defaults are 72B): the published 7B and 3B text models.
REAL_TEXT = {
    "qwen2": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    "qwen2_5": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                    num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
}
REAL_TEXT["colqwen2"] = dict(REAL_TEXT["qwen2"], hidden_size=1536, intermediate_size=8960,
                             num_attention_heads=12, num_key_value_heads=2)
# transformers 5.17's defaults leave out what the checkpoints set: GLM's half-rotary 3-D
# positions, and the head width where it is not hidden_size / heads
_GLM_ROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]})
REAL_TEXT.update(
    glm4v=_GLM_ROPE, glm46v=_GLM_ROPE, glm_image=_GLM_ROPE, glm4v_moe=dict(_GLM_ROPE, head_dim=128),
    qwen3_omni_moe=dict(head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
        "mrope_interleaved": True}))
#: The tests' text model at a real tower's shape, where the longer prompts need more: GLM-5.3's
#: sparse attention keeps every key (a top-k choice flips on bf16 rounding of the image tokens)
TINY_TEXT_AT_REAL_SHAPE = {"glm5_next": dict(index_topk=16384)}
#: Text models whose logits jump with bf16 rounding of long image runs even so (GLM-5.3's
#: expert routing: 0.2 of the logits' scale on the H200 where its tower's output was within
#: 3.6 % of HF's); the GPU test at a real shape checks their towers' outputs instead.
TEXT_CHOOSES_DISCRETELY = ("glm5_next",)


@functools.cache
def _tiny_on_meta(family):
    """``family``'s tiny model on the meta device: its classes and config, read, never changed
    (built once for :func:`real_vision`, :func:`real_tower` and :func:`at_real_shape`)."""
    with torch.device("meta"):
        return ALL_PACKED[family]()


def real_vision(family, width=None):
    """``(checkpoint, vision config dict)``: :data:`REAL_VISION`'s shape, the tower's output
    ``width`` wide (default: the family's default text model's width, as in the checkpoint)."""
    tiny = _tiny_on_meta(family)
    checkpoint, overrides = REAL_VISION[family]
    default = type(vision_config(tiny))().to_dict()
    if width is None:
        text_cls = type(getattr(tiny.config, "vlm_config", tiny.config).text_config)
        width = REAL_TEXT.get(family, {}).get("hidden_size", text_cls().hidden_size)
    # Qwen2-VL names the tower's output width hidden_size; GLM-Image's and ERNIE's towers have
    # none (GLM-Image's feeds its VQ tokenizer, ERNIE's a resampler)
    key = "hidden_size" if family in ("qwen2", "colqwen2") else "out_hidden_size"
    return checkpoint, {**default, **overrides, **({key: width} if key in default else {})}


def real_tower(family, device="cpu", dtype=torch.bfloat16):
    """``family``'s vision tower alone at :data:`REAL_VISION`'s shape (eval) and its
    checkpoint's name."""
    tiny = _tiny_on_meta(family)
    cls = next(type(m) for m in tiny.modules() if type(m).__name__ == TOWER_CLASS[family])
    checkpoint, vision = real_vision(family)
    with torch.device(device):
        tower = cls._from_config(type(vision_config(tiny))(**vision), dtype=dtype)
    return tower.eval(), checkpoint


def at_real_shape(family, text="tiny", max_params=20e9, device="cpu", dtype=torch.bfloat16):
    """``family``'s model with its vision tower at :data:`REAL_VISION`'s shape.

    ``text="tiny"``: the tests' 64-wide text model (the tower's output projection 64 wide, so
    everything before it is the checkpoint's); ``text="default"``: the family's default text
    config (:data:`REAL_TEXT` where that is no checkpoint that fits), its layers cut, where
    needed, so the model holds at most ``max_params`` parameters. The tests' token ids either
    way, so :func:`packed_prompt` lays out its prompts. Returns the model (eval, on ``device``
    in ``dtype``) and a line that says what it is."""
    tiny = _tiny_on_meta(family)
    config = tiny.config.to_dict()
    outer = config.get("vlm_config", config)          # ColQwen2 nests its VLM's config
    if text == "default":
        text_cls = type(getattr(tiny.config, "vlm_config", tiny.config).text_config)
        base = {k: v for k, v in outer["text_config"].items() if k.endswith("token_id")}
        default = text_cls().to_dict()
        published = REAL_TEXT.get(family, {})
        default = _cut_layers(default, published.get("num_hidden_layers",
                                                     default["num_hidden_layers"]))
        outer["text_config"] = {**default, **published, **base}
    else:
        outer["text_config"].update(TINY_TEXT_AT_REAL_SHAPE.get(family, {}))
    width = outer["text_config"]["hidden_size"]
    checkpoint, outer["vision_config"] = real_vision(family, width)
    if "vq_config" in outer:     # GLM-Image: its VQ tokenizer reads the tower's features
        outer["vq_config"]["latent_channels"] = outer["vision_config"]["hidden_size"]
        if text == "default":
            outer["vq_config"]["num_embeddings"] = type(tiny.config.vq_config)().num_embeddings
    model_cls, config_cls = type(tiny), type(tiny.config)
    layers = total = outer["text_config"].get("num_hidden_layers")
    while True:
        cfg = config_cls.from_dict(config)
        with torch.device("meta"):
            probe = model_cls._from_config(cfg)
        params = sum(p.numel() for p in probe.parameters())
        cut = _cut_layers(outer["text_config"], max(1, int(layers * max_params / params)))
        if text != "default" or params <= max_params or cut["num_hidden_layers"] >= layers:
            break
        outer["text_config"], layers = cut, cut["num_hidden_layers"]
    with torch.device(device):
        model = model_cls._from_config(cfg, dtype=dtype)
    note = (f"tower of {checkpoint}; text model {text}, {width} wide, {layers} of {total} "
            f"layers; {params / 1e9:.1f}B parameters")
    return model.eval(), note


def _cut_layers(text, layers):
    """``text`` config dict with about ``layers`` of its layers: the first of every kind in each
    per-layer list (a text model of linear-attention layers alone cannot generate), then layers
    spread over the depth up to the count (per-layer lists cut alike; settings that name layer
    indices are left as they are)."""
    total = text["num_hidden_layers"]
    lists = [v for v in text.values() if isinstance(v, list) and len(v) == total]
    # the first layer of every kind in every per-layer list, then layers spread evenly
    keep = {next(i for i, x in enumerate(v) if x == kind) for v in lists for kind in set(v)}
    for i in range(layers):
        if len(keep) >= layers:
            break
        keep.add(round(i * (total - 1) / max(layers - 1, 1)))
    keep = sorted(keep)
    layers = len(keep)
    cut = {k: ([v[i] for i in keep] if isinstance(v, list) and len(v) == total else v)
           for k, v in text.items()}
    cut["num_hidden_layers"] = layers
    return cut


def real_grids(model, images=4):
    """Document-sized images (980 x 1288 px) and a 16-frame video of 448 px, in patches of
    ``model``'s tower (a frame a grid row where it has no temporal patch)."""
    vision = vision_config(model)
    patch, merge = vision.patch_size, getattr(vision, "spatial_merge_size", 2)
    step = patch * merge
    temporal = getattr(vision, "temporal_patch_size", None) or 1
    doc = [1, 980 // step * merge, 1288 // step * merge]
    return [doc] * images, [[16 // temporal, 448 // step * merge, 448 // step * merge]]


#: The prompts' grids in patches (images, video): two small images and a video of two temporal
#: patches; :func:`real_grids` gives document-sized ones.
SMALL_GRIDS = ([[1, 4, 4], [1, 2, 4]], [[2, 4, 4]])


def packed_prompts(name, model, device="cpu", dtype=torch.float32, grids=SMALL_GRIDS):
    """The prompts ``name`` is tested with: one with the images and the video of ``grids``;
    images and the video apart for :data:`IMAGES_OR_VIDEO`; ColQwen2's documents of one image
    each."""
    if name in IMAGES_OR_VIDEO:
        return [packed_prompt(name, model, 0, device, dtype, video=False, grids=grids),
                packed_prompt(name, model, 1, device, dtype, images=False, grids=grids)]
    return [packed_prompt(name, model, 0, device, dtype, grids=grids)]


def packed_prompt(name, model, seed=0, device="cpu", dtype=torch.float32, images=True,
                  video=True, grids=SMALL_GRIDS):
    """``generate()`` keyword arguments: text, the images and the video of ``grids`` (by
    default two images of 4x4 and 2x4 patches, a video of two temporal patches of 4x4), laid
    out as ``name``'s processor lays them out."""
    if name == "colqwen2":
        return _retrieval_prompt(model, seed, device, dtype, grids[0])
    if name == "glm_image":
        return _image_to_image_prompt(model, seed, device, dtype, grids[0])
    g = torch.Generator().manual_seed(seed)
    grid, vgrid = torch.tensor(grids[0]), torch.tensor(grids[1])
    ids, types, moe_types = [1, 2, 3], [0, 0, 0], [0, 0, 0]

    def add(tokens, kind=0, span=False):
        """``tokens`` of modality ``kind`` (0 text, 1 image, 2 video): its placeholders have
        ``mm_token_type_ids`` ``kind``; ``span``: ERNIE's MoE types count every token."""
        ids.extend(tokens)
        types.extend(kind if t in (IMG, VID) else 0 for t in tokens)
        moe_types.extend(kind if span else 0 for _ in tokens)

    for t, h, w in grid.tolist() if images else []:
        n = t * h * w // 4
        if name in GLM_LAYOUT or name == "ernie4_5_vl_moe":
            add([BOI] + [IMG] * n + [EOI], 1, span=True)
        else:
            add([VS] + [IMG] * n + [VE], 1)
        add([5])
    for t, h, w in vgrid.tolist() if video else []:
        if name in SEGMENT_PER_FRAME:
            for _ in range(t):
                add([7])   # the frame's timestamp
                add([VS] + [VID] * (h * w // 4) + [VE], 2)
        elif name in GLM_LAYOUT:
            add([BOV])
            for _ in range(t):
                add([BOI] + [IMG] * (h * w // 4) + [EOI], 2)
                add([7])   # the frame's timestamp
            add([EOV, 6])
        elif name == "ernie4_5_vl_moe":
            # one row a frame; the resampler merges two frames, so t*h*w / (4*2) tokens
            add([BOV] + [VID] * (t * h * w // 8) + [EOV], 2, span=True)
            add([6])
        else:
            # EXAONE 4.5's text model has 1-D positions: the tokens around a placeholder are
            # text to it, as the chat template writes them
            add([VS] + [VID] * (t * h * w // 4) + [VE, 6], 2)
    input_ids = torch.tensor([ids])
    dim = _patch_dim(model)
    prompt = dict(input_ids=input_ids.to(device))
    if images:
        prompt.update(
            pixel_values=torch.randn(int(grid.prod(-1).sum()), dim, generator=g).to(device, dtype),
            image_grid_thw=grid.to(device))
    if video:
        prompt.update(
            pixel_values_videos=torch.randn(int(vgrid.prod(-1).sum()), dim, generator=g).to(
                device, dtype),
            video_grid_thw=vgrid.to(device))
    params = inspect.signature(type(model).forward).parameters
    if "mm_token_type_ids" in params:
        prompt["mm_token_type_ids"] = torch.tensor([types], device=device)
    if "moe_mm_token_type_ids" in params:
        prompt["moe_mm_token_type_ids"] = torch.tensor([moe_types], device=device)
    if video and "video_second_per_grid" in params:
        # the Omni processors': temporal_patch_size / fps (2 frames at the default 2 fps)
        prompt["video_second_per_grid"] = torch.tensor([1.0], device=device)
    return prompt


def _retrieval_prompt(model, seed, device, dtype, grid):
    """ColQwen2's document batch: one image of ``grid`` a row, rows padded on the right,
    ``pixel_values`` padded per image to ``(images, max patches, patch_dim)`` as
    ``ColQwen2Processor`` pads them (its forward drops the padding before the tower)."""
    g = torch.Generator().manual_seed(seed)
    grid, dim = torch.tensor(grid), _patch_dim(model)
    rows = [[1, VS] + [IMG] * (t * h * w // 4) + [VE, 5, 6] for t, h, w in grid.tolist()]
    width = max(map(len, rows))
    pixels = torch.zeros(len(rows), int(grid.prod(-1).max()), dim)
    for i, patches in enumerate(grid.prod(-1).tolist()):
        pixels[i, :patches] = torch.randn(patches, dim, generator=g)
    return dict(
        input_ids=torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device),
        attention_mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows],
                                    device=device),
        pixel_values=pixels.to(device, dtype), image_grid_thw=grid.to(device))


def _image_to_image_prompt(model, seed, device, dtype, grid):
    """GLM-Image's image-to-image prompt, as ``GlmImageProcessor`` and its chat template write
    it: the source images of ``grid`` (a placeholder a patch) between
    begin/end-of-image tokens, the target's size as text (``<sop>2 4<eop>``), then the
    begin-of-image token the generated image tokens follow. ``image_grid_thw`` holds the source
    grids and then the target's (2x4: the decode positions of 8 tokens), ``images_per_sample``
    their count; the model gives the tower the source grids alone."""
    g = torch.Generator().manual_seed(seed)
    grid, target = torch.tensor(grid), torch.tensor([[1, 2, 4]])
    ids = [1, 2, 3]
    for t, h, w in grid.tolist():
        ids += [BOI] + [IMG] * (t * h * w) + [EOI, 5]
    ids += [8, 2, 4, 9, BOI]
    grids = torch.cat([grid, target])
    return dict(
        input_ids=torch.tensor([ids], device=device),
        pixel_values=torch.randn(int(grid.prod(-1).sum()), _patch_dim(model), generator=g).to(
            device, dtype),
        image_grid_thw=grids.to(device),
        images_per_sample=torch.tensor([len(grids)], device=device))


BATCHED = {"llava": llava, "idefics3": idefics3, "gemma3": gemma3}


def llava_prompt(images, seed=0, device="cpu", dtype=torch.float32):
    """``generate()`` keyword arguments for ``images`` 32x32 images (16 tokens each)."""
    return batched_prompt("llava", images, seed, device, dtype)


def batched_prompt(name, images, seed=0, device="cpu", dtype=torch.float32):
    """``generate()`` keyword arguments for ``images`` 32x32 images, laid out as ``name``'s
    processor lays them out (LLaVA: 16 tokens; Idefics3: 4 after its pixel shuffle, pixels
    batched per prompt; Gemma 3: 4 between begin/end-of-image tokens)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(images, 3, 32, 32, generator=g).to(device, dtype)
    if name == "idefics3":
        ids, pixels = [1, 2] + ([IMG] * 4 + [5]) * images, pixels[None]
    elif name == "gemma3":
        ids = [1, 2] + ([VS] + [IMG] * 4 + [VE, 5]) * images
    else:
        ids = [1, 2] + ([IMG] * 16 + [5]) * images
    return dict(input_ids=torch.tensor([ids], device=device), pixel_values=pixels)
