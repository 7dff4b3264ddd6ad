"""The Qwen adapters' item specs, kept by grid between calls (``adapters/_qwen_packing.py``): every
call's specs are those of its grids, whichever grids earlier calls had and however often the table
was emptied. The expected sizes are written out here from the towers' layout, not read from the
adapter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from vit_graph_backend.adapters import packing as _qwen_packing  # noqa: E402
from vit_graph_backend.adapters.inputs import PackedCall  # noqa: E402
from vit_graph_backend.specs import EncoderItemSpec  # noqa: E402

from qwen_towers import FAST, MERGE, PATCH_DIM  # noqa: E402
from qwen_towers import towers  # noqa: E402, F401 (a fixture)

#: a few sizes, so calls repeat grids and share some of t, h or w
_GRIDS = st.tuples(st.sampled_from([1, 2]), st.sampled_from([2, 4, 6]), st.sampled_from([2, 4]))


def _expected(t: int, h: int, w: int) -> EncoderItemSpec:
    # rows: every patch of every frame; tokens: after the MERGE x MERGE merge
    return EncoderItemSpec(t * h * w, t * (h // MERGE) * (w // MERGE), t)


@FAST
@given(calls=st.lists(st.lists(_GRIDS, min_size=1, max_size=3), min_size=1, max_size=6),
       kept=st.sampled_from([1, 2, 4096]), as_rows=st.booleans())
def test_each_call_gets_the_specs_of_its_own_grids(towers, calls, kept, as_rows):
    _, adapter = towers["qwen2_5"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_qwen_packing, "KEPT_SPECS", kept)
        adapter.packer._specs.clear()  # the fixture's adapter is shared by every example
        for grids in calls:
            rows = sum(t * h * w for t, h, w in grids)
            pixels = torch.zeros(rows, PATCH_DIM)
            grid = torch.tensor(grids).reshape(-1, 3)
            # a list grid's rows come as tuples (serve()), a tensor's are read from it
            inputs = PackedCall(pixels, grid, [tuple(g) for g in grids] if as_rows else None)
            specs = adapter.get_encoder_cudagraph_item_specs(inputs)
            assert specs == [_expected(*g) for g in grids]
            assert len(adapter.packer._specs) <= kept


def test_rows_given_as_lists_are_served_too(towers):
    _, adapter = towers["qwen2_5"]
    inputs = PackedCall(torch.zeros(16, PATCH_DIM), torch.tensor([[1, 4, 4]]), [[1, 4, 4]])
    assert adapter.get_encoder_cudagraph_item_specs(inputs) == [_expected(1, 4, 4)]
