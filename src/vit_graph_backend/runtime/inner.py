"""Inner compilers: what runs inside each captured CUDA graph.

- ``eager``: the traced FX graph as is; the CUDA graph already removes launch overhead.
- ``inductor``: ``compile_fx`` with Inductor's own CUDA graphs off (graphs must not nest); fuses
  elementwise work, at a compile per Dynamo graph (cached on disk by Inductor).
- ``tensorrt``: torch-tensorrt's Dynamo backend, imported only when chosen; a result with no
  TensorRT engine (its silent fallback to PyTorch) is warned about.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat
from ..errors import MissingDependencyError
from ..options import VitGraphOptions

__all__ = ["compile_inner", "inner_backend", "inner_compiler_name"]

log = logging.getLogger(__name__)


def inner_compiler_name(example_inputs: Sequence[Any], options: VitGraphOptions) -> str:
    """The inner compiler a Dynamo graph with these inputs gets (``"auto"`` resolved by device)."""
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    return options.inner_compiler_for(cuda=device is not None and device.type == "cuda")


def compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  options: VitGraphOptions) -> Callable[..., Any]:
    """Compile one traced graph with ``options.inner_compiler`` (``"auto"`` resolved by
    :func:`inner_compiler_name`); returns a callable on real args."""
    name = inner_compiler_name(example_inputs, options)
    if name == "eager":
        return gm
    if name == "inductor":
        return _compat.compile_fx_without_cudagraphs(gm, example_inputs)
    if name == "tensorrt":
        return _compile_tensorrt(gm, example_inputs)
    raise AssertionError(f"unchecked inner_compiler {name!r}")  # options.py validated it


def inner_backend(options: VitGraphOptions) -> Callable[..., Any]:
    """A ``torch.compile`` backend that only runs the inner compiler (for packed compute graphs,
    routed by the runtime outside Dynamo)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any):
        return compile_inner(gm, example_inputs, options)

    return backend


def _compile_tensorrt(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    try:
        from torch_tensorrt.dynamo.backend import torch_tensorrt_backend
    except ImportError as exc:
        raise MissingDependencyError(
            "inner_compiler='tensorrt' needs torch-tensorrt: pip install "
            "'vit-graph-backend[tensorrt]' (NVIDIA's index provides its native libraries)"
        ) from exc
    compiled = torch_tensorrt_backend(gm, example_inputs)
    if not _has_tensorrt_engine(compiled):
        warnings.warn(
            "vitgraph: torch-tensorrt returned a graph with no TensorRT engine (it fell back to "
            "PyTorch for every op); the CUDA graph still runs, without TensorRT kernels",
            RuntimeWarning, stacklevel=2)
    return compiled


def _has_tensorrt_engine(compiled: Any) -> bool:
    """Whether ``compiled`` holds a TensorRT submodule (torch-tensorrt's ``_run_on_acc_*``)."""
    modules = getattr(compiled, "named_modules", None)
    return modules is not None and any("_run_on_acc" in name for name, _ in modules())
