"""``serve_vision_`` on whole Hugging Face VLMs on a GPU, in bf16 (marked ``gpu``).

The same tiny random models as ``tests/unit/integrations/test_hf_serve_vision.py`` (``tests/hf_models.py``,
every packed family), and each with its tower at a released checkpoint's shape on document-sized
images and a 16-frame video, on CUDA in bfloat16: greedy tokens of ``generate()`` with two images and a video equal the
unmodified model's (or part from them only where the unmodified model's own two best scores were
closer than bf16's tolerance, a tie that rounding may break either way), logits within bf16
tolerance (the largest difference is printed), and every image and video batch replays a CUDA
graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_models  # noqa: E402
import vit_graph_backend as vg  # noqa: E402
from vit_graph_backend.integrations.hf import served_towers  # noqa: E402

pytestmark = pytest.mark.gpu

DEV, DT = "cuda", torch.bfloat16


def _generate(model, prompt):
    """Greedy tokens, each step's scores, and the prompt's logits."""
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        return (out.sequences, torch.stack(out.scores, 1).float(),
                model(**prompt).logits.float())


def _assert_same_greedy_tokens(tokens, ref_tokens, ref_scores, tol):
    """Equal tokens; or, where they first part, the reference chose between two tokens whose
    scores were within ``tol`` of each other (every later token follows from that choice)."""
    if tokens.tolist() == ref_tokens.tolist():
        return
    assert tokens.shape == ref_tokens.shape, (tokens.tolist(), ref_tokens.tolist())
    row, pos = (tokens != ref_tokens).nonzero()[0].tolist()
    step = pos - (ref_tokens.shape[1] - ref_scores.shape[1])
    assert step >= 0, "the prompt itself differs"
    scores = ref_scores[row, step]
    gap = (scores[ref_tokens[row, pos]] - scores[tokens[row, pos]]).item()
    print(f"tokens part at generated step {step}: the reference's scores for the two tokens "
          f"differ by {gap:.3g} (tolerance {tol:.3g})")
    assert 0 <= gap <= tol, (tokens.tolist(), ref_tokens.tolist(), gap)


@pytest.mark.parametrize("family", sorted(hf_models.ALL_PACKED))
def test_packed_family_generates_the_same_tokens_on_cuda(family):
    torch.manual_seed(0)
    model = hf_models.ALL_PACKED[family]().to(DEV, DT).eval()
    _check_generate(family, model, hf_models.packed_prompts(family, model, device=DEV, dtype=DT))


@pytest.mark.parametrize("family", sorted(hf_models.ALL_PACKED))
def test_packed_family_generates_the_same_tokens_at_a_real_tower_shape(family):
    """The tower at a released checkpoint's shape (``hf_models.REAL_VISION``; the tests' small
    text model), four document-sized images and a 16-frame video."""
    torch.manual_seed(0)
    model, note = hf_models.at_real_shape(family, device=DEV, dtype=DT)
    print(f"{family}: {note}")
    grids = hf_models.real_grids(model)
    prompts = hf_models.packed_prompts(family, model, device=DEV, dtype=DT, grids=grids)
    tower = model.get_submodule(hf_models.tower_name(family, model))
    calls = [(p, images) for p in prompts for images in (True, False)
             if ("pixel_values" if images else "pixel_values_videos") in p]
    refs = [_tower_output(family, tower, p, images) for p, images in calls]
    _check_generate(family, model, prompts,
                    logits=family not in hf_models.TEXT_CHOOSES_DISCRETELY)
    vg.serve_vision_(model)
    for (prompt, images), ref in zip(calls, refs):   # the tower's own output, bf16 rounding apart
        out = _tower_output(family, tower, prompt, images)
        err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
        print(f"{family}: tower output on the {'images' if images else 'video'}, relative "
              f"difference {err:.3g}")
        assert err < 5e-2
    vg.restore_vision_(model)


def _tower_output(family, tower, prompt, images):
    """The tower's output on ``prompt``'s images (else its video), as a float tensor, called as
    ``family``'s model calls it."""
    grid = prompt["image_grid_thw" if images else "video_grid_thw"]
    if not images and family in hf_models.VIDEO_AS_FRAMES:
        grid = torch.cat([grid[:, :1] * 0 + 1, grid[:, 1:]], 1).repeat_interleave(grid[:, 0], 0)
    if grid.shape[0] > 1 and "images_per_sample" in prompt:   # GLM-Image: the target's grid
        grid = grid[:-1]
    pixels = prompt["pixel_values" if images else "pixel_values_videos"]
    if pixels.dim() == 3:    # ColQwen2: each image's rows padded to the longest
        pixels = torch.cat([pixels[i, :n] for i, n in enumerate(grid.prod(-1).tolist())])
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid)
    if not isinstance(out, torch.Tensor):
        pooled = getattr(out, "pooler_output", None)
        out = pooled if pooled is not None else out.last_hidden_state
    return out.float()


def _check_generate(family, model, prompts, logits=True):
    """Greedy tokens and logits (``logits``: within bf16 tolerance) with the towers served
    against the unmodified model's."""
    field = hf_models.NO_GENERATE.get(family)   # ColQwen2: its embeddings, no generate()
    refs = [_run(model, p, field) for p in prompts]
    keys = list(model.state_dict())
    vg.serve_vision_(model)
    name = hf_models.tower_name(family, model)
    for prompt, (ref_tokens, ref_scores, ref_out) in zip(prompts, refs):
        tokens, _, out = _run(model, prompt, field)
        err = (out - ref_out).abs().max().item()
        tol = 5e-2 * max(ref_out.abs().max().item(), 1.0)
        print(f"{family}: tokens equal {tokens is None or tokens.tolist() == ref_tokens.tolist()}"
              f", max output difference {err:.3g} (bf16, tolerance {tol:.3g}"
              f"{'' if logits else ', not asserted'})")
        if tokens is not None:
            _assert_same_greedy_tokens(tokens, ref_tokens, ref_scores, tol)
        assert err < tol or not logits
    report = served_towers(model)[name].report()
    print(f"{family}: graphs {report['graphs_captured']}, stats {report['stats']}")
    assert report["cuda_graphs"] and report["stats"]["graph_replays"] >= len(prompts)
    assert report["stats"]["eager_batches"] == 0, report["stats"]["fallback_reasons"]
    assert list(model.state_dict()) == keys
    vg.restore_vision_(model)


def _run(model, prompt, field):
    """``_generate``'s triple; for a model without ``generate()``, ``(None, None, output)``."""
    if field is None:
        return _generate(model, prompt)
    with torch.no_grad():
        return None, None, getattr(model(**prompt), field).float()


def test_llava_generates_the_same_tokens_on_cuda():
    torch.manual_seed(0)
    model = hf_models.llava().to(DEV, DT).eval()
    prompts = [hf_models.llava_prompt(n, seed=n, device=DEV, dtype=DT) for n in (1, 3, 2)]
    refs = [_generate(model, p) for p in prompts]
    vg.serve_vision_(model)
    for prompt, (ref_tokens, ref_scores, ref_logits) in zip(prompts, refs):
        tokens, _, logits = _generate(model, prompt)
        tol = 5e-2 * max(ref_logits.abs().max().item(), 1.0)
        _assert_same_greedy_tokens(tokens, ref_tokens, ref_scores, tol)
        assert (logits - ref_logits).abs().max().item() < tol
    report = vg.report()
    print("llava:", report["compiles"], "compiles,", report["graphs_captured"], "graphs",
          report["stats"])
    assert report["stats"]["graph_replays"] >= 3 and report["stats"]["eager_batches"] == 0
