"""``batch_invariant=True``: an item's output is bit-identical alone and in any batch or packing,
and from one process to the next (``VitGraphOptions.batch_invariant``).

Needs a GPU: every test (module-level ``gpu`` mark); in bf16, where kernels chosen per shape
would show.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import vit_graph_backend  # noqa: E402

pytestmark = pytest.mark.gpu

FEW = settings(max_examples=12, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_CLIP = """
import hashlib, sys, torch
from transformers import CLIPVisionConfig, CLIPVisionModel
torch.manual_seed(0)
model = CLIPVisionModel(CLIPVisionConfig(hidden_size=256, intermediate_size=1024,
    num_hidden_layers=4, num_attention_heads=4, image_size=224, patch_size=16)).cuda()
model = model.to(torch.bfloat16).eval()
"""


def _clip():
    scope: dict = {}
    exec(_CLIP, scope)  # noqa: S102 - the same model here and in the subprocess below
    return scope["model"]


@pytest.fixture(scope="module")
def compiled():
    model = _clip()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pixels = torch.randn(24, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=gen)
    return torch.compile(model, backend="vitgraph", options={"batch_invariant": True}), pixels


@FEW
@given(rows=st.lists(st.integers(0, 23), min_size=1, max_size=12, unique=True),
       position=st.integers(0, 11))
def test_a_row_is_the_same_bits_alone_and_anywhere_in_any_batch(compiled, rows, position):
    fn, pixels = compiled
    row = rows[min(position, len(rows) - 1)]
    with torch.inference_mode():
        alone = fn(pixel_values=pixels[row:row + 1]).last_hidden_state[0]
        batch = fn(pixel_values=pixels[rows]).last_hidden_state[rows.index(row)]
    assert torch.equal(alone, batch)
    assert vit_graph_backend.report()["graphs_captured"] > 0


def test_two_processes_give_the_same_bits():
    script = _CLIP + """
fn = torch.compile(model, backend="vitgraph", options={"batch_invariant": True})
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(13, 3, 224, 224, device="cuda", dtype=torch.bfloat16, generator=gen)
with torch.inference_mode():
    outs = [fn(pixel_values=x[:b]).last_hidden_state for b in (1, 5, 13, 5)]
print(hashlib.sha256(b"".join(o.float().cpu().numpy().tobytes() for o in outs)).hexdigest())
"""
    digests = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=600, check=True).stdout.split()[-1] for _ in range(2)]
    assert digests[0] == digests[1]


@pytest.fixture(scope="module")
def served():
    from packed_towers import PATCH_DIM, _tower

    tower = _tower("qwen2_5")
    return vit_graph_backend.serve(tower, max_items_per_graph=4, batch_invariant=True), PATCH_DIM


@FEW
@given(others=st.lists(st.tuples(st.integers(2, 12), st.integers(2, 12)), max_size=3),
       position=st.integers(0, 3))
def test_an_image_is_the_same_bits_alone_and_in_any_packing(served, others, position):
    tower, patch_dim = served
    gen = torch.Generator(device="cuda").manual_seed(7)
    image = torch.randn(16 * 20, patch_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    sides = [(2 * h, 2 * w) for h, w in others]
    position = min(position, len(sides))
    sides.insert(position, (16, 20))
    pixels = [image if (h, w) == (16, 20) and i == position else
              torch.randn(h * w, patch_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
              for i, (h, w) in enumerate(sides)]
    with torch.inference_mode():
        alone = tower(image, [[1, 16, 20]])
        packed = tower(torch.cat(pixels), [[1, h, w] for h, w in sides])
    start = sum(h * w // 4 for h, w in sides[:position])
    assert torch.equal(alone, packed[start:start + 80])
