"""`EncoderCudaGraphManager` on CPU with a toy packed encoder: routing, padding, per-item outputs
in caller order, eager fallbacks with reasons, verification, NaN-poisoned static buffers."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from toy_encoders import (PaddedSegToyEncoder, ToyPackedEncoder, Wrapper,
                          fill_static_floats_with_nan, run_alone)
import logging

from vit_graph_backend.errors import InvalidInputError, InvalidOptionError
from vit_graph_backend.options import VitGraphOptions
from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

MBS = 4


def _setup(verify=False, policy="baseline"):
    torch.manual_seed(0)
    model = PaddedSegToyEncoder(dim=8, budget_range=(8, 64), max_batch_size=MBS).eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS, verify=verify,
                                                         policy=policy), pad_without_graphs=True)
    return model, mgr


def _call(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(sum(lengths), 8, generator=g), "lengths": list(lengths)}


@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=9),
       policy=st.sampled_from(["baseline", "exact"]))
@torch.no_grad()
def test_items_come_back_in_order_equal_to_runningrun_alone(lengths, policy):
    model, mgr = _setup(policy=policy)
    inputs = _call(lengths)
    got = mgr.run(inputs)
    assert len(got) == len(lengths)
    for g, r in zip(got, run_alone(model, inputs)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    stats = mgr.stats
    assert stats.graph_items + stats.no_graph_items + stats.eager_items == len(lengths)
    assert stats.eager_items >= sum(n > 64 for n in lengths)
    if policy == "baseline":
        assert stats.eager_items == sum(n > 64 for n in lengths)
    else:
        assert stats.padded_tokens == 0


@torch.no_grad()
def test_oversize_item_is_eager_and_counted_with_reason():
    model, mgr = _setup()
    mgr.run(_call([100, 3]))
    stats = mgr.stats.as_dict()
    assert stats["eager_items"] == 1 and stats["graph_items"] + stats["no_graph_items"] == 1
    assert stats["fallback_reasons"] == {"item exceeds the largest budget": 1}
    assert stats["batches_per_budget"] == {"8": 1} and stats["padded_tokens"] == 5


@torch.no_grad()
def test_exact_policy_fallback_names_its_own_reason():
    model, mgr = _setup(policy="exact")
    assert 9 not in mgr.config.budgets and 8 in mgr.config.budgets and mgr.config.max_budget == 64
    mgr.run(_call([9]))      # fits a budget, but none equals 9: eager under the exact policy
    mgr.run(_call([8]))      # equals budget 8: replayed
    mgr.run(_call([100]))    # larger than every budget
    stats = mgr.stats.as_dict()
    assert stats["fallback_reasons"] == {"exact policy: no budget equals the batch's tokens": 1,
                                         "item exceeds the largest budget": 1}
    assert stats["batches_per_budget"] == {"8": 1}


@torch.no_grad()
def test_nan_poisoned_static_buffers_leave_outputs_equal():
    model, mgr = _setup()
    inputs = _call([5, 11, 3])
    clean = mgr.run(inputs)
    fill_static_floats_with_nan(mgr)
    poisoned = mgr.run(inputs)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


@torch.no_grad()
def test_verify_catches_padding_that_leaks_into_real_tokens():
    torch.manual_seed(0)
    model = ToyPackedEncoder(dim=8).eval()  # zero-padded seg ids: padding joins item 0
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS, verify=True), pad_without_graphs=True)
    inputs = _call([5, 9])
    with pytest.warns(RuntimeWarning, match=r"verification failed: max relative error"):
        got = mgr.run(inputs)
    for g, r in zip(got, run_alone(model, inputs)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert 16 not in mgr.token_budgets
    # without verify the same wrong padding would have changed item 0: the check is needed
    mgr2 = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    assert not torch.allclose(mgr2.run(inputs)[0], run_alone(model, inputs)[0], atol=1e-4)


@torch.no_grad()
def test_verify_passes_a_correct_encoder_silently():
    model, mgr = _setup(verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr.run(_call([5, 9]))
    assert all(e.verified for e in mgr.graphs.entries.values())


def test_grad_required_runs_eagerly():
    model, mgr = _setup()
    out = mgr.run(_call([5, 9]))
    assert out[0].grad_fn is not None
    assert mgr.stats.fallback_reasons["grad required (graphs serve inference; use torch.no_grad())"] == 1


def test_graph_unsupported_reason_disables_graphs():
    model, _ = _setup()
    model.graph_unsupported_reason = lambda: "config feature X"
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    with torch.no_grad():
        mgr.run(_call([5, 9]))
    assert mgr.token_budgets == () and mgr.get_num_graphs_to_capture() == 0
    assert mgr.stats.fallback_reasons == {"config feature X": 1}


def test_chunk_needs_the_segment_api():
    model, _ = _setup()
    with pytest.raises(InvalidOptionError, match="chunk=True needs"):
        EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), chunk=True, pad_without_graphs=True)


def test_cpu_manager_captures_no_graphs_and_reports_it():
    model, mgr = _setup()
    assert mgr.get_num_graphs_to_capture() == 0 and not mgr.uses_cuda_graphs
    mgr.capture()
    assert mgr.num_graphs == 0
    report = mgr.memory_report()
    assert report["graphs"] == 0 and report["pool_bytes"] == 0


class _PickyToy(PaddedSegToyEncoder):
    """Rejects calls flagged bad, as an adapter rejects a malformed grid, inside the replay."""

    def prepare_encoder_cudagraph_replay_buffers(self, inputs, item_indices, budget):
        if inputs.get("bad"):
            raise InvalidInputError("x has 20 rows, grid has 16: they must agree")
        return super().prepare_encoder_cudagraph_replay_buffers(inputs, item_indices, budget)


@torch.no_grad()
def test_a_bad_call_raises_and_costs_the_graphs_nothing():
    model = _PickyToy(dim=8, budget_range=(8, 64), max_batch_size=MBS).eval()
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    with pytest.raises(InvalidInputError, match="20 rows"):
        mgr.run({**_call([16]), "bad": True})
    assert mgr.memory_report()["disabled_budgets"] == {}
    assert 16 in mgr.token_budgets and mgr.stats.eager_batches == 0
    inputs = _call([16])
    (got,) = mgr.run(inputs)
    torch.testing.assert_close(got, run_alone(model, inputs)[0], atol=1e-5, rtol=1e-5)
    assert mgr.stats.as_dict()["batches_per_budget"] == {"16": 1}


@torch.no_grad()
def test_each_fallback_reason_is_logged_once_at_warning(caplog):
    _, mgr = _setup()
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend.runtime.manager"):
        for _ in range(3):
            mgr.run(_call([100]))   # over the largest budget (64)
    hits = [r for r in caplog.records if "running a batch eagerly" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.WARNING
    assert "item exceeds the largest budget" in hits[0].getMessage()
    assert mgr.stats.eager_batches == 3


@torch.no_grad()
def test_a_manager_follows_its_encoder_to_new_weight_storage(caplog):
    """The manager checks its encoder's weights (``weights.py``), so a packed encoder run
    by a manager directly, not only through ``serve()``, never replays graphs over freed
    storage: new storage on the same dtype captures again, another dtype turns graphs off."""
    model, mgr = _setup()
    call = _call([5, 9])
    mgr.run(call)
    assert mgr.graphs.entries
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()}, assign=True)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        out = mgr.run(call)
    assert "captured again" in caplog.text
    expected = run_alone(model, call)
    for got, ref in zip(out, expected, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    model.to(torch.float64)
    mgr.run({**call, "x": call["x"].double()})
    assert "moved (cpu, torch.float64)" in mgr.memory_report()["graphs_off_reason"]


@torch.no_grad()
def test_a_manager_follows_a_wrapper_subclass_weight_to_new_storage(caplog):
    """A weight that is a wrapper tensor subclass (a quantized weight, say): the graphs read the
    tensor it holds, so new storage there captures again, though the weight itself, its table
    and its own ``data_ptr()`` stay the same."""
    model, mgr = _setup()
    model.lin2.weight = torch.nn.Parameter(Wrapper(model.lin2.weight.detach().clone()),
                                           requires_grad=False)
    mgr = EncoderCudaGraphManager(model, VitGraphOptions(max_items_per_graph=MBS), pad_without_graphs=True)
    call = _call([5, 9])
    mgr.run(call)
    model.lin2.weight.inner = model.lin2.weight.inner * 2
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        out = mgr.run(call)
    assert "captured again" in caplog.text
    for got, ref in zip(out, run_alone(model, call), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_manager_follows_one_weight_written_to_its_table(caplog, monkeypatch):
    """One weight, not the first, written to its module's table (accelerate's way): captured
    again; the same with a device the weights were not on before: graphs off, saying where."""
    model, mgr = _setup()
    call = _call([5, 9])
    mgr.run(call)
    name, param = list(model.named_parameters())[-1]
    owner = model.get_submodule(name.rpartition(".")[0])
    owner._parameters[name.rpartition(".")[2]] = torch.nn.Parameter(param * 3)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        out = mgr.run(call)
    assert "captured again" in caplog.text
    for got, ref in zip(out, run_alone(model, call), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # a CPU machine has one device: an offload's other device is stood in for by another dtype
    owner._parameters[name.rpartition(".")[2]] = torch.nn.Parameter((param * 2).double())
    with pytest.raises(RuntimeError, match="same dtype"):   # eagerly, as the model itself does
        mgr.run(call)
    assert "moved (cpu, torch.float64)" in mgr.memory_report()["graphs_off_reason"]


def test_a_budget_is_captured_with_the_encoder_s_device_current(monkeypatch):
    """The warm-up's timed choices and the capture follow the current device
    (``gpu_timing.graph_ms``): ``_capture_budget`` makes the encoder's device current for them,
    whichever device the caller has current (on two GPUs: ``tests/gpu/test_graph_runtime_gpu.py``)."""
    import contextlib

    from vit_graph_backend.runtime.capture import CaptureOutcome

    _, mgr = _setup()
    current = []

    @contextlib.contextmanager
    def device(d):
        current.append(d)
        yield
        current.pop()

    seen = []
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(mgr.graphs, "capture",
                        lambda budget: seen.append(list(current)) or CaptureOutcome(skipped="x"))
    mgr._capture_budget(mgr.token_budgets[0])
    assert seen == [[mgr.device]]
