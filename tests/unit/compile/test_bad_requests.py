"""A bad request costs a compiled or served encoder nothing (CPU; the GPU twin is
``tests/gpu/test_bad_requests_gpu.py``).

Each property drives one compiled (or served) encoder through a Hypothesis-drawn sequence of good
and bad calls (``tests/bad_requests.py``): every call must do what eager does, raise where
eager raises and answer eager's numbers where it answers. The encoder is shared by all of a
test's examples, so the sequences of every example follow each other: a bad call early breaks
every later call if it breaks the encoder.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import bad_requests as br  # noqa: E402
import vit_graph_backend  # noqa: E402
from vit_graph_backend.compile.backend import vitgraph  # noqa: E402

# The encoder under test carries its state from one example to the next, so a shrunk sequence
# would not replay the failure: no shrinking, and the failing draws are printed as they came.
SEQUENCES = settings(max_examples=3, deadline=None, derandomize=True,
                     phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])
CALLS = st.integers(3, 6)

BATCHED = {"hf_vit": lambda: br.hf_vit(False), "hf_vit_interpolate": lambda: br.hf_vit(True),
           "hf_clip": br.hf_clip, "hf_siglip": br.hf_siglip, "timm_vit": br.timm_vit}


@pytest.fixture(scope="module", params=sorted(BATCHED))
def batched(request):
    if request.param == "timm_vit":
        pytest.importorskip("timm", exc_type=ImportError)
    spec = BATCHED[request.param]()
    model = spec.build()
    return spec, model, torch.compile(model, backend="vitgraph")


@SEQUENCES
@given(data=st.data())
def test_any_sequence_of_calls_of_a_compiled_encoder_matches_eager(batched, data):
    spec, model, compiled = batched
    with torch.inference_mode():
        for _ in range(data.draw(CALLS, label="calls")):
            kind, pixels = br.batched_call(data, spec, "cpu", torch.float32)
            expected = br.outcome(lambda: spec.call(model, pixels))
            br.assert_same_outcome(kind, expected, br.outcome(lambda: spec.call(compiled, pixels)),
                                   atol=1e-4, rtol=1e-4)
        # whatever came before, the compiled encoder still serves (a frame Dynamo skipped after
        # a bad call runs uncompiled: right numbers, but nothing served from graphs again)
        good = torch.randn(2, 3, spec.sizes[0], spec.sizes[0])
        spec.call(compiled, good)   # the first good call after a bad one may run its parts eagerly
        before = _served_calls()
        spec.call(compiled, good)
        assert _served_calls() > before, "the compiled encoder no longer serves calls"


def _served_calls() -> int:
    return sum(e.stats.calls + sum(m.stats.calls for m in e.managers) for e in vitgraph.encoders)


def test_a_bad_call_leaves_the_graphs_that_served_before_serving_after():
    """Dynamo marks a frame skipped when a call raises while it traces it; the backend re-arms
    the frame, so the graph sets that served before the bad call serve the good calls after it
    (all but the first, which runs the split-off parts eagerly)."""
    spec = br.hf_vit(False)
    model = spec.build()
    compiled = torch.compile(model, backend="vitgraph")
    with torch.inference_mode():
        for batch in (3, 2, 3):
            compiled(pixel_values=torch.randn(batch, 3, 32, 32))
        dynamic = [e for e in vitgraph.encoders if not e.static_shape]
        assert len(dynamic) == 1
        served_before = dynamic[0].stats.calls + sum(m.stats.calls for m in dynamic[0].managers)
        with pytest.raises(ValueError, match="doesn't match model"):
            compiled(pixel_values=torch.randn(3, 3, 48, 48))
        for batch in (4, 2, 3):
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(compiled(pixel_values=x).last_hidden_state,
                                       model(pixel_values=x).last_hidden_state)
    served_after = dynamic[0].stats.calls + sum(m.stats.calls for m in dynamic[0].managers)
    assert served_after - served_before >= 2


@pytest.fixture(scope="module")
def packed():
    from qwen_towers import PATCH_DIM, _qwen2_5

    from toy_encoders import randomize_weights

    tower = randomize_weights(_qwen2_5(), 0).eval()
    return tower, vit_graph_backend.serve(tower, max_items_per_graph=2), PATCH_DIM


@SEQUENCES
@given(data=st.data())
def test_any_sequence_of_calls_of_a_served_tower_matches_eager(packed, data):
    tower, served, patch_dim = packed
    with torch.inference_mode():
        for _ in range(data.draw(CALLS, label="calls")):
            kind, pixels, grid = br.packed_call(data, patch_dim, "cpu", torch.float32)
            got = br.outcome(lambda: served(pixels, grid))
            if kind in ("empty", "rows", "patch_dim", "grid_zero", "grid_shape"):
                # the served tower names the input before any graph runs
                assert isinstance(got[0], vit_graph_backend.InvalidInputError), (kind, got)
                continue
            if kind == "nan":
                # which items a NaN pixel reaches depends on how items are packed together
                # (masked attention weights of 0 times NaN): only later calls are checked
                assert got[0] is None, got[0]
                continue
            expected = br.outcome(lambda: br.packed_items(tower, pixels, grid))
            br.assert_same_outcome(kind, expected, got, atol=1e-4, rtol=1e-4)
