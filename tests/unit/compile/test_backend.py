"""The ``vitgraph`` backend on CPU: real encoders (random weights, small configs) compiled with
``backend="vitgraph"`` equal eager for a random stream of batch sizes, with at most three Dynamo
compiles; fallbacks; options errors at compile time; entry-point discovery; reset.

On CPU the runtime runs the same plan -> pad -> run -> slice path as on CUDA, without graphs, so
these tests exercise routing and padding for real. CUDA capture is covered in tests/gpu.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from vit_graph_backend.compile.backend import VitGraphBackend, vitgraph
from vit_graph_backend.errors import InvalidOptionError

ATOL = 1e-4


def _timm_vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                             depth=2, num_classes=10)


def _hf(kind):
    tr = pytest.importorskip("transformers")
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    if kind == "clip":
        return tr.CLIPVisionModel(tr.CLIPVisionConfig(**common))
    if kind == "siglip":
        return tr.SiglipVisionModel(tr.SiglipVisionConfig(**common))
    if kind == "dinov2":
        return tr.Dinov2Model(tr.Dinov2Config(**common))
    raise ValueError(kind)


MODELS = {
    "timm_vit": _timm_vit,
    "hf_clip": lambda: _hf("clip"),
    "hf_siglip": lambda: _hf("siglip"),
    "hf_dinov2": lambda: _hf("dinov2"),
}


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]
    return [t for t in out if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_compiled_encoder_matches_eager_with_at_most_three_compiles(name, padded_cpu):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    compiled = torch.compile(model, backend="vitgraph", options={"max_budget": 8})
    rng = random.Random(1)
    sizes = [3, 5, 1] + [rng.randint(1, 20) for _ in range(5)] + [17]  # 17 > largest budget
    worst = 0.0
    for b in sizes:
        x = torch.randn(b, 3, 32, 32)
        for got, ref in zip(_tensors(compiled(x)), _tensors(model(x)), strict=True):
            assert got.shape == ref.shape
            worst = max(worst, (got - ref).abs().max().item())
    assert worst < ATOL, f"max abs error {worst}"
    report = vitgraph.report()
    assert report["compiles"] <= 3, report
    stats = report["stats"]
    assert stats["eager_items"] == 0, stats  # oversize calls are chunked, not run eagerly
    assert stats["batches_per_budget"].get("8", 0) >= 2  # the 17-row call went through 8-row chunks


@torch.no_grad()
def test_static_first_compile_is_served_exactly():
    torch.manual_seed(0)
    model = _timm_vit().eval()
    compiled = torch.compile(model, backend="vitgraph")
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=0)
    report = vitgraph.report()
    assert report["compiles"] == 1
    stats = report["stats"]
    # one exact-shape batch of the call's 4 real rows: no budget, no padding
    assert (stats["exact_shape_batches"], stats["real_tokens"], stats["padded_tokens"]) == (1, 4, 0)
    assert stats["batches_per_budget"] == {}
    assert stats["graph_replays"] + stats["no_graph_batches"] == 1


def _counting_inner(monkeypatch):
    """Count the inner compiles the backend asks for; each returns the traced graph itself
    (what runs inside is not under test here, only when it is compiled)."""
    import vit_graph_backend.compile.backend as backend_module

    compiled = []

    def fake_compile_inner(gm, example_inputs, options):
        compiled.append([x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor)
                         and tuple(x.shape[1:]) == (3, 32, 32)])  # the images' batch
        return gm

    monkeypatch.setattr(backend_module, "compile_inner", fake_compile_inner)
    return compiled


@pytest.mark.parametrize("sizes, compiled_for", [
    # a stream of sizes: the first (static) graph, made at 3, is replaced by the dynamic graph
    # (made at 5, compiled at once) at the second call, and is never compiled
    ([3, 5, 7, 3], [[5]]),
    # one size again and again: the static graph is compiled at its second call, once
    ([4, 4, 4], [[4]]),
    # a batch of 1 beside the dynamic graph (Dynamo specializes size 1 apart): never compiled,
    # so no call in the middle of the stream stalls on a compile
    ([3, 5, 1, 7, 1, 1], [[5]]),
    # the first call a batch of 1 and the stream going on: the same
    ([1, 6, 1, 1], [[6]]),
])
@torch.no_grad()
def test_static_graph_gets_the_inner_compiler_at_its_second_call(monkeypatch, sizes,
                                                                  compiled_for):
    compiled = _counting_inner(monkeypatch)
    torch.manual_seed(0)
    model = _hf("clip").eval()
    fn = torch.compile(model, backend=vitgraph, options={"inner_compiler": "inductor"})
    for b in sizes:
        x = torch.randn(b, 3, 32, 32)
        for got, ref in zip(_tensors(fn(x)), _tensors(model(x)), strict=True):
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert compiled == compiled_for


@torch.no_grad()
def test_deferred_inductor_compile_runs_outside_dynamo():
    # The deferred compile happens inside a call of the compiled frame, not in Dynamo's compile:
    # Inductor must compile there too, and its graph must then serve the calls.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4)).eval()
    fn = torch.compile(model, backend=vitgraph, options={"inner_compiler": "inductor"})
    x = torch.randn(4, 8)
    torch.testing.assert_close(fn(x), model(x))
    assert vitgraph.encoders[0].compile_pending
    for _ in range(2):
        torch.testing.assert_close(fn(x), model(x))
    encoder = vitgraph.encoders[0]
    assert not encoder.compile_pending
    assert not isinstance(encoder.fn, torch.fx.GraphModule)  # Inductor's callable, not the trace


def test_eager_inner_compiler_is_never_deferred(monkeypatch):
    compiled = _counting_inner(monkeypatch)
    torch.manual_seed(0)
    model = _hf("clip").eval()
    fn = torch.compile(model, backend=vitgraph, options={"inner_compiler": "eager"})
    with torch.no_grad():
        fn(torch.randn(2, 3, 32, 32))
    assert compiled == [[2]]  # compiled (as itself) at once
    assert not vitgraph.encoders[0].compile_pending


def test_grad_required_runs_eagerly_with_gradients(caplog):
    torch.manual_seed(0)
    model = _timm_vit().eval()
    compiled = torch.compile(model, backend="vitgraph")
    caplog.set_level(logging.WARNING, logger="vit_graph_backend")
    for b in (3, 5):
        x = torch.randn(b, 3, 32, 32)
        out = compiled(x)
        out.sum().backward()  # autograd works: the call ran eagerly
        assert out.grad_fn is not None
    assert any("grad required" in r.getMessage() for r in caplog.records)
    assert vitgraph.report()["stats"]["eager_items"] >= 1


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class _Mutates(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x + 1


class _MixesRows(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True), x.sum(0)


@pytest.mark.parametrize("module,reason", [
    (_Dropout().train(), "training-mode op"),
    (_Mutates(), "in-place write to graph input"),
    (_MixesRows(), "does not carry the batch axis"),
])
def test_unservable_graphs_fall_back_to_eager_with_reason(module, reason, caplog):
    caplog.set_level(logging.WARNING, logger="vit_graph_backend")
    compiled = torch.compile(module, backend="vitgraph")
    with torch.no_grad():
        for b in (3, 5, 6):
            torch.manual_seed(b)
            x = torch.randn(b, 4)
            got = compiled(x.clone())
            torch.manual_seed(b)
            ref = module(x.clone())
            if not isinstance(module, _Dropout):  # dropout is random; check shape only
                for g, r in zip(_tensors(got), _tensors(ref)):
                    torch.testing.assert_close(g, r)
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


@torch.no_grad()
def test_replaced_parameter_is_seen_and_recaptured(caplog):
    caplog.set_level(logging.WARNING, logger="vit_graph_backend")
    model = _Scaled().eval()
    compiled = torch.compile(model, backend="vitgraph")
    for b in (3, 5):
        compiled(torch.randn(b, 4))
    model.lin.weight = torch.nn.Parameter(torch.randn(4, 4))  # new storage, same shape
    x = torch.randn(5, 4)
    torch.testing.assert_close(compiled(x), model(x))
    assert any("changed address" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("options,match", [
    ({"budget": [4]}, r"unknown vitgraph option 'budget' \(did you mean 'budgets'\?\)"),
    ({"max_budget": 0}, r"max_budget=0 is invalid"),
    ({"policy": "greedy"}, r"policy='greedy' is invalid: must be one of"),
    ({"inner_compiler": "tvm"}, r"inner_compiler='tvm' is invalid"),
])
def test_bad_options_raise_at_compile_time(options, match):
    compiled = torch.compile(_Scaled(), backend="vitgraph", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, 4))
    # Dynamo wraps backend errors; the original InvalidOptionError is the cause.
    err = info.value
    while not isinstance(err, InvalidOptionError):
        nxt = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
        if nxt is None:
            break
        err = nxt
    assert isinstance(err, InvalidOptionError) and isinstance(err, ValueError)
    assert pytest.importorskip("re").search(match, str(err)), str(err)


@pytest.mark.parametrize("name", ["max_items_per_graph", "max_frames_per_batch"])
def test_packed_only_options_are_refused_for_batched_graphs(name):
    # they used to be validated and then silently dropped on the batched path
    gm = torch.fx.symbolic_trace(_Scaled())
    with pytest.raises(InvalidOptionError, match=rf"{name}=2 does not apply to torch.compile"
                       r".*serve\(model, " + name):
        VitGraphBackend()(gm, [torch.randn(2, 4)], options={name: 2})


def test_backend_rejects_unknown_keyword():
    with pytest.raises(InvalidOptionError, match="unexpected arguments"):
        VitGraphBackend()(torch.fx.symbolic_trace(_Scaled()), [torch.randn(2, 4)], foo=1)


def test_reset_frees_encoders():
    compiled = torch.compile(_Scaled(), backend="vitgraph")
    with torch.no_grad():
        compiled(torch.randn(3, 4))
    assert vitgraph.report()["compiles"] == 1
    torch.compiler.reset()  # calls vitgraph.reset()
    assert vitgraph.report()["compiles"] == 0
    assert vitgraph.report()["stats"]["calls"] == 0


def test_entry_point_works_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        import sys, torch
        assert "vit_graph_backend" not in sys.modules
        m = torch.nn.Linear(4, 4).eval()
        c = torch.compile(m, backend="vitgraph")
        with torch.no_grad():
            for b in (3, 5, 1):
                x = torch.randn(b, 4)
                torch.testing.assert_close(c(x), m(x))
        import vit_graph_backend.compile.backend as be
        assert be.register() is False  # already registered through the entry point
        print("OK", be.vitgraph.report()["compiles"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("OK")


@pytest.mark.slow
def test_register_is_guarded_after_import_too():
    code = textwrap.dedent("""
        import torch
        import vit_graph_backend.compile.backend as be   # importing registers nothing
        assert be.register() is False            # the entry point already names it
        c = torch.compile(torch.nn.Linear(2, 2), backend="vitgraph")
        with torch.no_grad():
            c(torch.randn(3, 2))
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_budgets_share_one_row_buffer_and_memory_counts_it_once(padded_cpu):
    torch.compiler.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU()).eval()
    compiled = torch.compile(model, backend="vitgraph", options={"capture": "lazy"})
    with torch.no_grad():
        for b in (2, 3, 7, 5, 9, 32):  # static first call, then the dynamic graph's budgets
            x = torch.randn(b, 6)
            torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=0)
    dynamic = [e for e in vitgraph.encoders if not e.static_shape]
    (manager,) = dynamic[0].managers
    rows = {b: g.static for b, g in manager.graphs.entries.items()}
    assert len(rows) >= 3, rows.keys()
    storages = {t.untyped_storage().data_ptr() for s in rows.values() for t in s.values()}
    assert len(storages) == 1, "every budget's row buffer is a view of one buffer"
    largest = max(rows)
    assert manager.memory_report()["static_input_bytes"] == largest * 6 * 4
