"""``serve_vision_`` on whole Hugging Face VLMs on a GPU, in bf16 (marked ``gpu``).

The same tiny random models as ``tests/unit/integrations/test_hf_serve_vision.py`` (``tests/hf_models.py``,
every packed family), on CUDA in bfloat16: greedy tokens of ``generate()`` with two images and a video equal the
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
    prompts = hf_models.packed_prompts(family, model, device=DEV, dtype=DT)
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
              f", max output difference {err:.3g} (bf16, tolerance {tol:.3g})")
        if tokens is not None:
            _assert_same_greedy_tokens(tokens, ref_tokens, ref_scores, tol)
        assert err < tol
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
