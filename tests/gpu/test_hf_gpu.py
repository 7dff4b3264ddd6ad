"""``serve_vision_`` on whole Hugging Face VLMs on a GPU, in bf16 (marked ``gpu``).

The same tiny random models as ``tests/unit/test_hf_serve_vision.py`` (``tests/hf_models.py``),
on CUDA in bfloat16: greedy tokens of ``generate()`` with two images and a video equal the
unmodified model's, logits within bf16 tolerance (the largest difference is printed), and every
image and video batch replays a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_models  # noqa: E402
import vit_graph_backend as vg  # noqa: E402
from vit_graph_backend.hf import served_towers  # noqa: E402

pytestmark = pytest.mark.gpu

DEV, DT = "cuda", torch.bfloat16


def _generate(model, prompt):
    with torch.no_grad():
        return (model.generate(**prompt, max_new_tokens=8, do_sample=False),
                model(**prompt).logits.float())


@pytest.mark.parametrize("family", sorted(hf_models.PACKED))
def test_packed_family_generates_the_same_tokens_on_cuda(family):
    torch.manual_seed(0)
    model = hf_models.PACKED[family]().to(DEV, DT).eval()
    prompt = hf_models.packed_prompt(family, model, device=DEV, dtype=DT)
    ref_tokens, ref_logits = _generate(model, prompt)
    keys = list(model.state_dict())
    vg.serve_vision_(model)
    tokens, logits = _generate(model, prompt)
    report = served_towers(model)["model.visual"].report()
    err = (logits - ref_logits).abs().max().item()
    print(f"{family}: tokens equal {tokens.tolist() == ref_tokens.tolist()}, max logit "
          f"difference {err:.3g} (bf16), graphs {report['graphs_captured']}, stats "
          f"{report['stats']}")
    assert tokens.tolist() == ref_tokens.tolist()
    assert err < 5e-2 * max(ref_logits.abs().max().item(), 1.0)
    assert report["cuda_graphs"] and report["stats"]["graph_replays"] >= 2
    assert report["stats"]["eager_batches"] == 0, report["stats"]["fallback_reasons"]
    assert list(model.state_dict()) == keys
    vg.restore_vision_(model)


def test_llava_generates_the_same_tokens_on_cuda():
    torch.manual_seed(0)
    model = hf_models.llava().to(DEV, DT).eval()
    prompts = [hf_models.llava_prompt(n, seed=n, device=DEV, dtype=DT) for n in (1, 3, 2)]
    refs = [_generate(model, p) for p in prompts]
    vg.serve_vision_(model)
    for prompt, (ref_tokens, ref_logits) in zip(prompts, refs):
        tokens, logits = _generate(model, prompt)
        assert tokens.tolist() == ref_tokens.tolist()
        assert (logits - ref_logits).abs().max().item() < 5e-2 * max(
            ref_logits.abs().max().item(), 1.0)
    report = vg.report()
    print("llava:", report["compiles"], "compiles,", report["graphs_captured"], "graphs",
          report["stats"])
    assert report["stats"]["graph_replays"] >= 3 and report["stats"]["eager_batches"] == 0
