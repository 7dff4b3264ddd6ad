"""Tiny random Hugging Face vision-language models and their prompts, for the ``serve_vision_``
tests on CPU (``tests/unit/integrations/test_hf_serve_vision.py``) and GPU (``tests/gpu/test_hf_gpu.py``).

Each prompt holds two images and one video of two temporal patches, laid out as the family's
processor lays them out (Qwen3-VL: one vision segment per temporal patch), with
``mm_token_type_ids`` where the installed transformers asks for it.
"""

from __future__ import annotations

import inspect

import torch

IMG, VID, VS, VE = 290, 291, 292, 293
PATCH_DIM = 3 * 2 * 2 * 2    # channels * temporal patch * patch**2 (patch_size=2 below)
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


PACKED = {"qwen2": qwen2, "qwen2_5": qwen2_5, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
          "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe}
#: Families that write one vision segment per temporal patch of a video (Qwen3-VL's processor).
SEGMENT_PER_FRAME = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")


def packed_prompt(name, model, seed=0, device="cpu", dtype=torch.float32):
    """``generate()`` keyword arguments: text, two images (4x4 and 2x4 patches), a video."""
    g = torch.Generator().manual_seed(seed)
    grid, vgrid = torch.tensor([[1, 4, 4], [1, 2, 4]]), torch.tensor([[2, 4, 4]])
    ids = [1, 2, 3]
    for t, h, w in grid.tolist():
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE, 5]
    for t, h, w in vgrid.tolist():
        if name in SEGMENT_PER_FRAME:
            for _ in range(t):
                ids += [7, VS] + [VID] * (h * w // 4) + [VE]
        else:
            ids += [VS] + [VID] * (t * h * w // 4) + [VE, 6]
    input_ids = torch.tensor([ids])
    prompt = dict(
        input_ids=input_ids.to(device),
        pixel_values=torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g).to(
            device, dtype),
        image_grid_thw=grid.to(device),
        pixel_values_videos=torch.randn(int(vgrid.prod(-1).sum()), PATCH_DIM, generator=g).to(
            device, dtype),
        video_grid_thw=vgrid.to(device))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        types = (input_ids == IMG).long() + 2 * (input_ids == VID).long()
        prompt["mm_token_type_ids"] = types.to(device)
    return prompt


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
