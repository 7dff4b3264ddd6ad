"""The only module that touches private PyTorch APIs.

One small wrapper per capability, each guarded, each naming where the API lives upstream.
``tests/unit/test_compat.py`` calls every wrapper on the installed torch, so a PyTorch release that
moves one fails CI instead of a user's call. Supported: torch 2.11 through 2.14.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["buffer_table", "compile_cache_counts", "compile_phase_seconds", "compiling_code",
           "compile_fx_without_cudagraphs", "current_raw_stream", "data_ptrs_equal",
           "enable_backed_size_oblivious", "end_failed_capture", "example_value",
           "forward_hook_tables", "get_varlen_attn", "global_forward_hook_tables",
           "graph_pool_bytes", "hook_handles_made", "maybe_mark_dynamic", "nested_region",
           "nested_region_calls", "parameter_table", "rearm_code", "region_body",
           "register_dynamo_backend", "sym_name", "uncompiled_callers"]

_SYMBOL = re.compile(r"^[A-Za-z_]+\d*$")


def example_value(node: torch.fx.Node) -> Any:
    """The fake value Dynamo recorded for an FX node: ``node.meta["example_value"]``, private
    metadata (torch/_dynamo/output_graph.py)."""
    return node.meta.get("example_value")


def sym_name(value: Any) -> str | None:
    """The symbol name of a plain symbolic int (``s77``), or ``None`` for a concrete int or an
    expression such as ``2*s77``; reads only ``str()`` of the ``SymInt``, no private ``SymNode``."""
    if isinstance(value, torch.SymInt):
        text = str(value)
        return text if _SYMBOL.match(text) else None
    return None


def compile_fx_without_cudagraphs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                                  ) -> Callable[..., Any]:
    """Compile ``gm`` with ``torch._inductor.compile_fx.compile_fx``, Inductor's own CUDA graphs
    off (ours wrap it; graphs must not nest)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": False})


def compile_cache_counts() -> dict[str, int]:
    """This process's AOTAutograd and Inductor compile-cache counts (``fxgraph_cache_hit``, ...)
    from ``torch._dynamo.utils.counters`` (torch/_inductor/codecache.py)."""
    from torch._dynamo.utils import counters

    return {key: value for group in ("aot_autograd", "inductor")
            for key, value in counters[group].items() if "cache" in key}


#: ``torch._dynamo.utils.compilation_time_metrics`` keys: Dynamo's whole compile of a frame, the
#: backend's part of it, and Inductor's compile of one graph (torch/_dynamo/convert_frame.py,
#: output_graph.py, torch/_inductor/compile_fx.py)
_COMPILE_INNER, _USER_COMPILER, _INDUCTOR = ("_compile.compile_inner",
                                             "OutputGraph.call_user_compiler", "compile_fx_inner")


def compile_phase_seconds() -> dict[str, float]:
    """This process's seconds so far in ``dynamo`` (tracing, guards: Dynamo's compile of a frame
    less its backend call), ``backend`` (the backends' compiles, Inductor's included) and
    ``inductor`` (Inductor's compiles, wherever called), from Dynamo's own timers."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    total = {key: sum(metrics.get(key, ())) for key in (_COMPILE_INNER, _USER_COMPILER, _INDUCTOR)}
    return {"dynamo": max(0.0, total[_COMPILE_INNER] - total[_USER_COMPILER]),
            "backend": total[_USER_COMPILER], "inductor": total[_INDUCTOR]}


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to compile ``tensor``'s dimension ``dim`` as symbolic from the first compile
    (``torch._dynamo.maybe_mark_dynamic``; unlike ``mark_dynamic`` it never raises when the
    dimension specializes). Saves the static-then-dynamic recompile; a no-op where missing."""
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(tensor, dim)


def get_varlen_attn() -> Callable[..., torch.Tensor]:
    """``torch.nn.attention.varlen.varlen_attn`` (new in PyTorch 2.11, the oldest supported):
    packed attention over tensor offsets, so it captures in a CUDA graph."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def graph_pool_bytes(pool: Any, device: torch.device | None = None) -> int | None:
    """Bytes the caching allocator reserved for graph pool ``pool``, from the segments'
    ``segment_pool_id`` in ``torch.cuda.memory_snapshot()``; ``None`` where that key is missing."""
    segments = torch.cuda.memory_snapshot()
    if segments and "segment_pool_id" not in segments[0]:
        return None
    wanted = tuple(pool)
    return sum(int(seg["total_size"]) for seg in segments
               if (device is None or seg.get("device") == device.index)
               and tuple(seg.get("segment_pool_id", ())) == wanted)


#: what Inductor's generated code calls per launch; absent in CPU-only builds
_RAW_STREAM: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as its raw ``cudaStream_t``, through
    ``torch._C._cuda_getCurrentRawStream`` (torch/csrc/cuda/Module.cpp), which skips building a
    ``torch.cuda.Stream`` object per call; else ``torch.cuda.current_stream(index).cuda_stream``."""
    raw = _RAW_STREAM
    if raw is None:
        return torch.cuda.current_stream(index).cuda_stream
    return raw(index)


#: cudagraph_trees' check of static inputs' addresses; absent in CPU-only builds
_PTRS_EQUAL: Callable[[list[Any], list[int], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def data_ptrs_equal(tensors: list[Any], data_ptrs: list[int], indices: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == data_ptrs[i]`` for every ``i`` in ``indices``, in one
    C call: ``torch._C._tensors_data_ptrs_at_indices_equal`` (torch/csrc/cuda/Module.cpp), with
    which PyTorch's CUDA graph trees check their static inputs; else compared in Python. A
    non-tensor at an index raises (``RuntimeError`` from the C call, ``TypeError`` here)."""
    equal = _PTRS_EQUAL
    if equal is not None:
        return equal(tensors, data_ptrs, indices)
    data_ptr = torch.Tensor.data_ptr
    return all(data_ptr(tensors[i]) == data_ptrs[i] for i in indices)


def nested_region(fn: Callable[..., Any], max_entries: int) -> Callable[..., Any]:
    """``fn`` as a nested compile region (``torch.compiler.nested_compile_region``) that Dynamo
    may trace up to ``max_entries`` times in one graph before refusing: its default, 8, raises
    for a region that needs one trace per layer (a layer that reads a value of its own)."""
    mark = torch.compiler.nested_compile_region
    try:
        return mark(fn, max_reuse_entries=max_entries)
    except TypeError:   # a release without the argument
        return mark(fn)


def region_body(fn: Any) -> Any:
    """The function a ``nested_compile_region`` wrapper runs (``fn`` itself if not one): the
    wrapper keeps it as ``__marked_compile_region_fn__``
    (torch/_higher_order_ops/invoke_subgraph.py), and runs it unchanged outside a compile."""
    while callable(getattr(fn, "__marked_compile_region_fn__", None)):
        fn = fn.__marked_compile_region_fn__
    return fn


def nested_region_calls(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """``gm``'s calls of nested compile regions, by the attribute holding the region's graph.

    Dynamo traces a region marked with ``torch.compiler.nested_compile_region`` once into a
    child ``GraphModule`` and calls it as ``torch.ops.higher_order.invoke_subgraph(subgraph,
    identifier, *operands)`` (torch/_higher_order_ops/invoke_subgraph.py): a call's operands,
    ``node.args[2:]``, are the region graph's placeholders in order."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls: dict[str, list[torch.fx.Node]] = {}
    if hop is None:
        return calls
    for node in gm.graph.find_nodes(op="call_function", target=hop):
        graph = node.args[0]
        if isinstance(graph, torch.fx.Node) and graph.op == "get_attr":
            calls.setdefault(graph.target, []).append(node)
    return calls


def parameter_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module._parameters``: the dict ``nn.Module`` keeps its own parameters in
    (torch/nn/modules/module.py). Read on every packed call, where it is far cheaper than
    ``nn.Module.__getattr__``."""
    return module._parameters


def buffer_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module._buffers``: the dict ``nn.Module`` keeps its own buffers in
    (torch/nn/modules/module.py); read like :func:`parameter_table`."""
    return module._buffers


def forward_hook_tables(module: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """``(module._forward_pre_hooks, module._forward_hooks)`` (torch/nn/modules/module.py)."""
    return module._forward_pre_hooks, module._forward_hooks


def global_forward_hook_tables() -> tuple[dict[int, Any], dict[int, Any]]:
    """``_global_forward_pre_hooks`` and ``_global_forward_hooks`` of torch/nn/modules/module.py."""
    module = torch.nn.modules.module
    return module._global_forward_pre_hooks, module._global_forward_hooks


def hook_handles_made() -> int:
    """How many hook handles this process has made: ``RemovableHandle.next_id``
    (torch/utils/hooks.py). While it stands still no hook was added anywhere."""
    return torch.utils.hooks.RemovableHandle.next_id


def end_failed_capture(pool: Any, device: torch.device) -> bool:
    """Close the allocator's side of a graph capture that raised; True if it was still open.

    When ``CUDAGraph.capture_end`` raises, the allocator is left recording into the pool: later
    captures into it fail and the allocator stops freeing its cache on out-of-memory. Calls
    ``torch._C._cuda_endAllocateToPool`` and ``_cuda_releasePool``, as ``torch.cuda.use_mem_pool``
    does (torch/cuda/memory.py); returns False where they are missing."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        end(index, tuple(pool))
    except RuntimeError:  # not recording: capture_end got that far
        return False
    with contextlib.suppress(RuntimeError):
        release(index, tuple(pool))
    return True


def addmm_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x @ weight.T + bias, approximate="tanh")`` for 2-D ``x`` ([M, K]), ``weight``
    ([N, K]) and 1-D ``bias`` ([N]).

    On CUDA, ``torch._addmm_activation`` (the op Inductor lowers addmm + tanh GELU to) runs one
    cuBLASLt GEMM with ``CUBLASLT_EPILOGUE_GELU_BIAS``; no public op offers it. Off CUDA the op's
    GELU is the exact one, so public ops are used there."""
    if x.device.type != "cuda":
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


def register_dynamo_backend(name: str, backend: Callable[..., Any]) -> None:
    """Register ``backend`` under ``name`` in Dynamo's registry
    (``torch._dynamo.backends.registry.register_backend``; there is no public equivalent)."""
    from torch._dynamo.backends.registry import register_backend

    register_backend(compiler_fn=backend, name=name)


def enable_backed_size_oblivious() -> bool:
    """Turn on ``torch.fx.experimental._config.backed_size_oblivious`` for this process (Dynamo
    then stops specializing sizes 0 and 1, so a batch of 1 runs the dynamic graph instead of
    another compile); True if this call changed it."""
    from torch.fx.experimental import _config as fx_config

    if fx_config.backed_size_oblivious:
        return False
    fx_config.backed_size_oblivious = True
    return True


def compiling_code() -> types.CodeType | None:
    """The code object Dynamo is compiling (``torch._dynamo.symbolic_convert.InstructionTranslator
    .current_tx().f_code``); ``None`` outside a compile or where a release moved it."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # no compile in progress, or the tracer's API moved
        return None
    return code if isinstance(code, types.CodeType) else None


def uncompiled_callers() -> list[types.CodeType]:
    """Code objects of the Python frames that run *uncompiled* between the ``torch.compile``
    entry and the frame Dynamo is compiling now (innermost first); called from a backend.

    Walks the stack between ``torch._dynamo.convert_frame`` and ``torch._dynamo.eval_frame``. A
    user code object found there ran as plain Python; for a frame compiled before, Dynamo marked
    it skipped (``ConvertFrameReturn`` in torch/_dynamo/types.py) after a failed compile."""
    frame = sys._getframe(1)
    callers: list[types.CodeType] = []
    inside_dynamo = False
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "torch._dynamo.convert_frame":
            inside_dynamo, callers = True, []
        elif module == "torch._dynamo.eval_frame" and inside_dynamo:
            return callers
        elif inside_dynamo and not module.startswith("torch._dynamo"):
            callers.append(frame.f_code)
        frame = frame.f_back
    return []  # no compile entry above: not called from a Dynamo compile


def rearm_code(code: types.CodeType) -> None:
    """Let Dynamo serve frames of ``code`` again after it marked the code skipped
    (``torch._C._dynamo.eval_frame.set_code_exec_strategy``; no public way short of reset)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))
