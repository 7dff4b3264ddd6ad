"""A bad request costs a compiled or served encoder nothing, on CUDA with graphs (the CPU twin is
``tests/unit/compile/test_bad_requests.py``, which says how the sequences are drawn).

Needs a GPU: every test (module-level ``gpu`` mark). Batched encoders run in float32 so that a
graph's answer must equal eager's to float32 rounding; the served Qwen2.5-VL tower runs in bf16
(its graphs need flash varlen), compared item by item with the tower's own forward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import bad_requests as br  # noqa: E402
import vit_graph_backend  # noqa: E402

pytestmark = pytest.mark.gpu

SEQUENCES = settings(max_examples=4, deadline=None, derandomize=True,
                     phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
CALLS = st.integers(4, 8)
BATCHED = {"hf_vit": lambda: br.hf_vit(False), "hf_vit_interpolate": lambda: br.hf_vit(True),
           "hf_clip": br.hf_clip, "hf_siglip": br.hf_siglip, "timm_vit": br.timm_vit}


@pytest.fixture(scope="module", params=sorted(BATCHED))
def batched(request):
    if request.param == "timm_vit":
        pytest.importorskip("timm", exc_type=ImportError)
    spec = BATCHED[request.param]()
    model = spec.build().cuda()
    return spec, model, torch.compile(model, backend="vitgraph")


@SEQUENCES
@given(data=st.data())
def test_any_sequence_of_calls_of_a_compiled_encoder_matches_eager(batched, data):
    spec, model, compiled = batched
    with torch.inference_mode():
        for _ in range(data.draw(CALLS, label="calls")):
            kind, pixels = br.batched_call(data, spec, "cuda", torch.float32)
            expected = br.outcome(lambda: spec.call(model, pixels))
            br.assert_same_outcome(kind, expected, br.outcome(lambda: spec.call(compiled, pixels)),
                                   atol=2e-3, rtol=2e-3)
    assert vit_graph_backend.report()["graphs_captured"] > 0


@pytest.fixture(scope="module")
def packed():
    from packed_towers import PATCH_DIM, _tower

    tower = _tower("qwen2_5")
    return tower, vit_graph_backend.serve(tower, max_items_per_graph=2), PATCH_DIM


@SEQUENCES
@given(data=st.data())
def test_any_sequence_of_calls_of_a_served_tower_matches_eager(packed, data):
    tower, served, patch_dim = packed
    with torch.inference_mode():
        for _ in range(data.draw(CALLS, label="calls")):
            kind, pixels, grid = br.packed_call(data, patch_dim, "cuda", torch.bfloat16)
            got = br.outcome(lambda: served(pixels, grid))
            if kind in ("empty", "rows", "patch_dim", "grid_zero", "grid_shape"):
                assert isinstance(got[0], vit_graph_backend.InvalidInputError), (kind, got)
                continue
            if kind == "nan":
                assert got[0] is None, got[0]
                continue
            expected = br.outcome(lambda: br.packed_items(tower, pixels, grid))
            br.assert_same_outcome(kind, expected, got, atol=5e-2, rtol=5e-2)
    assert served.report()["graphs_captured"] > 0
