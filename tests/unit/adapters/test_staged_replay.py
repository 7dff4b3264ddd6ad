"""The Qwen adapters' staged replay inputs (``adapters/_qwen_packing.py``): a batch's host-side
metadata is made once per (call's grids, batch's items, budget) and reused under one stamp, while
its pixel rows always come from the call at hand, in caller order (window-order towers gather them
in the graph).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLVisionConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

from vit_graph_backend.adapters import adapt  # noqa: E402
from vit_graph_backend.adapters import packing as _qwen_packing  # noqa: E402
from vit_graph_backend.adapters.packing import ROW_INDEX  # noqa: E402
from vit_graph_backend.adapters.staging import BLOCK  # noqa: E402
from vit_graph_backend.errors import UnsupportedGraphError  # noqa: E402
from vit_graph_backend.runtime.capture import BudgetGraph  # noqa: E402
from vit_graph_backend.protocol import StampedBuffers  # noqa: E402
from vit_graph_backend.runtime.replay_io import write_inputs  # noqa: E402

PATCH = 2
PATCH_DIM = 3 * 2 * PATCH * PATCH
CPU = torch.device("cpu")


def _adapter(window: bool):
    torch.manual_seed(0)
    if window:  # Qwen2.5-VL: rows gathered into window order
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
            depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
            patch_size=PATCH, window_size=2 * 2 * PATCH, fullatt_block_indexes=[1]))
    else:  # Qwen2-VL: rows taken as a contiguous range
        tower = Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
            depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=PATCH))
    return adapt(tower.eval(), min_budget=4, max_budget=48)


def _inputs(grids, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return {"pixel_values": torch.randn(rows, PATCH_DIM, generator=gen),
            "grid_thw": torch.tensor(grids, dtype=torch.long)}


@pytest.mark.parametrize("window", [True, False], ids=["window order", "contiguous"])
def test_same_grids_reuse_the_metadata_but_take_the_new_pixels(window):
    adapter = _adapter(window)
    budget = 32
    static = adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU,
                                                              torch.float32)
    grids = [(1, 4, 6), (1, 2, 2), (1, 4, 4)]
    first_inputs, second_inputs = _inputs(grids, seed=1), _inputs(grids, seed=2)
    first = adapter.prepare_encoder_cudagraph_replay_buffers(first_inputs, [1, 2], budget)
    second = adapter.prepare_encoder_cudagraph_replay_buffers(second_inputs, [1, 2], budget)
    assert isinstance(first, StampedBuffers) and set(first) == {"pixel_values"}
    assert second.stamp is first.stamp  # staged once: the runtime may skip the metadata
    loaded = first.load()  # the whole block, of the static block's layout
    assert loaded.keys() == {BLOCK} and BLOCK in static
    for key, value in second.load().items():
        assert torch.equal(value, loaded[key]) and value.shape == static[key].shape, key
    entry = BudgetGraph(budget, static)
    write_inputs(entry, first)
    assert (ROW_INDEX in static) == window
    # the pixel rows are each call's own, the items back to back in caller order (rows 4..
    # 24 of the source); what the graph reads after its gather is what the eager path reads
    for inputs, values in ((first_inputs, first), (second_inputs, second)):
        assert torch.equal(values["pixel_values"], inputs["pixel_values"][24:44])
        rows = values["pixel_values"]
        if window:
            index = static[ROW_INDEX]
            assert torch.equal(index[20:], torch.arange(20, index.shape[0]))  # pads: own rows
            rows = rows.index_select(0, index[:20])
        exact, _ = adapter.packer.eager_values(inputs, [1, 2])
        assert torch.equal(rows, exact["pixel_values"])
    # other items of the same call, or another budget, are staged on their own
    other = adapter.prepare_encoder_cudagraph_replay_buffers(first_inputs, [0, 1], budget)
    assert other.stamp is not first.stamp
    assert torch.equal(other["pixel_values"], first_inputs["pixel_values"][:28])


def test_items_out_of_source_order_are_joined_in_batch_order():
    adapter = _adapter(window=False)
    budget = 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    inputs = _inputs([(1, 4, 6), (1, 2, 2), (1, 4, 4)], seed=3)
    values = adapter.prepare_encoder_cudagraph_replay_buffers(inputs, [2, 0], budget)
    pixels = inputs["pixel_values"]
    assert torch.equal(values["pixel_values"], torch.cat([pixels[28:44], pixels[:24]]))
    exact, _ = adapter.packer.eager_values(inputs, [2, 0])
    assert torch.equal(values["pixel_values"], exact["pixel_values"])


def test_a_budget_captured_again_gets_metadata_padded_to_its_new_shapes():
    adapter = _adapter(window=True)
    grids, budget = [(1, 4, 6)], 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    adapter.prepare_encoder_cudagraph_capture_inputs(16, 3, None, CPU, torch.float32)
    first = adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, 0), [0], budget)
    other = adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, 0), [0], 16)
    packer = adapter.packer
    packer._keep(("record", (), 32), _staged_with_record(40))  # as a GPU record would count
    assert packer.staged_bytes == 40 and len(packer._staged) == 3
    static = adapter.prepare_encoder_cudagraph_capture_inputs(budget, 2, None, CPU,
                                                               torch.float32)
    # the budget's staged batches (and their records) are dropped at once; others stay
    assert [key[2] for key in packer._staged] == [16] and packer.staged_bytes == 0
    assert packer._staged[next(iter(packer._staged))] is other.stamp
    second = adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, 0), [0], budget)
    assert second.stamp is not first.stamp
    first_blocks, second_blocks = first.load(), second.load()
    assert second_blocks.keys() == {BLOCK} and second_blocks[BLOCK].shape == static[BLOCK].shape
    assert first_blocks[BLOCK].shape != second_blocks[BLOCK].shape


def test_staged_batches_are_bounded_and_a_refused_batch_is_not_staged(monkeypatch):
    monkeypatch.setattr(_qwen_packing, "STAGED_BATCHES", 3)
    adapter = _adapter(window=True)
    budget = 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    for side in (2, 4, 6, 8, 10):
        grids = [(1, 4, side)]
        adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(grids, side), [0], budget)
    assert len(adapter.packer._staged) == 3
    too_big = [(1, 20, 20)]  # 100 tokens
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(UnsupportedGraphError, match="100 tokens, more than budget 32"):
            adapter.prepare_encoder_cudagraph_replay_buffers(_inputs(too_big, 0), [0], budget)
    assert all(key[0] != tuple(too_big) for key in adapter.packer._staged)


@pytest.mark.parametrize("window", [True, False], ids=["window order", "contiguous"])
def test_served_calls_load_a_batch_once_and_match_the_tower(window, monkeypatch, padded_cpu):
    """Through the runtime (no CUDA: the same write and run path without graphs): calls that
    alternate between two batches on one budget reload the metadata at each switch, repeated
    ones do not, and every output is the tower's own."""
    from vit_graph_backend import serve
    from vit_graph_backend.adapters import staging as _staging

    loads = []
    pinned = _staging.HostStage.pinned

    def counted(self, device, whole=False):
        loads.append(whole)
        return pinned(self, device, whole)

    monkeypatch.setattr(_staging.HostStage, "pinned", counted)
    adapter = _adapter(window)
    served = serve(adapter, min_budget=32, max_budget=32, max_items_per_graph=2)
    first, second = [(1, 4, 8)], [(1, 4, 4), (1, 2, 4)]  # 8 and 6 tokens: one budget, 32
    pattern = [first, first, second, second, first, second, second]
    with torch.no_grad():
        for seed, grids in enumerate(pattern):
            inputs = _inputs(grids, seed)
            out = served(inputs["pixel_values"], inputs["grid_thw"])
            expected = adapter.tower(inputs["pixel_values"], grid_thw=inputs["grid_thw"])
            expected = getattr(expected, "pooler_output", expected)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert served.manager.stats.no_graph_items == 11 and not served.manager.stats.eager_items
    assert loads == [True] * 4  # first, second, first, second: one load per switch, in blocks


class _Record:
    """Stands in for a batch's device record on a machine without a GPU."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.device, self.marked = nbytes, torch.device("cuda", 0), []

    def numel(self) -> int:
        return self.nbytes

    def record_stream(self, stream) -> None:
        self.marked.append(stream)


def _staged_with_record(nbytes: int, stream: int = 7):
    stage = _qwen_packing.HostStage({"a": torch.ones(2)}, {"a": (2,)})
    return _qwen_packing._Staged(stage, ((0, 2),), {}, True, torch.device("cuda", 0),
                                 _Record(nbytes), stream)


def test_device_records_are_bounded_by_their_bytes(monkeypatch):
    """The kept batches' GPU records hold at most ``STAGED_DEVICE_BYTES`` together: the least
    recent go first, a batch staged again replaces its old record, and the count is reported."""
    monkeypatch.setattr(_qwen_packing, "STAGED_DEVICE_BYTES", 100)
    adapter = _adapter(window=False)
    packer = adapter.packer
    for key in "abc":
        packer._keep(key, _staged_with_record(40))
    assert list(packer._staged) == ["b", "c"] and packer.staged_bytes == 80
    assert adapter.staged_metadata_bytes == 80
    packer._keep("c", _staged_with_record(10))  # staged again (e.g. after a recapture)
    assert list(packer._staged) == ["b", "c"] and packer.staged_bytes == 50
    packer._keep("d", _staged_with_record(200))  # over the bound alone: kept, the rest dropped
    assert list(packer._staged) == ["d"] and packer.staged_bytes == 200


def test_a_record_read_on_another_stream_is_marked_for_the_allocator(monkeypatch):
    """A load on the stream the record was made on is the record itself, nothing marked; on
    another stream the record is marked with ``record_stream`` (its memory must not be handed
    out again before that stream's copy ran)."""
    staged = _staged_with_record(8, stream=7)
    streams = iter([7, 9])
    monkeypatch.setattr(_qwen_packing, "current_raw_stream", lambda index: next(streams))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "side stream")
    assert staged.load() == {BLOCK: staged.record} and staged.record.marked == []
    assert staged.load() == {BLOCK: staged.record} and staged.record.marked == ["side stream"]


def test_no_record_is_made_over_the_bound_or_without_gpu_memory(monkeypatch):
    """A stage larger than the bound, or one whose record finds no GPU memory, is kept without
    a record: each load then copies a pinned block (``HostStage.pinned``)."""
    adapter = _adapter(window=True)
    budget = 32
    adapter.prepare_encoder_cudagraph_capture_inputs(budget, 3, None, CPU, torch.float32)
    packer, cuda = adapter.packer, torch.device("cuda", 0)
    shapes = packer.captured_shapes[budget]
    monkeypatch.setattr(_qwen_packing, "STAGED_DEVICE_BYTES", 0)
    assert packer._stage([(1, 4, 6)], [0], budget, shapes, cuda).record is None
    monkeypatch.setattr(_qwen_packing, "STAGED_DEVICE_BYTES", 1 << 20)

    def no_memory(self, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(_qwen_packing.HostStage, "on_device", no_memory)
    staged = packer._stage([(1, 4, 6)], [0], budget, shapes, cuda)
    assert staged.record is None and staged.whole and staged.device == cuda
