"""Every wrapper of `_compat` resolves on the installed torch: a PyTorch release that moves a
private API fails here, loudly, rather than in a user's call."""

from __future__ import annotations

import inspect

import pytest
import torch

from vit_graph_backend import _compat


def test_example_value_and_sym_name_read_dynamo_metadata():
    seen = {}

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                value = _compat.example_value(node)
                assert value is not None, f"no example_value on {node.name}"
                if isinstance(value, torch.Tensor):
                    seen.setdefault("dim0", []).append(_compat.sym_name(value.shape[0]))
        return gm

    f = torch.compile(lambda x: x * 2, backend=backend)
    f(torch.randn(3, 2))
    f(torch.randn(5, 2))  # recompiles with a symbolic dim 0
    assert seen["dim0"][0] is None
    assert seen["dim0"][-1] is not None and seen["dim0"][-1].startswith("s")


def test_sym_name_rejects_expressions_and_ints():
    assert _compat.sym_name(3) is None


def test_compile_fx_wrapper_compiles():
    def backend(gm, example_inputs):
        return _compat.compile_fx_without_cudagraphs(gm, example_inputs)

    f = torch.compile(lambda x: torch.relu(x) + 1, backend=backend)
    x = torch.randn(4)
    torch.testing.assert_close(f(x), torch.relu(x) + 1)


def _inductor_compile(fn, x):
    """``fn(x)`` compiled afresh by Dynamo and Inductor (through ``_compat``'s compile_fx)."""
    torch._dynamo.reset()
    return torch.compile(fn, backend=lambda gm, inputs: _compat.compile_fx_without_cudagraphs(
        gm, inputs))(x)


def test_compile_cache_counts_count_an_inductor_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    before = _compat.compile_cache_counts()
    _inductor_compile(lambda x: torch.sigmoid(x) * 3, torch.randn(5))
    after = _compat.compile_cache_counts()
    changed = {k for k in after if after[k] != before.get(k, 0)}
    # a fresh cache folder: Inductor's FX graph cache misses, AOTAutograd's saves or misses
    assert "fxgraph_cache_miss" in changed and changed & {"autograd_cache_miss",
                                                          "autograd_cache_saved"}, changed


def test_compile_phase_seconds_grow_with_a_compile(tmp_path, monkeypatch):
    """Dynamo's timers still carry the three keys ``compile_phase_seconds`` reads."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import compilation_time_metrics

    before = _compat.compile_phase_seconds()
    _inductor_compile(lambda x: torch.cos(x) * 5, torch.randn(6))
    after = _compat.compile_phase_seconds()
    assert {_compat._COMPILE_INNER, _compat._USER_COMPILER, _compat._INDUCTOR} <= set(
        compilation_time_metrics), sorted(compilation_time_metrics)
    assert all(after[k] > before[k] for k in ("dynamo", "backend", "inductor")), (before, after)


def test_varlen_attention_is_present():
    assert callable(_compat.get_varlen_attn())


def test_register_dynamo_backend_registers_a_name():
    from torch._dynamo.backends import registry

    name = "vitgraph_compat_probe"
    try:
        _compat.register_dynamo_backend(name, lambda gm, ex: gm)
        assert name in torch.compiler.list_backends(exclude_tags=())
    finally:
        registry._BACKENDS.pop(name, None)
        registry._COMPILER_FNS.pop(name, None)


def test_graph_pool_bytes_signature():
    # CUDA is covered in tests/gpu; here only that the function exists with its contract
    assert callable(_compat.graph_pool_bytes)


def test_maybe_mark_dynamic_makes_the_first_compile_symbolic():
    assert hasattr(torch._dynamo, "maybe_mark_dynamic"), "torch moved maybe_mark_dynamic"
    seen = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                value = _compat.example_value(node)
                if isinstance(value, torch.Tensor):
                    seen.append([_compat.sym_name(s) for s in value.shape])
        return gm

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend=backend)
    x = torch.randn(6, 4)
    _compat.maybe_mark_dynamic(x, 0)
    f(x)
    assert seen[0][0] is not None and seen[0][1] is None, seen


def test_end_failed_capture_names_exist_and_cpu_is_a_no_op():
    # the allocator hooks torch.cuda.use_mem_pool uses; a release that moves them fails here
    assert hasattr(torch._C, "_cuda_endAllocateToPool")
    assert hasattr(torch._C, "_cuda_releasePool")
    assert _compat.end_failed_capture((0, 1), torch.device("cpu")) is False


def test_backed_size_oblivious_flag_is_where_the_wrapper_looks():
    from torch.fx.experimental import _config as fx_config

    before = fx_config.backed_size_oblivious
    try:
        fx_config.backed_size_oblivious = False
        assert _compat.enable_backed_size_oblivious() is True
        assert fx_config.backed_size_oblivious is True
        assert _compat.enable_backed_size_oblivious() is False   # already on: nothing changed
    finally:
        fx_config.backed_size_oblivious = before


def test_addmm_gelu_tanh_is_the_tanh_gelu_of_the_linear_layer_off_cuda():
    """Off CUDA the wrapper takes PyTorch's public ops: there ``torch._addmm_activation``'s GELU
    is the exact one, not the tanh form its CUDA epilogue computes (checked on a GPU in
    ``tests/gpu/test_compat_gpu.py``)."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((24, 32), (48, 32), (48,)))
    y = torch.nn.functional.linear(x, w, b)
    tanh = torch.nn.functional.gelu(y, approximate="tanh")
    torch.testing.assert_close(_compat.addmm_gelu_tanh(x, w, b), tanh)
    op = torch._addmm_activation(b, x, w.t(), use_gelu=True)   # the op's signature still holds
    torch.testing.assert_close(op, torch.nn.functional.gelu(y))
    assert (op - tanh).abs().max() > 1e-4


def test_current_raw_stream_without_the_binding_takes_the_public_route(monkeypatch):
    # CPU-only builds have no torch._C._cuda_getCurrentRawStream (tests/gpu/test_graph_launch_gpu.py
    # checks the binding and its value on CUDA)
    class _Stream:
        cuda_stream = 1234

    asked = []
    monkeypatch.setattr(_compat, "_RAW_STREAM", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: asked.append(index) or _Stream)
    assert _compat.current_raw_stream(3) == 1234 and asked == [3]


def test_parameter_table_is_where_modules_keep_their_parameters():
    lin = torch.nn.Linear(2, 2)
    table = _compat.parameter_table(lin)
    assert table["weight"] is lin.weight and table["bias"] is lin.bias
    lin.weight = torch.nn.Parameter(torch.zeros(2, 2))  # assignment writes the same table
    lin.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, assign=True)
    assert table["weight"] is lin.weight and torch.equal(table["weight"], torch.ones(2, 2))


def test_buffer_table_is_where_modules_keep_their_buffers():
    norm = torch.nn.BatchNorm1d(2)
    table = _compat.buffer_table(norm)
    assert table["running_mean"] is norm.running_mean
    norm.running_mean = torch.zeros(2)  # assignment writes the same table
    norm.load_state_dict({**norm.state_dict(), "running_var": torch.full((2,), 3.0)}, assign=True)
    assert table["running_mean"] is norm.running_mean and table["running_var"] is norm.running_var
    assert torch.equal(table["running_var"], torch.full((2,), 3.0))


def test_forward_hook_tables_are_where_hooks_are_registered():
    lin = torch.nn.Linear(2, 2)
    pre, post = _compat.forward_hook_tables(lin)
    assert not pre and not post
    handles = [lin.register_forward_pre_hook(lambda m, a: None),
               lin.register_forward_hook(lambda m, a, o: None)]
    assert len(pre) == 1 and len(post) == 1
    everywhere = _compat.global_forward_hook_tables()
    assert not any(everywhere)
    handles.append(torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None))
    assert len(everywhere[1]) == 1
    for handle in handles:
        handle.remove()
    assert not pre and not post and not any(everywhere)


def test_hook_handles_made_counts_every_hook_registration():
    lin = torch.nn.Linear(2, 2)
    before = _compat.hook_handles_made()
    handles = [lin.register_forward_hook(lambda m, a, o: None),
               torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)]
    assert _compat.hook_handles_made() == before + 2
    for handle in handles:
        handle.remove()
    assert _compat.hook_handles_made() == before + 2  # removing one makes none


def test_a_backend_sees_the_code_it_compiles_and_the_uncompiled_frames_above_it():
    """The three wrappers behind the backend's re-arming of skipped frames (backend.py): the
    code being compiled, the frames running uncompiled above it, and the undo of a skip."""
    seen = []

    def inner(x):
        return x + 1

    def outer(x):
        if x.shape[0] == 3:
            raise ValueError("three rows")   # Dynamo marks outer skipped: it raised in a trace
        return inner(x) * 2

    def backend(gm, example_inputs):
        seen.append((_compat.compiling_code(), _compat.uncompiled_callers()))
        return gm

    compiled = torch.compile(outer, backend=backend)
    compiled(torch.randn(2))
    assert seen == [(outer.__code__, [])]
    try:
        compiled(torch.randn(3))
    except ValueError:
        pass
    compiled(torch.randn(4, 1))   # outer runs as Python now; inner is compiled on its own
    code, callers = seen[-1]
    assert code is inner.__code__
    assert outer.__code__ in callers
    _compat.rearm_code(outer.__code__)
    seen.clear()
    compiled(torch.randn(5, 1, 1))   # outer is compiled again: a new shape of a frame re-armed
    assert seen and seen[0][0] is outer.__code__


def test_uncompiled_callers_outside_a_compile_is_empty():
    assert _compat.uncompiled_callers() == []
    assert _compat.compiling_code() is None


@pytest.mark.parametrize("route", ["c", "python"])
def test_data_ptrs_equal_compares_the_given_indices(route, monkeypatch):
    if route == "c" and _compat._PTRS_EQUAL is None:
        pytest.skip("this torch build has no torch._C._tensors_data_ptrs_at_indices_equal "
                    "(a CPU-only build; tests/gpu/test_compat_gpu.py checks a CUDA one)")
    if route == "python":
        monkeypatch.setattr(_compat, "_PTRS_EQUAL", None)
    a, b, c = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    tensors = [a, b, c]
    ptrs = [a.data_ptr(), b.data_ptr(), c.data_ptr()]
    assert _compat.data_ptrs_equal(tensors, ptrs, [0, 1, 2]) is True
    tensors[1] = b.clone()
    assert _compat.data_ptrs_equal(tensors, ptrs, [0, 1, 2]) is False
    assert _compat.data_ptrs_equal(tensors, ptrs, [0, 2]) is True   # index 1 not asked
    tensors[2] = None
    with pytest.raises((RuntimeError, TypeError)):
        _compat.data_ptrs_equal(tensors, ptrs, [2])


def test_cuda_builds_have_the_one_call_address_check():
    if torch.version.cuda is None:
        pytest.skip("a CPU-only build of torch lacks the binding; a CUDA build must have it")
    assert _compat._PTRS_EQUAL is torch._C._tensors_data_ptrs_at_indices_equal


def test_nested_region_calls_finds_each_call_of_a_marked_region():
    @torch.compiler.nested_compile_region
    def region(x, w):
        return torch.nn.functional.linear(x, w).relu()

    seen = {}

    def backend(gm, example_inputs):
        seen["calls"] = _compat.nested_region_calls(gm)
        seen["gm"] = gm
        return gm

    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)
    torch.compile(lambda x: region(region(x, w1), w2), backend=backend, fullgraph=True)(
        torch.randn(2, 8))
    (name, calls), = seen["calls"].items()   # one region's graph, called twice
    assert len(calls) == 2
    graph = seen["gm"].get_submodule(name)
    assert isinstance(graph, torch.fx.GraphModule)
    assert len(graph.graph.find_nodes(op="placeholder")) == len(calls[0].args[2:]) == 2
    assert _compat.nested_region_calls(graph) == {}


def test_nested_region_takes_its_trace_bound_and_region_body_finds_the_function():
    def add_one(x):
        return x + 1

    marked = _compat.nested_region(add_one, 3)
    assert marked is not add_one
    assert _compat.region_body(marked) is add_one and _compat.region_body(add_one) is add_one
    # where Dynamo reads the bound (torch/_dynamo/variables/higher_order_ops.py); a release
    # whose nested_compile_region takes no bound has none to refuse with
    if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters:
        assert add_one.__marked_compile_region_max_reuse_entries__ == 3
    assert torch.equal(marked(torch.ones(2)), torch.full((2,), 2.0))   # eager: the function


def test_nested_region_marks_without_a_bound_where_the_release_takes_none(monkeypatch):
    """torch 2.11's ``nested_compile_region`` takes no ``max_reuse_entries``: the function is
    marked all the same (and that release refuses no region for its number of traces)."""
    marked = []

    def old_release(fn):
        marked.append(fn)
        return fn

    monkeypatch.setattr(torch.compiler, "nested_compile_region", old_release)

    def add_one(x):
        return x + 1

    assert _compat.nested_region(add_one, 3) is add_one and marked == [add_one]
