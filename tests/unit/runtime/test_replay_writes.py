"""What a replay writes into a budget's static buffers (``replay_io.write_inputs``): every row
the graph reads holds this call's value or zero, while rows already zero and buffers already in
place (``StampedBuffers`` of the same stamp) are not written again."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vit_graph_backend.runtime.capture import BudgetGraph
from vit_graph_backend.protocol import StampedBuffers
from vit_graph_backend.runtime.replay_io import copy_padded, head_copy, write_inputs

ROWS = 12


def _entry() -> BudgetGraph:
    static = {"x": torch.full((ROWS, 3), float("nan")), "meta": torch.full((5,), -7)}
    return BudgetGraph(ROWS, static)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, ROWS), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_every_write_leaves_the_value_then_zeros(lengths, seed):
    """Whatever the sequence of lengths, the buffer after each write is the value and zeros:
    the rows a shorter earlier write left zero are not written, the others are."""
    gen = torch.Generator().manual_seed(seed)
    static = {"x": torch.full((ROWS, 3), float("nan"))}  # garbage a capture could leave
    dirty: dict[str, int] = {}
    for n in lengths:
        value = torch.randn(n, 3, generator=gen) + 1.0
        copy_padded(static, "x", value, dirty)
        expected = torch.cat([value, torch.zeros(ROWS - n, 3)])
        assert torch.equal(static["x"], expected), n


def test_rows_known_to_be_zero_are_not_zeroed_again_until_forgotten():
    entry = _entry()
    write_inputs(entry, {"x": torch.ones(4, 3)})
    assert not entry.static["x"][4:].any()
    entry.static["x"][8:].fill_(5.0)  # behind the runtime's back: it believes these are zero
    write_inputs(entry, {"x": torch.ones(6, 3)})
    assert not entry.static["x"][6:8].any() and (entry.static["x"][8:] == 5).all()
    entry.forget_inputs()  # what the stress suite's poisoning does after writing NaN
    write_inputs(entry, {"x": torch.ones(6, 3)})
    assert not entry.static["x"][6:].any()


def test_full_shape_writes_make_every_row_dirty():
    entry = _entry()
    write_inputs(entry, {"x": torch.ones(ROWS, 3)})
    write_inputs(entry, {"x": torch.ones(2, 3)})
    assert not entry.static["x"][2:].any()


def test_stamped_buffers_are_loaded_only_when_not_in_place():
    entry = _entry()
    loads = []

    def stamped(stamp, meta):
        def load():
            loads.append(stamp)
            return {"meta": meta}
        return StampedBuffers({"x": torch.ones(3, 3)}, stamp, load)

    first, second = object(), object()
    write_inputs(entry, stamped(first, torch.arange(5)))
    assert torch.equal(entry.static["meta"], torch.arange(5)) and loads == [first]
    assert entry.written == {"x", "meta"}  # loaded keys count as written (the poisoning reads it)
    write_inputs(entry, stamped(first, torch.arange(5)))
    assert loads == [first]  # in place already
    write_inputs(entry, stamped(second, torch.arange(5) * 2))
    assert torch.equal(entry.static["meta"], torch.arange(5) * 2) and loads == [first, second]
    write_inputs(entry, {"x": torch.ones(3, 3), "meta": torch.arange(5)})  # a plain dict
    write_inputs(entry, stamped(second, torch.arange(5) * 2))  # the dict overwrote them
    assert torch.equal(entry.static["meta"], torch.arange(5) * 2) and loads[-1] is second
    assert len(loads) == 3
    entry.forget_inputs()
    write_inputs(entry, stamped(second, torch.arange(5) * 2))
    assert len(loads) == 4


def test_a_failed_load_leaves_no_stamp():
    entry = _entry()
    stamp = object()
    bad = StampedBuffers({"x": torch.ones(1, 3)}, stamp, lambda: {"meta": torch.ones(9)})
    with pytest.raises(ValueError, match="does not fit"):
        write_inputs(entry, bad)
    assert entry.stamp is None
    good = StampedBuffers({"x": torch.ones(1, 3)}, stamp, lambda: {"meta": torch.ones(5)})
    write_inputs(entry, good)
    assert entry.stamp is stamp and (entry.static["meta"] == 1).all()


def test_merged_gives_every_buffer():
    values = StampedBuffers({"x": torch.ones(1)}, object(), lambda: {"meta": torch.zeros(2)})
    merged = values.merged()
    assert type(merged) is dict and merged.keys() == {"x", "meta"}


def test_views_of_one_block_are_always_zeroed_to_their_end():
    """A block and its views are written both ways (whole, or a view at a time): a view's
    non-zero rows cannot be tracked, so a short write to it zeroes its whole tail."""
    block = torch.zeros(10, dtype=torch.int32)
    static = {"block": block, "a": block[:6], "b": block[6:], "x": torch.zeros(4, 2)}
    entry = BudgetGraph(4, static)
    assert entry.aliased_keys() == {"block", "a", "b"}
    write_inputs(entry, {"a": torch.tensor([1, 2], dtype=torch.int32)})
    write_inputs(entry, {"block": torch.arange(1, 11, dtype=torch.int32)})  # every row non-zero
    write_inputs(entry, {"a": torch.tensor([7, 8, 9], dtype=torch.int32)})
    assert static["a"].tolist() == [7, 8, 9, 0, 0, 0] and static["b"].tolist() == [7, 8, 9, 10]
    write_inputs(entry, {"x": torch.ones(3, 2)})  # a buffer of its own is still tracked
    assert entry.dirty == {"x": 3}


def test_budgets_viewing_one_row_buffer_zero_their_whole_tails():
    """Batched graphs' budgets view one row buffer (``batched.py``): a budget's write puts rows
    where another budget believed zeros were. Marked aliased over all budgets, every short write
    zeroes to its end, so no budget's padding holds another's rows."""
    from vit_graph_backend.runtime.capture import _aliased

    buffer = torch.zeros(16, 2)
    small, large = BudgetGraph(8, {"0": buffer[:8]}), BudgetGraph(16, {"0": buffer[:16]})
    marks = _aliased({8: small, 16: large})
    assert marks == {8: frozenset({"0"}), 16: frozenset({"0"})}
    small._aliased, large._aliased = marks[8], marks[16]
    write_inputs(large, {"0": torch.ones(2, 2)})
    write_inputs(small, {"0": torch.full((6, 2), 3.0)})  # rows 2..6 of the large view too
    write_inputs(large, {"0": torch.ones(2, 2)})
    assert not buffer[2:].any()
    alone = BudgetGraph(8, {"0": torch.zeros(8, 2)})
    assert not alone.aliased_keys() and not _aliased({8: alone})[8]


def test_the_memory_bound_reads_free_memory_after_releasing_cached_blocks(monkeypatch):
    """``max_graph_memory=0.6`` is 60 % of the free memory at the first capture, blocks the
    allocator holds cached counted as free: they are released before the reading (the warm-up
    releases them a moment later anyway), so kernel timings or earlier calls that left blocks
    cached do not shrink the bound."""
    from vit_graph_backend.runtime.capture import GraphMemory

    cached = {"bytes": 600}
    events = []

    def empty_cache():
        events.append("empty_cache")
        cached["bytes"] = 0

    def mem_get_info(device=None):
        events.append("mem_get_info")
        return 1000 - cached["bytes"], 4000

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    memory = GraphMemory(limit_option=0.6)
    assert memory.resolve_limit(torch.device("cuda"), held=100) == int(0.6 * (1000 + 100))
    assert events == ["empty_cache", "mem_get_info"]
    assert memory.resolve_limit(torch.device("cuda"), held=500) == 660  # resolved once
    assert GraphMemory(limit_option=1 << 20).resolve_limit(torch.device("cuda"), 0) == 1 << 20
    assert events == ["empty_cache", "mem_get_info"]  # a byte bound reads nothing


@pytest.mark.parametrize(("error", "skipped"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),   # a library's own allocation
    (RuntimeError("a host sync inside the forward"), False)])
def test_a_warm_up_out_of_memory_skips_the_budget_whatever_class_says_so(monkeypatch, error,
                                                                          skipped):
    """Memory running out in the warm-up skips the budget with the reason (a later clear()
    tries it again), whether PyTorch or a library's CUDA call raised it; any other failure
    propagates (``errors.out_of_memory``)."""
    from vit_graph_backend.runtime import capture as graph_capture

    def warmup(*args):
        raise error

    monkeypatch.setattr(graph_capture, "_warmup", warmup)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 20, 8 << 30))

    def capture():
        return graph_capture.capture_budget_graph(
            64, lambda static: None, {}, pool=None, device=torch.device("cuda"),
            warmup_iters=2, memory=graph_capture.GraphMemory(), held=0, new_static=0)

    if skipped:
        outcome = capture()
        assert outcome.skipped.startswith("warm-up: out of memory (")
        assert outcome.skipped.endswith("; 3.0 MiB free after it") and outcome.oom
    else:
        with pytest.raises(RuntimeError, match="host sync"):
            capture()


@pytest.mark.parametrize("kind", [torch.Tensor, tuple, list])
def test_a_replay_output_head_is_copied_out_of_the_static_output(kind):
    """The runtime returns ``head_copy`` of a graph's static output, which the next replay
    overwrites: the copy holds the first rows of each tensor and shares no storage with them."""
    static = [torch.arange(ROWS * 2.0).reshape(ROWS, 2), torch.arange(ROWS * 1.0)]
    out = static[0] if kind is torch.Tensor else kind(static)
    head = head_copy(out, 5)
    heads = [head] if kind is torch.Tensor else head
    assert type(head) is (torch.Tensor if kind is torch.Tensor else kind)
    expected = [torch.arange(10.0).reshape(5, 2), torch.arange(5.0)][:len(heads)]
    for tensor in static:
        tensor.fill_(-1.0)  # the next replay
    assert len(heads) == len(expected)
    for got, want in zip(heads, expected):
        assert torch.equal(got, want)
