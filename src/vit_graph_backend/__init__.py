"""vit_graph_backend: serve vision encoders from CUDA graphs at any batch size and image size.

``torch.compile(model, backend="vitgraph")`` routes every call through a bucketing pass into a few
token budgets, pads, and replays one CUDA graph per budget. Packed variable-resolution towers
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) are served through
:class:`SupportsEncoderCudaGraph` adapters; :func:`serve_vision_` serves a whole HF model.

Importing this package imports no torch (torch-facing names load on first use, so ``vitgraph
plan`` stays pure Python), initializes no CUDA, registers nothing (the backend is found through the
``torch_dynamo_backends`` entry point) and imports no optional dependency.
"""

from typing import Any

from ._version import __version__
from .budgets import BudgetConfig, CaptureLayout, budget_ladder, capture_layout, ceil_div
from .cache_dir import use_cache_dir
from .adapters import adapt
from .errors import (InvalidInputError, InvalidOptionError, MissingDependencyError,
                     UnsupportedGraphError, UnsupportedModelError, VitGraphError)
from .options import VitGraphOptions
from .planner import Batch, Plan, Segment, plan_batches
from .protocol import StampedBuffers, SupportsEncoderCudaGraph, supports_encoder_cudagraph
from .specs import EncoderItemSpec
from .stats import GraphStats

__all__ = ["Batch", "BudgetConfig", "CaptureLayout", "EncoderItemSpec", "GraphStats",
           "InvalidInputError", "InvalidOptionError", "MissingDependencyError",
           "PackedGraphEncoder", "Plan", "Segment", "StampedBuffers", "SupportsEncoderCudaGraph",
           "UnsupportedGraphError", "UnsupportedModelError", "VitGraphError", "VitGraphOptions",
           "__version__", "adapt", "budget_ladder", "capture_layout", "ceil_div",
           "compile_in_background", "data_parallel", "mark_layer_regions", "plan_batches",
           "report", "restore_vision_", "serve", "serve_vision_", "supports_encoder_cudagraph",
           "use_cache_dir", "wait_prepared", "warm"]

_LAZY = {"PackedGraphEncoder": "adapters.serve", "serve": "adapters.serve",
         "report": "compile.backend", "wait_prepared": "compile.backend", "warm": "compile.backend",
         "mark_layer_regions": "compile.regions", "compile_in_background": "compile.background",
         "serve_vision_": "integrations.hf", "restore_vision_": "integrations.hf",
         "data_parallel": "integrations.parallel"}


def __getattr__(name: str) -> Any:
    # PEP 562: the torch-importing names load on first access
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
