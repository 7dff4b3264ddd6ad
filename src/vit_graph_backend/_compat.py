"""The only module that touches private PyTorch APIs or checks PyTorch versions.

One small wrapper per capability, each guarded, each naming where the API lives upstream.
``tests/unit/test_compat.py`` calls every wrapper on the installed torch, so a PyTorch release that
moves one of these fails CI loudly instead of failing a user's call.

Supported: torch 2.11 through 2.14 (checked on CPU with 2.13/2.14 in CI, on CUDA with 2.11).
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version

__all__ = [
    "MIN_TORCH",
    "TORCH_VERSION",
    "buffer_table",
    "compile_cache_counts",
    "compiling_code",
    "compile_fx_without_cudagraphs",
    "current_raw_stream",
    "enable_backed_size_oblivious",
    "end_failed_capture",
    "example_value",
    "forward_hook_tables",
    "get_varlen_attn",
    "global_forward_hook_tables",
    "graph_pool_bytes",
    "hook_handles_made",
    "maybe_mark_dynamic",
    "parameter_table",
    "rearm_code",
    "register_dynamo_backend",
    "same_data_ptrs",
    "sym_name",
    "torch_version_at_least",
    "uncompiled_callers",
    "varlen_attention_available",
]

TORCH_VERSION = Version(torch.__version__.split("+")[0])
MIN_TORCH = Version("2.11")

_SYMBOL = re.compile(r"^[A-Za-z_]+\d*$")


def torch_version_at_least(version: str) -> bool:
    """True if the installed torch is at least ``version`` (local build tags ignored)."""
    return TORCH_VERSION >= Version(version)


def example_value(node: torch.fx.Node) -> Any:
    """The fake value Dynamo recorded for an FX node (``node.meta["example_value"]``).

    Dynamo stores it for every placeholder and intermediate of the graphs it hands to backends
    (torch/_dynamo/output_graph.py); it is metadata, not public API, hence this wrapper.
    """
    return node.meta.get("example_value")


def sym_name(value: Any) -> str | None:
    """The symbol name of a plain symbolic int (``s77``), or ``None`` for a concrete int or an
    expression such as ``2*s77``.

    ``str()`` of a ``torch.SymInt`` prints its sympy expression; that is the only property used,
    so no private ``SymNode`` attribute is read.
    """
    if isinstance(value, torch.SymInt):
        text = str(value)
        return text if _SYMBOL.match(text) else None
    return None


def compile_fx_without_cudagraphs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                                  ) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor, with Inductor's own CUDA graphs off (ours wrap it; graphs
    must not nest). ``torch._inductor.compile_fx.compile_fx`` is what ``backend="inductor"`` calls.
    """
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": False})


def compile_cache_counts() -> dict[str, int]:
    """This process's counts of AOTAutograd's and Inductor's compile-cache outcomes so far
    (``autograd_cache_hit``, ``autograd_cache_bypass``, ``fxgraph_cache_hit``, ...), as
    ``torch._dynamo.utils.counters`` keeps them (torch/_functorch/_aot_autograd/autograd_cache.py,
    torch/_inductor/codecache.py)."""
    from torch._dynamo.utils import counters

    return {key: value for group in ("aot_autograd", "inductor")
            for key, value in counters[group].items() if "cache" in key}


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to compile ``tensor``'s dimension ``dim`` as symbolic from the first compile
    (``torch._dynamo.maybe_mark_dynamic``, public since 2.1 in the private namespace; unlike
    ``mark_dynamic`` it never raises when the dimension specializes). Without it, a function
    compiles once static and again dynamic; with ``dynamic=True`` every dimension is symbolic
    and equal sizes are merged into one symbol, which recompiles whenever they part. A torch
    without it: no-op (one extra compile)."""
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(tensor, dim)


def varlen_attention_available() -> bool:
    """True if ``torch.nn.attention.varlen.varlen_attn`` exists (PyTorch 2.11+)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def get_varlen_attn() -> Callable[..., torch.Tensor]:
    """``torch.nn.attention.varlen.varlen_attn``: packed attention over cumulative offsets given
    as tensors, so it captures in a CUDA graph (HF's per-segment ``.tolist()`` path does not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:  # pragma: no cover - torch < 2.11 is not supported
        raise ImportError(
            f"torch.nn.attention.varlen.varlen_attn is missing in torch {torch.__version__}; "
            f"vit_graph_backend needs torch >= {MIN_TORCH}"
        ) from exc
    return varlen_attn


def graph_pool_bytes(pool: Any, device: torch.device | None = None) -> int | None:
    """Bytes the CUDA caching allocator has reserved for graph memory pool ``pool``.

    Reads the public ``torch.cuda.memory_snapshot()``, whose segments carry a
    ``segment_pool_id`` key (the pool's id, as returned by ``torch.cuda.graph_pool_handle()``).
    Returns ``None`` if this torch's snapshot has no such key.
    """
    segments = torch.cuda.memory_snapshot()
    if segments and "segment_pool_id" not in segments[0]:
        return None
    wanted = tuple(pool)
    total = 0
    for seg in segments:
        if device is not None and seg.get("device") != device.index:
            continue
        if tuple(seg.get("segment_pool_id", ())) == wanted:
            total += int(seg["total_size"])
    return total


#: torch/csrc/cuda/Module.cpp's binding, which Inductor's generated code calls for every kernel
#: launch; absent in CPU-only builds (then nothing calls it: no CUDA, no stream)
_RAW_STREAM: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as its raw ``cudaStream_t`` value (what
    ``torch.cuda.current_stream(index).cuda_stream`` gives). The packed path asks twice a call
    (stream ordering, the graph launch); the public route builds a ``torch.cuda.Stream`` object
    each time, 5 to 10 us of host time on an H100 machine, the binding well under one. Without
    the binding: the public route."""
    raw = _RAW_STREAM
    if raw is None:
        return torch.cuda.current_stream(index).cuda_stream
    return raw(index)


def parameter_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module._parameters``: the dict ``nn.Module`` keeps its own parameters in, which
    assigning or registering a parameter writes to (torch/nn/modules/module.py). Read on every
    packed call (``weights.py``, ``adapters/_aligned_mlp.py``): a lookup there costs about
    0.2 us, ``getattr`` through ``nn.Module.__getattr__`` about 2 us."""
    return module._parameters


def buffer_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module._buffers``: the dict ``nn.Module`` keeps its own buffers in, which assigning or
    registering a buffer writes to (torch/nn/modules/module.py); read like
    :func:`parameter_table`."""
    return module._buffers


def forward_hook_tables(module: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """``(module._forward_pre_hooks, module._forward_hooks)``: the dicts
    ``register_forward_pre_hook`` and ``register_forward_hook`` write to, which ``nn.Module``'s
    call reads (torch/nn/modules/module.py)."""
    return module._forward_pre_hooks, module._forward_hooks


def global_forward_hook_tables() -> tuple[dict[int, Any], dict[int, Any]]:
    """The dicts ``register_module_forward_pre_hook`` and ``register_module_forward_hook`` write
    to: hooks every module's call runs (torch/nn/modules/module.py)."""
    module = torch.nn.modules.module
    return module._global_forward_pre_hooks, module._global_forward_hooks


def hook_handles_made() -> int:
    """How many hook handles this process has made: ``RemovableHandle.next_id``, which every
    hook registration (forward hooks, global ones, state-dict hooks, ...) advances
    (torch/utils/hooks.py). While it stands still no hook was added anywhere."""
    return torch.utils.hooks.RemovableHandle.next_id


def end_failed_capture(pool: Any, device: torch.device) -> bool:
    """Close the allocator's side of a graph capture that raised; True if it was still open.

    ``CUDAGraph.capture_end`` ends the CUDA stream capture *before* it tells the caching
    allocator to stop routing allocations into the capture's pool; when ending the capture raises
    (an invalidated capture: out of memory, a host sync), the allocator is left "recording" into
    that pool. Every later capture into it then fails ("already recording to mempool_id"), and
    while a capture is underway the allocator never frees its cache on an out-of-memory, so the
    whole process is starved. ``torch._C._cuda_endAllocateToPool`` and ``_cuda_releasePool``
    are what ``torch.cuda.use_mem_pool`` calls to close such a scope (torch/cuda/memory.py); no
    public function does it. Missing in a torch build: returns False (the caller still moves
    on to a fresh pool).
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        end(index, tuple(pool))
    except RuntimeError:  # not recording: capture_end got that far
        return False
    try:
        release(index, tuple(pool))
    except RuntimeError:
        pass
    return True


def addmm_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x @ weight.T + bias, approximate="tanh")`` for 2-D ``x`` ([M, K]), ``weight``
    ([N, K]) and 1-D ``bias`` ([N]).

    ``torch._addmm_activation`` is the op Inductor's post-grad patterns lower ``addmm`` with a
    tanh GELU to: on CUDA, PyTorch runs it as one cuBLASLt GEMM with the bias and the GELU in its
    epilogue (``CUBLASLT_EPILOGUE_GELU_BIAS``, whose GELU is the tanh form) where its operands
    allow, else as the GEMM and a separate GELU. No public function offers that epilogue. Off
    CUDA the op's GELU is the exact one (ATen's CPU kernel in torch 2.11 to 2.14), so there this
    takes PyTorch's public ops instead.
    """
    if x.device.type != "cuda":
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


def register_dynamo_backend(name: str, backend: Callable[..., Any]) -> None:
    """Register ``backend`` under ``name`` in Dynamo's registry
    (``torch._dynamo.backends.registry.register_backend``; there is no public equivalent)."""
    from torch._dynamo.backends.registry import register_backend

    register_backend(compiler_fn=backend, name=name)


def enable_backed_size_oblivious() -> bool:
    """Turn on ``torch.fx.experimental._config.backed_size_oblivious`` for this process.

    With it, Dynamo stops specializing dynamic sizes of 0 and 1 (the "0/1 specialization" that
    adds a ``2 <= s0`` guard to every dynamic graph), so a batch of 1 runs the dynamic graph
    instead of costing one more compile per graph. It is a private config module, hence this
    wrapper. Returns True if this call changed it.
    """
    from torch.fx.experimental import _config as fx_config

    if fx_config.backed_size_oblivious:
        return False
    fx_config.backed_size_oblivious = True
    return True


def compiling_code() -> types.CodeType | None:
    """The code object of the frame Dynamo is compiling, called from inside a backend
    (``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx().f_code``); ``None``
    outside a compile or where a release moved it."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # no compile in progress, or the tracer's API moved
        return None
    return code if isinstance(code, types.CodeType) else None


def uncompiled_callers() -> list[types.CodeType]:
    """Code objects of the Python frames that run *uncompiled* between the ``torch.compile``
    entry and the frame Dynamo is compiling now (innermost first); called from a backend.

    Seen from a backend, the stack holds Dynamo's own frames (``torch._dynamo.*``, entered from
    ``convert_frame``), then the callers of the frame being compiled, up to the entry of the
    compiled region (``torch._dynamo.eval_frame``). A caller that Dynamo serves from compiled
    code runs its transformed code object, so a code object of the user's found there is one
    Dynamo ran as plain Python: for a frame compiled before, that means Dynamo marked it
    skipped (``ConvertFrameReturn``'s default strategy in ``torch/_dynamo/types.py``, applied
    after a compile of the frame failed, e.g. when the model raised while being traced).
    """
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
    """Let Dynamo compile (and serve from its cache) frames of ``code`` again after it marked
    the code skipped (``torch._C._dynamo.eval_frame.set_code_exec_strategy`` with the default
    strategy; public Dynamo has no way to undo a skip short of ``torch.compiler.reset()``)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))


_data_ptr = torch.Tensor.data_ptr


def same_data_ptrs(tensors: list[torch.Tensor], addresses: list[int],
                   indices: list[int]) -> bool:
    """Whether ``tensors`` still live at ``addresses`` (``indices``: ``list(range(len))``, kept
    by the caller), in one C call where the build has
    ``torch._C._tensors_data_ptrs_at_indices_equal`` (CUDA builds; what CUDA graph trees check
    static inputs with, torch/_inductor/cudagraph_trees.py), else through C-level ``map``."""
    check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if check is not None:
        return bool(check(tensors, addresses, indices))
    return list(map(_data_ptr, tensors)) == addresses

