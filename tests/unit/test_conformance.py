"""``vit_graph_backend.testing.check_adapter``: every built-in adapter keeps its rules on CPU, and
an adapter that breaks one fails naming it (``tests/gpu/test_conformance_gpu.py``: with graphs)."""

from __future__ import annotations

import pytest

from family_towers import FAMILIES  # skips without transformers
from family_towers import tower as family_tower
from qwen_towers import MERGE, PATCH
from vit_graph_backend.adapters import adapt
from vit_graph_backend.specs import EncoderItemSpec
from vit_graph_backend.testing import AdapterCheckError, check_adapter

from hypothesis import HealthCheck, Phase, settings

SMALL = dict(max_side=4 * PATCH * MERGE, max_frames=2, hypothesis_settings=settings(
    max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck)))
# a broken adapter fails at its first call: no shrinking to a smaller one
BROKEN = dict(SMALL, hypothesis_settings=settings(
    max_examples=2, deadline=None, database=None, phases=[Phase.generate]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_built_in_adapter_keeps_the_rules(family):
    check_adapter(family_tower(family), **dict(SMALL, max_frames=FAMILIES[family][2]))


def _family(name):
    return family_tower(name)


def test_an_item_that_sees_its_batch_mates_breaks_alone():
    tower = _family("qwen2")

    class Leaky(type(adapt(tower))):
        def encoder_eager_forward(self, inputs, item_indices):
            out = super().encoder_eager_forward(inputs, item_indices)
            return out + out.mean(0, keepdim=True)  # every row reads every other

    with pytest.raises(AdapterCheckError, match="rule 'eager'|rule 'alone'"):
        check_adapter(tower, Leaky(tower), **BROKEN)


def test_a_spec_with_the_wrong_frame_count_breaks_specs():
    tower = _family("qwen2")

    class WrongFrames(type(adapt(tower))):
        def get_encoder_cudagraph_item_specs(self, inputs):
            return [EncoderItemSpec(s.input_size, s.output_tokens, s.frames + 1)
                    for s in super().get_encoder_cudagraph_item_specs(inputs)]

    with pytest.raises(AdapterCheckError, match="rule 'specs'"):
        check_adapter(tower, WrongFrames(tower), **BROKEN)


def test_padding_that_reaches_real_rows_breaks_padding():
    tower = _family("qwen2")

    class Spill(type(adapt(tower))):
        def encoder_cudagraph_forward(self, values):
            out = super().encoder_cudagraph_forward(values)
            return out + values["pixel_values"].float().mean() * 1e-3  # padding leaks in

    with pytest.raises(AdapterCheckError, match="rule 'padding'"):
        check_adapter(tower, Spill(tower), **BROKEN)


def test_a_graph_that_differs_from_the_tower_breaks_served():
    tower = _family("qwen2")

    class Off(type(adapt(tower))):
        def encoder_cudagraph_forward(self, values):
            return super().encoder_cudagraph_forward(values) * 1.5

    with pytest.raises(AdapterCheckError, match="rule 'padding'|rule 'served'"):
        check_adapter(tower, Off(tower), **BROKEN)


def test_a_reference_is_needed_for_an_adapter_without_one():
    tower = _family("qwen2")

    class NoReference(type(adapt(tower))):
        encoder_reference_forward = None

    with pytest.raises(TypeError, match="reference="):
        check_adapter(tower, NoReference(tower))


def test_a_clamped_mlp_keeps_the_towers_own_where_padded_copies_are_asked_for():
    # GLM-5.3 clamps gate and up (swiglu_limit); padded copies and the fused gate have no clamp
    from vit_graph_backend import VitGraphOptions

    tower = family_tower("glm5_next")
    for block in tower.blocks:
        block.mlp.swiglu_limit = 0.05   # the clamp bites on most rows
    adapter = adapt(tower, align_mlp=True)
    assert adapter.kernels.aligned is None and adapter.align_mlp is False
    check_adapter(tower, options=VitGraphOptions(align_mlp=True), **dict(SMALL, max_frames=1))
