"""The checks a manager runs after a call's first graph launch (``call_checks.py``): hooks and
weight copies, looked at while the GPU works, with the call served eagerly or replayed again
when one fails; and before any Python that runs in this process (the forward without a graph).

A CPU has no graphs, so a stand-in (``_Graph``) replays the encoder's graph forward where a
captured graph would be: functional code over a copy of a weight, running no module hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_encoders import PaddedSegToyEncoder, run_alone

from vit_graph_backend.errors import StaleWeightCopiesError
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.runtime import EncoderCudaGraphManager

MBS = 4


@pytest.fixture(autouse=True)
def _both_check_paths(check_paths):
    """Every test here, with the native checks' loops and with the Python checks alone."""


class _CopyToy(PaddedSegToyEncoder):
    """The toy encoder whose graph forward reads a copy of ``lin2.weight`` (as the Qwen adapters'
    graphs read padded MLP copies), brought up to date by its refresh; it records what ran."""

    def __init__(self) -> None:
        super().__init__(dim=8, budget_range=(8, 64), max_batch_size=MBS)
        self.events: list[str] = []
        self.copy = self.lin2.weight.detach().clone()

    def refresh_encoder_cudagraph_weights(self) -> bool:
        self.events.append("refresh")
        if torch.equal(self.copy, self.lin2.weight):
            return False
        self.copy.copy_(self.lin2.weight)
        return True

    def encoder_cudagraph_forward(self, values):
        self.events.append("forward")
        x, seg, n = values["x"], values["seg"], values["slots"].shape[0]
        h = F.linear(x, self.lin1.weight, self.lin1.bias)   # no module call: no hook runs
        sums = h.new_zeros(n, self.dim).index_add_(0, seg, h)
        counts = h.new_zeros(n).index_add_(0, seg, torch.ones_like(h[:, 0]))
        mean = sums / counts.clamp(min=1).unsqueeze(1)
        return F.linear(torch.relu(h + mean[seg]), self.copy, self.lin2.bias)


class _Graph:
    """Stands in for a captured graph: a replay writes the graph forward's output in place."""

    def __init__(self, model: _CopyToy, entry) -> None:
        self.model, self.entry = model, entry

    def replay(self) -> None:
        self.model.events.append("launch")
        self.entry.output.copy_(self.model.encoder_cudagraph_forward(self.entry.static))


def _call(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(sum(lengths), 8, generator=g), "lengths": list(lengths)}


def _served(lengths, toy=_CopyToy):
    """A manager over the toy whose budgets for ``lengths`` hold stand-in graphs."""
    torch.manual_seed(0)
    model = toy().eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    mgr.run(_call(lengths))   # makes the budgets' static buffers
    for entry in mgr.graphs.entries.values():
        entry.output = model.encoder_cudagraph_forward(entry.static).clone()
        entry.graph = _Graph(model, entry)
    model.events.clear()
    return model, mgr


def _assert_eager_equal(out, model, call):
    for got, ref in zip(out, run_alone(model, call), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_checks_run_once_a_call_after_its_first_launch():
    lengths = [5, 9, 3, 7, 4, 6]          # more items than a graph holds: two batches
    model, mgr = _served(lengths)
    out = mgr.run(_call(lengths))
    assert model.events == ["launch", "forward", "refresh", "launch", "forward"]
    _assert_eager_equal(out, model, _call(lengths))


@torch.no_grad()
def test_a_hook_found_after_the_launch_gives_the_eager_result():
    """The graph was launched before the hook was seen: its output is dropped and the call runs
    eagerly, where the hook runs; without the hook the graphs serve again."""
    lengths = [5, 9]
    model, mgr = _served(lengths)
    call = _call(lengths)
    plain = mgr.run(call)
    handle = model.lin2.register_forward_hook(lambda m, a, o: o + 1.0)
    replays, eager = mgr.stats.graph_replays, mgr.stats.eager_batches
    model.events.clear()
    try:
        out = mgr.run(call)
        assert model.events == ["launch", "forward"]   # no refresh: the call runs eagerly
        assert mgr.stats.graph_replays == replays and mgr.stats.eager_batches == eager + 1
        _assert_eager_equal(out, model, call)
        torch.testing.assert_close(out[0], plain[0] + 1.0, atol=1e-5, rtol=1e-5)
    finally:
        handle.remove()
    torch.testing.assert_close(mgr.run(call)[1], plain[1], atol=0, rtol=0)
    assert mgr.stats.graph_replays == replays + 1


@torch.no_grad()
def test_copies_found_behind_after_the_launch_are_replayed_again():
    """A weight written in place: the first launch read the old copy; the refresh after it
    copies, and the call replays again, so the output is the new weight's."""
    lengths = [5, 9]
    model, mgr = _served(lengths)
    call = _call(lengths)
    stale = mgr.run(call)
    model.lin2.weight.mul_(-2.0)
    model.events.clear()
    out = mgr.run(call)
    assert model.events == ["launch", "forward", "refresh", "launch", "forward"]
    _assert_eager_equal(out, model, call)
    assert not torch.allclose(out[0], stale[0])
    model.events.clear()
    mgr.run(call)    # current now: one launch
    assert model.events == ["launch", "forward", "refresh"]


@torch.no_grad()
def test_the_forward_without_a_graph_waits_for_the_checks():
    """Without a graph the forward over the static buffers is Python that runs here: the copies
    are refreshed first, and with a hook inside it does not run at all (the hook would fire for
    a result thrown away)."""
    torch.manual_seed(0)
    model = _CopyToy().eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    call = _call([5, 9])
    model.lin2.weight.mul_(0.5)
    _assert_eager_equal(mgr.run(call), model, call)
    assert model.events == ["refresh", "forward"]
    calls = []
    handle = model.lin2.register_forward_hook(lambda m, a, o: calls.append(1))
    model.events.clear()
    try:
        out = mgr.run(call)
        assert model.events == [] and calls == [1]   # one eager batch of both items
        _assert_eager_equal(out, model, call)
    finally:
        handle.remove()


@torch.no_grad()
@pytest.mark.parametrize("lengths", [[5, 9, 3, 7, 4, 6], [70, 5]],
                         ids=["two graph batches", "an item over every budget first"])
def test_a_call_whose_checks_fail_runs_once_as_one_eager_batch(lengths):
    """Found after a launch, or before an eager batch's Python, a hook makes the whole call one
    eager batch, as the model runs a call: the hook sees it once, with every item."""
    model, mgr = _served(lengths)
    call = _call(lengths)
    rows = []
    handle = model.lin2.register_forward_hook(lambda m, a, o: rows.append(o.shape[0]))
    eager = mgr.stats.eager_batches
    try:
        out = mgr.run(call)
        assert rows == [sum(lengths)] and mgr.stats.eager_batches == eager + 1
        _assert_eager_equal(out, model, call)
    finally:
        handle.remove()


class _FollowedToy(_CopyToy):
    """The copy toy that says its graphs read ``lin2.weight`` only through the copy (as the
    Qwen adapters' graphs read padded MLP copies), and whose copy stops following on demand
    (pinned copies of weights moved to another dtype)."""

    answer = True
    follows = True

    def get_encoder_cudagraph_copied_weights(self):
        return [(self.lin2, "weight")] if self.answer else []

    def refresh_encoder_cudagraph_weights(self) -> bool:
        if not self.follows:
            self.events.append("refresh")
            raise StaleWeightCopiesError("lin2.weight moved elsewhere")
        return super().refresh_encoder_cudagraph_weights()


@torch.no_grad()
def test_new_storage_of_a_copied_weight_is_left_to_its_copy():
    """After a capture, the watch leaves the copied weight to the refresh: new storage for it
    is followed by the copy after the launch (the call replays again), not by capturing again."""
    lengths = [5, 9]
    model, mgr = _served(lengths, _FollowedToy)
    mgr.checks.captured()   # as the runtime does after each capture
    graphs = dict(mgr.graphs.entries)
    call = _call(lengths)
    stale = mgr.run(call)
    model.lin2.weight.data = model.lin2.weight * -2.0
    model.events.clear()
    out = mgr.run(call)
    assert model.events == ["launch", "forward", "refresh", "launch", "forward"]
    assert mgr.graphs.entries == graphs   # nothing captured again
    _assert_eager_equal(out, model, call)
    assert not torch.allclose(out[0], stale[0])


@torch.no_grad()
def test_a_weight_read_directly_by_any_graph_is_watched_again():
    """The watch leaves out only what every graph captured since it was made reads through
    copies: one capture that reads the weight directly puts it back for good."""
    model, mgr = _served([5, 9], _FollowedToy)
    mgr.checks.captured()
    model.answer = False
    mgr.checks.captured()
    model.answer = True
    mgr.checks.captured()
    model.lin2.weight.data = model.lin2.weight * -2.0
    assert mgr.checks.moved()


@torch.no_grad()
def test_copies_that_cannot_follow_give_the_eager_result_and_the_graphs_are_dropped():
    lengths = [5, 9]
    model, mgr = _served(lengths, _FollowedToy)
    mgr.checks.captured()
    graphs, call = mgr.num_graphs, _call(lengths)
    model.follows = False
    model.events.clear()
    out = mgr.run(call)
    assert model.events == ["launch", "forward", "refresh"]   # the launch's result dropped
    _assert_eager_equal(out, model, call)
    assert mgr.checks.moved() and mgr.num_graphs == graphs >= 1   # dropped at the next call
    model.follows = True
    _assert_eager_equal(mgr.run(call), model, call)
    assert not mgr.checks.moved()
    assert not any(isinstance(e.graph, _Graph) for e in mgr.graphs.entries.values())


@settings(deadline=None, max_examples=60)
@given(steps=st.lists(st.tuples(st.booleans(), st.sampled_from(["none", "data", "table"])),
                      min_size=1, max_size=6))
@torch.no_grad()
def test_moved_exactly_when_a_weight_some_graph_reads_directly_has_another_address(steps):
    """Captures that in turn read ``lin2.weight`` only through the copy or directly, with new
    storage given to it between them: the check says "moved" exactly when some capture since
    the watch was made read it directly and it is not where it was when the watch was made."""
    torch.manual_seed(0)
    model = _FollowedToy().eval()
    checks = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True).checks
    first, direct, kept = model.lin2.weight.data_ptr(), False, []
    for through_copy, change in steps:
        model.answer = through_copy
        checks.captured()
        direct |= not through_copy
        if change == "data":
            kept.append(model.lin2.weight.data)   # held: no address reused
            model.lin2.weight.data = model.lin2.weight * 2.0
        elif change == "table":
            kept.append(model.lin2.weight)
            model.lin2._parameters["weight"] = torch.nn.Parameter(model.lin2.weight * 2.0)
        assert checks.moved() == (direct and model.lin2.weight.data_ptr() != first)
