"""``inner.py``: what runs inside each captured graph, chosen by ``inner_compiler``.

Through the public seams: ``compile_inner`` on a traced graph and ``inner_backend`` under
``torch.compile``. ``eager`` hands back the traced graph itself; ``inductor`` a compiled callable
with equal results; ``tensorrt`` without torch-tensorrt installed is refused when the options are
built, and the compile path names the missing package if reached anyway.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from vit_graph_backend.errors import MissingDependencyError
from vit_graph_backend.runtime.inner import compile_inner, inner_backend
from vit_graph_backend.options import VitGraphOptions


def _traced():
    def fn(x):
        return torch.nn.functional.gelu(x @ x.T) + 1

    gm = torch.fx.symbolic_trace(fn)
    return fn, gm, [torch.randn(3, 4)]


def test_eager_is_the_traced_graph_itself():
    _, gm, example = _traced()
    assert compile_inner(gm, example, VitGraphOptions(inner_compiler="eager")) is gm


def test_auto_on_cpu_is_the_traced_graph_itself():
    # "auto" picks Inductor only for graphs on CUDA (VitGraphOptions.inner_compiler_for)
    _, gm, example = _traced()
    assert compile_inner(gm, example, VitGraphOptions()) is gm


def test_inductor_compiles_to_equal_results():
    fn, gm, example = _traced()
    compiled = compile_inner(gm, example, VitGraphOptions(inner_compiler="inductor"))
    assert compiled is not gm
    out = compiled(*example)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, fn(*example))


def test_inner_backend_runs_under_torch_compile():
    fn, _, example = _traced()
    compiled = torch.compile(fn, backend=inner_backend(VitGraphOptions()))
    torch.testing.assert_close(compiled(*example), fn(*example))


@pytest.mark.skipif(importlib.util.find_spec("torch_tensorrt") is not None,
                    reason="checks the refusal without torch-tensorrt")
def test_tensorrt_without_the_package_is_refused_early_and_late():
    with pytest.raises(MissingDependencyError, match="needs torch-tensorrt"):
        VitGraphOptions(inner_compiler="tensorrt")
    _, gm, example = _traced()
    # options built some other way (e.g. before an uninstall) still fail with the package's name
    options = object.__new__(VitGraphOptions)
    object.__setattr__(options, "inner_compiler", "tensorrt")
    with pytest.raises(MissingDependencyError, match="pip install 'vit-graph-backend\\[tensorrt\\]'"):
        compile_inner(gm, example, options)
