"""`VitGraphOptions`: every setting of the backend, validated once, when options are built.

``torch.compile(model, backend="vitgraph", options={...})`` hands the dict to
:meth:`VitGraphOptions.from_compile_kwargs`; packed adapters take the same keys as keyword
arguments. Unknown keys, bad values and impossible combinations raise
:class:`~vit_graph_backend.errors.InvalidOptionError` (a ``ValueError``) naming the value and what is
allowed, at compile time, never at replay (vLLM PR #38040 moved its budget checks to config time
for the same reason).

The dataclass is frozen and holds tuples, so it hashes and can key caches.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from .budgets import BudgetConfig, check_items_fit, check_ladder_steps, normalize_budgets
from .errors import InvalidOptionError, MissingDependencyError
from .planner import POLICIES
from .specs import check_positive_int

__all__ = ["DEFAULT_BATCHED_LADDER_STEPS", "DEFAULT_BATCHED_MAX_BUDGET", "DEFAULT_LADDER_STEPS",
           "EPILOGUE_FUSIONS", "GRAPH_LAUNCHES", "INNER_COMPILERS", "MODES", "PACKED_ATTENTIONS",
           "PACKED_ONLY_OPTIONS", "PATCH_EMBEDDINGS", "VitGraphOptions"]

INNER_COMPILERS: tuple[str, ...] = ("auto", "eager", "inductor", "tensorrt")
CAPTURE_MODES: tuple[str, ...] = ("all", "lazy")
#: ``epilogue_fusion`` values: a linear layer's GELU in its GEMM's epilogue where timed faster.
EPILOGUE_FUSIONS: tuple[str, ...] = ("auto", "off")
#: ``graph_launch`` values: each graph instantiated for device launch where the CUDA driver allows
#: (a cheap launch for the host), or always PyTorch's ``CUDAGraph.replay()`` (``graph_launch.py``).
GRAPH_LAUNCHES: tuple[str, ...] = ("auto", "torch")
#: ``patch_embedding`` values: one GEMM over a ViT's patches, or its patch convolution.
PATCH_EMBEDDINGS: tuple[str, ...] = ("gemm", "conv")
#: ``packed_attention`` values besides ``None`` (cuDNN's ragged kernel where its library imports,
#: else flash varlen, each budget's full attention timed against the Triton segment kernel):
#: dense SDPA timed per one-image budget, flash varlen always, dense SDPA always, cuDNN required.
PACKED_ATTENTIONS: tuple[str, ...] = ("auto", "varlen", "dense", "cudnn")

#: ``torch.compile(mode=...)`` presets. Every mode replays CUDA graphs; they differ in what runs
#: inside the graph. ``reduce-overhead`` is accepted because users reach for it for this exact
#: purpose; here it means the default.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {},
    "max-autotune": {"inner_compiler": "inductor"},
    "max-autotune-no-cudagraphs": {"inner_compiler": "inductor"},
}

#: Default largest budget, in rows, for batched ``[B, C, H, W]`` encoders: the ladder
#: ends at 32 rows (see DEFAULT_BATCHED_LADDER_STEPS), and larger calls are cut into 32-row chunks.
DEFAULT_BATCHED_MAX_BUDGET = 32

#: Default ``ladder_steps`` for packed encoders: each doubling split in two (64, 96, 128, 192,
#: ..., 4096 tokens: 13 graphs). On the Qwen2.5-VL single-image stream this cuts expected padding
#: from 30 % (doubling) to 16 % (planner figures); on an H100 the Qwen2.5-VL-3B tower's 13 graphs
#: captured in 1.2 to 1.6 s (benchmarks/results/qwen_stream_doubling_vs_two_step_ladder_*.json).
DEFAULT_LADDER_STEPS = 2
#: Default ``ladder_steps`` for batched encoders: 1, 2, 3, 4, 5, 6, 7, 8, 10, ..., 28, 32 rows
#: (16 graphs). Rows cost linear compute, so padding is lost time: 5 % expected on uniform batch
#: sizes 1..32 against 23 % for the doubling ladder (planner figures; 4.9 % measured over the
#: ViT-B/16 stream, whose 18 graphs captured in 0.27 s on an H100).
DEFAULT_BATCHED_LADDER_STEPS = 4

#: Options only a packed encoder can apply: a batched graph holds the rows of one call, and
#: packed towers' adapters run kernels of their own.
PACKED_ONLY_OPTIONS: tuple[str, ...] = ("max_items_per_graph", "max_frames_per_batch",
                                        "align_mlp", "fuse", "packed_attention")


@dataclass(frozen=True)
class VitGraphOptions:
    """Settings of the ``vitgraph`` backend.

    Args:
        budgets: token budgets (rows for batched encoders, output tokens for packed ones); ``None``
            for a ladder from ``min_budget`` to ``max_budget``.
        min_budget: smallest ladder budget; ``None`` for the model's own (1 row for batched).
        max_budget: largest ladder budget; ``None`` for the model's own (32 rows for batched).
        ladder_steps: how finely the ladder splits each doubling (1: 64, 128, 256, ...; 2: 64, 96,
            128, 192, ...; up to 16); ``None`` for the encoder kind's default (2 packed, 4
            batched). More steps: less padding, more graphs to capture and hold.
        max_items_per_graph: items one graph holds (packed encoders); ``None`` derives it so that
            it never exceeds the smallest budget.
        max_frames_per_batch: video frames one graph holds; ``None`` for no frame cap.
        policy: planner policy, ``"baseline"`` (pad to the smallest fitting budget) or ``"exact"``
            (never pad: replay only exact budget sizes, run the rest eagerly).
        inner_compiler: what runs inside the graph: ``"eager"`` (the traced graph as is),
            ``"inductor"`` (its own CUDA graphs off, so graphs do not nest), ``"tensorrt"``, or
            ``"auto"`` (the default; :meth:`inner_compiler_for`): Inductor's fused kernels for
            ``torch.compile`` graphs on a GPU, the traced graph as is on a CPU (no graphs there
            to feed) and for packed towers (their adapters fuse their own kernels).
        capture: ``"all"`` captures every budget, largest first into one pool, at the first call
            of a shape; ``"lazy"`` captures a budget the first time a batch needs it.
        warmup_iters: eager runs of each budget before its capture. One does every lazy
            set-up a capture must not meet (cuBLAS workspaces, cuDNN plans, Triton compiles,
            the kernel choices timed per shape) and measures the budget's memory; each more
            only lengthens the first pass
            (``benchmarks/results/first_pass_one_warm_up_run_and_fewer_long_timing_replays_*``).
        max_graph_sets: graph sets kept for other dynamic dims (e.g. image height/width); the least
            recently used set is freed beyond this.
        static_graphs: serve Dynamo's static (first, and batch-1) compiles from one exact-shape
            graph; ``False`` runs them eagerly.
        backed_size_oblivious: opt-in: at the first ``vitgraph`` compile, turn on PyTorch's
            ``backed_size_oblivious`` so that a dynamic graph also serves a batch of 1 instead of
            Dynamo compiling the frame once more for it. It is process-wide (every later Dynamo
            compile, the application's own included), hence off by default, and it needs
            ``inner_compiler="eager"``: turned on by the backend in a running process, it ended
            an Inductor inner graph in an illegal memory access in the GPU suite on torch 2.11
            (``benchmarks/results/backed_size_oblivious_inductor_H100_torch2.11.0.txt``).
        verify: compare the first replay of each budget with an eager run of the same items; a
            mismatch beyond ``verify_tolerance`` disables that budget's graph with a warning.
        verify_tolerance: max abs error allowed relative to the eager output's max abs value;
            ``None`` picks by dtype (fp32 1e-3, fp16 1e-2, bf16 3e-2).
        max_graph_memory: bound on the memory one encoder's graphs hold (pools and static
            inputs): an ``int`` in bytes, or a ``float`` in (0, 1], the fraction of the device's
            free memory when the first graph is captured. Budgets that would cross it, or whose
            warm-up runs out of memory, are skipped, largest first, each with a logged reason
            (``memory_report()["skipped_budgets"]``); their calls use the next larger captured
            budget or run eagerly. ``None``: no bound beyond what the device has.
        epilogue_fusion: ``"auto"`` (the default) rewrites each linear layer followed by a GELU
            (exact, tanh or HF's quick GELU) of a ``torch.compile`` graph on a Hopper or newer
            GPU into one op that runs, per shape, whichever was timed faster the first time the
            shape ran: a Triton GEMM with bias and activation in its epilogue, or cuBLAS and a
            separate activation kernel (``fused_linear.py``). ``"off"`` leaves the layers to the
            inner compiler. Packed towers (``serve``) take it too (``adapters/_qwen_kernels.py``:
            GELU MLPs, and SiLU-gated ones as one GEMM on a packed gate/up weight).
        graph_launch: ``"auto"`` (the default) has the CUDA driver instantiate each captured
            graph for device launch, whose launch cost the host 0.02 to 0.13 ms for the
            Qwen2.5-VL-3B tower's graphs, where PyTorch's own executable cost up to 0.6 ms once
            cuBLAS put memsets in the graph (large GEMMs on Hopper; ``graph_launch.py``). Graphs that draw random numbers, or that the driver
            refuses, replay through ``CUDAGraph.replay()`` with a logged reason. ``"torch"``:
            always ``CUDAGraph.replay()``. ``report()["graph_launch"]`` says which per budget.
        batch_invariant: ``True`` makes an item's output bit-identical whether it is served
            alone or in any batch or packing, and from one process to the next on the same GPU
            and versions: nothing is chosen by timing (``epilogue_fusion`` off; packed towers
            run flash varlen attention in every layer and their MLPs through cuBLAS), and ``torch.compile`` graphs run their traced kernels (``inner_compiler``
            ``"eager"``), whose per-row results were measured not to depend on the batch (the
            Inductor kernels' were: up to 3 % apart; ``docs/performance.md`` gives the cost).
        patch_embedding: ``"gemm"`` (the default) rewrites each ``torch.conv2d`` of a graph
            whose stride equals its kernel, without padding, dilation or groups, into one GEMM
            over the patches, 8 to 12 times faster than cuDNN's convolution on an H100
            (``patch_rewrite.py``). ``"conv"`` leaves it to the convolution.

        align_mlp: packed towers: run the MLPs from weight copies zero-padded to a multiple of
            8 in width (the same numbers; cuBLAS's fast kernels where the width is misaligned,
            as Qwen2.5-VL's 3420); ``None`` does so on CUDA where the width needs it.
        fuse: packed towers: run each block's elementwise work (rotary embedding, residual add
            and norm, gated activation) inside the graphs as Inductor-fused kernels; ``None``
            does so on CUDA with Triton installed.
        packed_attention: packed towers' attention in the graphs: ``None`` (cuDNN's ragged
            kernel where ``nvidia-cudnn-frontend`` imports, else flash varlen, with the Triton
            segment kernel where timed faster per budget, and window layers on a short-segment
            kernel where timed faster), ``"varlen"`` (flash varlen in every layer), ``"cudnn"``
            (as ``None``, an error without the library), ``"dense"`` (dense SDPA where a
            budget holds one image) or ``"auto"`` (dense or segments, timed per such budget).

    Example::

        >>> VitGraphOptions.from_compile_kwargs({"max_budget": 64, "inner_compiler": "inductor"})
        VitGraphOptions(budgets=None, min_budget=None, max_budget=64, ...)
    """

    budgets: tuple[int, ...] | None = None
    min_budget: int | None = None
    max_budget: int | None = None
    ladder_steps: int | None = None
    max_items_per_graph: int | None = None
    max_frames_per_batch: int | None = None
    policy: str = "baseline"
    inner_compiler: str = "auto"
    capture: str = "all"
    warmup_iters: int = 1
    max_graph_sets: int = 4
    static_graphs: bool = True
    backed_size_oblivious: bool = False
    verify: bool = False
    verify_tolerance: float | None = None
    max_graph_memory: int | float | None = None
    epilogue_fusion: str = "auto"
    graph_launch: str = "auto"
    patch_embedding: str = "gemm"
    batch_invariant: bool = False
    align_mlp: bool | None = None
    fuse: bool | None = None
    packed_attention: str | None = None

    def __post_init__(self) -> None:
        if self.budgets is not None:
            object.__setattr__(self, "budgets", normalize_budgets(self.budgets))
        for name in ("min_budget", "max_budget", "max_items_per_graph", "max_frames_per_batch"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("max_graph_sets", self.max_graph_sets)
        if self.ladder_steps is not None:
            check_ladder_steps("ladder_steps", self.ladder_steps)
        if isinstance(self.warmup_iters, bool) or not isinstance(self.warmup_iters, int) or (
            self.warmup_iters < 0
        ):
            raise InvalidOptionError(
                f"warmup_iters={self.warmup_iters!r} is invalid: must be an integer >= 0"
            )
        for name, allowed in (("policy", POLICIES), ("inner_compiler", INNER_COMPILERS),
                              ("capture", CAPTURE_MODES), ("epilogue_fusion", EPILOGUE_FUSIONS),
                              ("graph_launch", GRAPH_LAUNCHES),
                              ("patch_embedding", PATCH_EMBEDDINGS)):
            _check_choice(name, getattr(self, name), allowed)
        for name in ("align_mlp", "fuse"):
            if getattr(self, name) not in (None, True, False):
                raise InvalidOptionError(
                    f"{name}={getattr(self, name)!r} is invalid: must be True, False or None "
                    "(None: on CUDA where it helps)")
        if self.packed_attention is not None:
            _check_choice("packed_attention", self.packed_attention, PACKED_ATTENTIONS)
        if self.batch_invariant and self.packed_attention not in (None, "varlen"):
            raise InvalidOptionError(
                f"packed_attention={self.packed_attention!r} is invalid with "
                "batch_invariant=True: it needs one attention kernel for every budget "
                "(packed_attention='varlen', which batch_invariant picks)")
        for name in ("static_graphs", "backed_size_oblivious", "verify", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidOptionError(
                    f"{name}={getattr(self, name)!r} is invalid: must be True or False"
                )
        tol = self.verify_tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not tol > 0):
            raise InvalidOptionError(
                f"verify_tolerance={tol!r} is invalid: must be a positive number or None"
            )
        _check_memory_bound(self.max_graph_memory)
        if (self.min_budget is not None and self.max_budget is not None
                and self.min_budget > self.max_budget):
            raise InvalidOptionError(
                f"min_budget={self.min_budget} is larger than max_budget={self.max_budget}"
            )
        if self.budgets is not None and self.max_items_per_graph is not None:
            check_items_fit(self.max_items_per_graph, self.budgets[0])
        if self.backed_size_oblivious and self.inner_compiler not in ("auto", "eager"):
            raise InvalidOptionError(
                f"backed_size_oblivious=True is invalid with inner_compiler="
                f"{self.inner_compiler!r}: it needs inner_compiler='eager' (turned on in a "
                "running process it ended an Inductor inner graph in an illegal memory access "
                "on torch 2.11; 'auto' picks 'eager' with it)")
        if self.batch_invariant:
            if self.inner_compiler not in ("auto", "eager"):
                raise InvalidOptionError(
                    f"batch_invariant=True is invalid with inner_compiler="
                    f"{self.inner_compiler!r}: an output that does not depend on the batch "
                    "needs the traced kernels (inner_compiler 'eager', or 'auto', which picks "
                    "them with batch_invariant)")
        if self.inner_compiler == "tensorrt" and importlib.util.find_spec("torch_tensorrt") is None:
            raise MissingDependencyError(
                "inner_compiler='tensorrt' needs torch-tensorrt, which is not installed: "
                "pip install 'vit-graph-backend[tensorrt]' (torch-tensorrt pins one torch minor "
                "version and its native TensorRT libraries come from NVIDIA's package index), "
                "or use inner_compiler='inductor'"
            )

    def inner_compiler_for(self, *, cuda: bool, packed: bool = False) -> str:
        """The inner compiler a graph gets: ``inner_compiler`` itself unless it is ``"auto"``.

        ``"auto"`` resolves to ``"inductor"`` for a ``torch.compile`` graph on a CUDA device:
        inside the CUDA graphs it replaces eager's unfused elementwise kernels (norms, bias,
        activations, residual adds) by fused ones, which pays where the kernels set the time
        (large images, batches of 8 and more) and costs nothing where launches did, since the
        graph already removed those. It resolves to ``"eager"`` on other devices (no graphs,
        and a compile that CPU users did not ask for), for packed towers (their adapters fuse
        the kernels that pay and measured faster than Inductor over the whole tower; README,
        "Packed towers") and with ``backed_size_oblivious=True`` (eager only, see above).

        Args:
            cuda: the graph runs on a CUDA device.
            packed: the graph is a packed tower's compute (``serve``), not a Dynamo graph.
        """
        if self.inner_compiler != "auto":
            return self.inner_compiler
        if packed or not cuda or self.backed_size_oblivious or self.batch_invariant:
            return "eager"
        return "inductor"

    @classmethod
    def from_compile_kwargs(
        cls, options: Mapping[str, Any] | None = None, mode: str | None = None
    ) -> VitGraphOptions:
        """Build options from ``torch.compile``'s ``options=`` dict or ``mode=`` string.

        ``torch.compile`` refuses ``mode`` and ``options`` together, and so does this function.

        Raises:
            InvalidOptionError: unknown mode or key (with the valid ones), or a bad value.
        """
        if options is not None and mode is not None:
            raise InvalidOptionError(
                f"mode={mode!r} and options={dict(options)!r} were both given: pass one of them"
            )
        if mode is not None:
            if mode not in MODES:
                raise InvalidOptionError(
                    f"mode={mode!r} is invalid: must be one of {sorted(MODES)}"
                )
            return cls(**MODES[mode])
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidOptionError(
                f"options={options!r} is invalid: must be a dict of option names to values"
            )
        return cls.from_dict(options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VitGraphOptions:
        """Inverse of :meth:`to_dict`; unknown keys raise with a "did you mean"."""
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (budgets as a list)."""
        data = asdict(self)
        if data["budgets"] is not None:
            data["budgets"] = list(data["budgets"])
        return data

    def resolve(self, model_range: tuple[int, int] | None = None, *,
                batched: bool = False) -> BudgetConfig:
        """The one resolution of these options into budgets and per-graph caps.

        Every consumer goes through here: the runtime for a packed encoder (against its
        ``get_encoder_cudagraph_budget_range()``), the backend for ``torch.compile`` graphs
        (``batched=True``), ``vitgraph plan`` and ``vitgraph bench``; so the plan a user previews
        is the plan the runtime replays.

        Args:
            model_range: the model's ``(min_budget, max_budget)``; ``min_budget``/``max_budget``
                given here override its ends (a lone one past the other end moves that end too).
                ``None`` with ``batched=True``: ``(1, DEFAULT_BATCHED_MAX_BUDGET)`` rows.
            batched: a batched ``[B, C, H, W]`` graph: budgets count rows, a call is one item
                (one slot per graph), the ladder defaults to ``DEFAULT_BATCHED_LADDER_STEPS``.

        Raises:
            InvalidOptionError: a packed-only option on a batched graph, or a combination the
                model's range makes impossible (see :meth:`BudgetConfig.resolve`).
        """
        if batched:
            for name in PACKED_ONLY_OPTIONS:
                value = getattr(self, name)
                if value is not None:
                    raise InvalidOptionError(
                        f"{name}={value!r} does not apply to torch.compile(backend='vitgraph'): "
                        "a batched encoder's graph holds the rows of one call, and budgets count "
                        "rows (bound them with max_budget). It is an option of packed encoders: "
                        f"serve(model, {name}={value!r})")
            model_range = model_range or (1, DEFAULT_BATCHED_MAX_BUDGET)
        elif model_range is None:
            raise InvalidOptionError("a packed encoder's options resolve against its "
                                     "model_range=(min_budget, max_budget); none was given")
        lo = self.min_budget if self.min_budget is not None else model_range[0]
        hi = self.max_budget if self.max_budget is not None else model_range[1]
        if self.min_budget is not None and self.max_budget is None and lo > hi:
            hi = lo
        if self.max_budget is not None and self.min_budget is None and lo > hi:
            lo = hi
        default_steps = DEFAULT_BATCHED_LADDER_STEPS if batched else DEFAULT_LADDER_STEPS
        return BudgetConfig.resolve(
            (lo, hi),
            budgets=self.budgets,
            max_batch_size=1 if batched else self.max_items_per_graph,
            max_frames_per_batch=self.max_frames_per_batch,
            ladder_steps=self.ladder_steps if self.ladder_steps is not None else default_steps,
            items_name="max_items_per_graph",
        )



_dataclass_init = VitGraphOptions.__init__


@functools.wraps(_dataclass_init)
def _init(self: VitGraphOptions, *args: Any, **kwargs: Any) -> None:
    # an unknown keyword is an option error like any other, with the valid names
    valid = [f.name for f in fields(VitGraphOptions)]
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidOptionError(
                f"unknown vitgraph option {key!r}{hint}; valid options: {', '.join(valid)}")
    _dataclass_init(self, *args, **kwargs)


VitGraphOptions.__init__ = _init  # type: ignore[method-assign]


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidOptionError(f"{name}={value!r} is invalid: must be one of {allowed}")


def _check_memory_bound(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(
            f"max_graph_memory={value!r} is invalid: must be an int (bytes), a float in (0, 1] "
            "(fraction of free device memory) or None")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise InvalidOptionError(
            f"max_graph_memory={value!r} is invalid: a float is a fraction of free device "
            "memory and must be in (0, 1]; give bytes as an int")
    if isinstance(value, int) and value < 1:
        raise InvalidOptionError(
            f"max_graph_memory={value!r} is invalid: bytes must be a positive int")
