"""``serve_vision_(model)`` on whole Hugging Face VLMs: ``generate()`` unchanged, nothing lost.

Tiny random models, float32, CPU (``tests/hf_models.py``): Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE and Qwen3.5 (packed towers); the other packed towers (the Qwen2.5-Omni and
Qwen3-Omni-MoE thinkers, EXAONE 4.5, Cohere Compass, Qwen4-Exp, ERNIE-4.5-VL, GLM-4.1V, GLM-4.5V,
GLM-4.6V, GLM-OCR, GLM-5.3, GLM-Image, ColQwen2, Cosmos3-Omni); LLaVA, Idefics3 and Gemma 3
(batched CLIP, Idefics3 and SigLIP towers). For each: greedy tokens identical to the unmodified
model and logits within 1e-5 (two images and a video; GLM-V: images and the video in two prompts;
GLM-Image: two source images of an image-to-image prompt; ColQwen2, which has no ``generate``: its
embeddings; LLaVA: 1, 3 and 2 images), every tower call served; the
tower keeps its attributes and its HF return type; ``state_dict()`` keys and ``save_pretrained``
files are exactly as before; ``restore_vision_`` gives the tower its own forward back. Bad options
fail at the call, before any tower is touched.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("transformers")

import hf_models  # noqa: E402
import vit_graph_backend as vg  # noqa: E402
from vit_graph_backend.errors import (  # noqa: E402
    InvalidInputError,
    InvalidOptionError,
    UnsupportedModelError,
)
from vit_graph_backend.integrations.hf import served_towers  # noqa: E402

LOGIT_ATOL = 1e-5


def _generate(model, prompt):
    with torch.no_grad():
        tokens = model.generate(**prompt, max_new_tokens=6, do_sample=False)
        logits = model(**prompt).logits
    return tokens, logits


def _outputs(family, model, prompt):
    """Greedy tokens and the prompt's logits; for a family without ``generate()``, ``None`` and
    the forward output it is compared by (``hf_models.NO_GENERATE``)."""
    field = hf_models.NO_GENERATE.get(family)
    if field is None:
        return _generate(model, prompt)
    with torch.no_grad():
        return None, getattr(model(**prompt), field)


def _tower_calls(family, prompts):
    """Tower calls ``_outputs`` makes: one a modality of a prompt, in ``generate()``'s prefill
    and in the forward."""
    runs = 1 if family in hf_models.NO_GENERATE else 2
    return runs * sum(("pixel_values" in p) + ("pixel_values_videos" in p) for p in prompts)


@pytest.mark.parametrize("family", sorted(hf_models.ALL_PACKED))
def test_packed_family_generates_the_same_tokens(family):
    torch.manual_seed(0)
    model = hf_models.ALL_PACKED[family]().eval()
    prompts = hf_models.packed_prompts(family, model)
    name = hf_models.tower_name(family, model)
    visual, config = model.get_submodule(name), hf_models.vision_config(model)
    keys = list(model.state_dict())
    refs = [_outputs(family, model, prompt) for prompt in prompts]

    assert vg.serve_vision_(model) is model
    served = served_towers(model)
    assert list(served) == [name]
    for prompt, (ref_tokens, ref_out) in zip(prompts, refs):
        tokens, out = _outputs(family, model, prompt)
        if ref_tokens is not None:
            assert tokens.tolist() == ref_tokens.tolist()
        torch.testing.assert_close(out, ref_out, atol=LOGIT_ATOL, rtol=0)
    stats = served[name].report()["stats"]
    # every call of the tower served (a call its own forward answers is not counted)
    assert stats["calls"] == _tower_calls(family, prompts), stats
    assert stats["eager_batches"] == 0, stats
    assert stats["no_graph_items"] + stats["graph_items"] >= stats["calls"]
    assert list(model.state_dict()) == keys

    assert visual.dtype == torch.float32 and visual.device.type == "cpu"
    merge = hf_models.SPATIAL_MERGE.get(family, 2)
    assert visual.spatial_merge_size == merge and visual.config is config

    vg.restore_vision_(model)
    assert "forward" not in visual.__dict__ and served_towers(model) == {}
    tokens, out = _outputs(family, model, prompts[0])
    if refs[0][0] is not None:
        assert tokens.tolist() == refs[0][0].tolist()
    torch.testing.assert_close(out, refs[0][1], atol=0, rtol=0)   # the tower's own forward


@pytest.mark.parametrize("family", sorted(hf_models.PACKED))
def test_tower_call_returns_the_hf_output_type(family):
    torch.manual_seed(0)
    model = hf_models.PACKED[family]().eval()
    prompt = hf_models.packed_prompt(family, model)
    visual, pixels, grid = model.model.visual, prompt["pixel_values"], prompt["image_grid_thw"]
    with torch.no_grad():
        ref = visual(pixels, grid_thw=grid)
        vg.serve_vision_(model)
        got = visual(pixels, grid_thw=grid)
        as_tuple = visual(pixels, grid_thw=grid, return_dict=False)
        features = model.model.get_image_features(pixels, grid)
        hidden = visual(pixels, grid_thw=grid, output_hidden_states=True)
    assert type(got) is type(ref)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output, atol=1e-5, rtol=0)
    assert got.last_hidden_state is None   # the graphs do not keep the pre-merger states
    if family in ("qwen3", "qwen3_moe"):
        assert len(got.deepstack_features) == len(ref.deepstack_features) >= 1
        for a, b in zip(got.deepstack_features, ref.deepstack_features):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], ref.pooler_output, atol=1e-5, rtol=0)
    assert [f.shape[0] for f in features.pooler_output] == [4, 2]
    # hidden states asked for: the tower's own forward answers, with every field
    assert hidden.last_hidden_state is not None and hidden.hidden_states is not None


def test_forward_hooks_on_the_served_tower_and_inside_it_run_as_without_serving():
    """A hook on the tower runs around its call, graphs or not; a hook inside it (a block's)
    makes the call run the tower's own forward, so the hook's effect is in the output."""
    torch.manual_seed(0)
    model = hf_models.PACKED["qwen2_5"]().eval()
    prompt = hf_models.packed_prompt("qwen2_5", model)
    visual, pixels, grid = model.model.visual, prompt["pixel_values"], prompt["image_grid_thw"]
    seen = []
    visual.register_forward_hook(lambda m, a, o: seen.append("tower"))
    inside = visual.blocks[0].register_forward_hook(
        lambda m, a, o: o + torch.linspace(-1.0, 1.0, o.shape[-1]))
    with torch.no_grad():
        ref = visual(pixels, grid_thw=grid).pooler_output
        vg.serve_vision_(model)
        got = visual(pixels, grid_thw=grid).pooler_output
        inside.remove()
        plain = visual(pixels, grid_thw=grid).pooler_output
    assert seen == ["tower"] * 3
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(plain, ref, atol=1e-3)
    stats = served_towers(model)["model.visual"].report()["stats"]
    assert stats["calls"] == 2, stats
    vg.restore_vision_(model)


def test_save_pretrained_writes_the_same_weights(tmp_path):
    torch.manual_seed(0)
    model = hf_models.qwen2_5().eval()
    model.save_pretrained(tmp_path / "before")
    vg.serve_vision_(model)
    model.save_pretrained(tmp_path / "after")
    from safetensors.torch import load_file

    before = load_file(tmp_path / "before" / "model.safetensors")
    after = load_file(tmp_path / "after" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for key in before:
        torch.testing.assert_close(after[key], before[key], atol=0, rtol=0)


@pytest.mark.parametrize("family", sorted(hf_models.BATCHED))
def test_batched_tower_generates_the_same_tokens(family):
    gc.collect()  # an earlier test's served tower left in a cycle would count in vg.report()
    torch.manual_seed(0)
    model = hf_models.BATCHED[family]().eval()
    keys = list(model.state_dict())
    prompts = [hf_models.batched_prompt(family, n, seed=n) for n in (1, 3, 2)]
    refs = [_generate(model, p) for p in prompts]
    vg.serve_vision_(model)
    (name, tower), = [(n, t) for n, t in model.named_modules() if n in served_towers(model)]
    for prompt, (ref_tokens, ref_logits) in zip(prompts, refs):
        tokens, logits = _generate(model, prompt)
        assert tokens.tolist() == ref_tokens.tolist()
        torch.testing.assert_close(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
    assert list(model.state_dict()) == keys
    report = vg.report()
    assert 1 <= report["compiles"] <= 3 and report["stats"]["eager_batches"] == 0
    assert report["stats"]["calls"] >= len(prompts)
    vg.restore_vision_(model)
    assert "forward" not in tower.__dict__


def test_bad_calls_fail_before_any_tower_changes():
    model = hf_models.llava().eval()
    with pytest.raises(InvalidOptionError, match="max_items_per_graph"):
        vg.serve_vision_(model, max_items_per_graph=2)   # an option of packed towers only
    with pytest.raises(InvalidOptionError, match="fuse"):
        vg.serve_vision_(model, fuse=False)              # an adapter keyword: no packed tower
    with pytest.raises(InvalidOptionError, match="max_budget"):
        vg.serve_vision_(hf_models.qwen2().eval(), max_budget=0)
    assert served_towers(model) == {}
    with pytest.raises(UnsupportedModelError, match="Qwen2_5_VisionTransformerPretrainedModel"):
        vg.serve_vision_(torch.nn.Linear(2, 2))


def test_a_tower_moved_after_serving_runs_its_own_forward(caplog):
    torch.manual_seed(0)
    model = hf_models.qwen2().eval()
    prompt = hf_models.packed_prompt("qwen2", model)
    pixels, grid = prompt["pixel_values"], prompt["image_grid_thw"]
    vg.serve_vision_(model)
    model.to(torch.float64)   # the graphs were made for float32
    with torch.no_grad(), caplog.at_level("WARNING", logger="vit_graph_backend"):
        got = model.model.visual(pixels.double(), grid_thw=grid)
    assert got.pooler_output.dtype == torch.float64 and got.last_hidden_state is not None
    assert served_towers(model)["model.visual"].report()["stats"]["calls"] == 0
    assert any("moved to cpu/torch.float64" in r.getMessage() for r in caplog.records)


def test_an_empty_batch_is_named_before_dynamo_sees_it_and_costs_the_tower_nothing():
    model = hf_models.llava().eval()
    vg.serve_vision_(model)
    (tower,) = [t for n, t in model.named_modules() if n in served_towers(model)]
    pixels = torch.randn(2, 3, tower.config.image_size, tower.config.image_size)
    with torch.inference_mode():
        expected = type(tower).forward(tower, pixels).last_hidden_state
        torch.testing.assert_close(tower(pixels).last_hidden_state, expected)
        compiles = vg.report()["compiles"]
        with pytest.raises(InvalidInputError, match=r"pixel_values holds an empty batch"):
            tower(pixels[:0])
        assert vg.report()["compiles"] == compiles   # Dynamo never traced it
        torch.testing.assert_close(tower(pixels).last_hidden_state, expected)
    vg.restore_vision_(model)
