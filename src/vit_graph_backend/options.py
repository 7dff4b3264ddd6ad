"""`VitGraphOptions`: every setting of the backend, validated once, when options are built.

``torch.compile(model, backend="vitgraph", options={...})`` hands the dict to
:meth:`VitGraphOptions.from_compile_kwargs`; packed adapters take the same keys. Unknown keys, bad
values and impossible combinations raise :class:`~vit_graph_backend.errors.InvalidOptionError` (a
``ValueError``) at compile time, never at replay. The dataclass is frozen and holds tuples, so it
hashes and can key caches.
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
CAPTURE_MODES: tuple[str, ...] = ("all", "lazy", "background")
EPILOGUE_FUSIONS: tuple[str, ...] = ("auto", "off")
#: ``graph_launch``: device-launch instantiation where the driver allows, or ``CUDAGraph.replay()``.
GRAPH_LAUNCHES: tuple[str, ...] = ("auto", "torch")
PATCH_EMBEDDINGS: tuple[str, ...] = ("gemm", "conv")
PACKED_ATTENTIONS: tuple[str, ...] = ("auto", "varlen", "dense", "cudnn")

#: ``torch.compile(mode=...)`` presets; every mode replays CUDA graphs. ``reduce-overhead`` is
#: accepted because users reach for it for this purpose; here it means the default.
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {},
    "max-autotune": {"inner_compiler": "inductor"},
    "max-autotune-no-cudagraphs": {"inner_compiler": "inductor"},
}

#: Default largest budget, in rows, for batched ``[B, C, H, W]`` encoders; larger calls are cut
#: into chunks of this many rows.
DEFAULT_BATCHED_MAX_BUDGET = 32

#: Default ``ladder_steps`` for packed encoders: each doubling split in two (64, 96, 128, 192,
#: ..., 4096 tokens: 13 graphs), about halving expected padding against plain doubling.
DEFAULT_LADDER_STEPS = 2
#: Default ``ladder_steps`` for batched encoders (1, 2, 3, ..., 28, 32 rows: 16 graphs). Rows cost
#: linear compute, so padding is lost time and a finer ladder pays (docs/performance.md).
DEFAULT_BATCHED_LADDER_STEPS = 4

#: Options only a packed encoder can apply: a batched graph holds the rows of one call.
PACKED_ONLY_OPTIONS: tuple[str, ...] = ("max_items_per_graph", "max_frames_per_batch",
                                        "align_mlp", "fuse", "packed_attention")


@dataclass(frozen=True)
class VitGraphOptions:
    """Settings of the ``vitgraph`` backend.

    Args:
        budgets: token budgets (rows for batched encoders, output tokens for packed ones); default
            ``None``: a ladder from ``min_budget`` to ``max_budget``.
        min_budget: smallest ladder budget; default ``None``: the model's own (1 row for batched).
        max_budget: largest ladder budget; default ``None``: the model's own (32 rows for batched).
        ladder_steps: budgets per doubling of the ladder (1 to 16; more: less padding, more graphs);
            default ``None``: 2 for packed, 4 for batched encoders.
        max_items_per_graph: items one graph holds (packed encoders); default ``None``: derived,
            never above the smallest budget.
        max_frames_per_batch: video frames one graph holds; default ``None``: no frame cap.
        policy: ``"baseline"`` (default: pad to the smallest fitting budget) or ``"exact"`` (replay
            only exact budget sizes, run the rest eagerly).
        inner_compiler: what runs inside the graphs: ``"eager"``, ``"inductor"`` (its own CUDA
            graphs off), ``"tensorrt"`` or ``"auto"`` (default; :meth:`inner_compiler_for`).
        capture: ``"all"`` (default) captures every budget, largest first, at a shape's first
            call; ``"lazy"`` captures a budget when a batch first needs it; ``"background"``
            answers calls at once with the encoder's ``encoder_reference_forward`` while a
            thread captures every budget (without the caller's autocast or other thread
            state), then replays them; CUDA only, not with ``batch_invariant``; an encoder
            without that method captures inside the call.
        warmup_iters: eager runs of each budget before its capture, for lazy set-up and the memory
            estimate (default 1).
        max_graph_sets: graph sets kept for other dynamic dims (e.g. image size), least recently
            used freed first (default 4).
        static_graphs: serve Dynamo's static compiles from one exact-shape graph (default
            ``True``); ``False`` runs them eagerly.
        backed_size_oblivious: turn on PyTorch's process-wide ``backed_size_oblivious`` so dynamic
            graphs serve a batch of 1 (default ``False``; needs ``inner_compiler="eager"``).
        verify: compare each budget's first replay with eager and disable its graph on a mismatch
            beyond ``verify_tolerance`` (default ``False``).
        verify_tolerance: max abs error relative to the eager output's max abs value; default
            ``None``: by dtype (fp32 1e-3, fp16 1e-2, bf16 3e-2).
        max_graph_memory: bound on one encoder's graph memory: ``int`` bytes or a ``float`` in
            (0, 1] of free device memory; budgets over it are skipped. Default ``None``: no bound.
        epilogue_fusion: ``"auto"`` (default): linear + GELU as one op timed per shape against
            cuBLAS + activation on Hopper or newer (``fused_linear.py``); ``"off"``: left as is.
        graph_launch: ``"auto"`` (default): graphs instantiated for device launch (cheaper on the
            host) where allowed; ``"torch"``: always ``CUDAGraph.replay()``.
        batch_invariant: outputs bit-identical whatever the batch or packing (nothing chosen by
            timing, traced kernels); default ``False``, cost in docs/performance.md.
        patch_embedding: ``"gemm"`` (default): patch convolutions rewritten as one GEMM
            (``patch_rewrite.py``); ``"conv"``: left as convolutions.
        align_mlp: packed towers: MLPs from weight copies zero-padded to a multiple of 8 in width;
            default ``None``: on CUDA where the width needs it.
        fuse: packed towers: elementwise work as Inductor-fused kernels; default ``None``: on CUDA
            with Triton installed.
        packed_attention: packed towers' attention: default ``None`` (cuDNN where it imports, else
            flash varlen, Triton kernels where timed faster), ``"varlen"``, ``"cudnn"``,
            ``"dense"`` (dense SDPA for one-image budgets) or ``"auto"`` (dense timed per budget).

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
        warmup = self.warmup_iters
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise InvalidOptionError(f"warmup_iters={warmup!r} is invalid: must be an integer >= 0")
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
                    f"{name}={getattr(self, name)!r} is invalid: must be True or False")
        tol = self.verify_tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not tol > 0):
            raise InvalidOptionError(
                f"verify_tolerance={tol!r} is invalid: must be a positive number or None")
        _check_memory_bound(self.max_graph_memory)
        if (self.min_budget is not None and self.max_budget is not None
                and self.min_budget > self.max_budget):
            raise InvalidOptionError(
                f"min_budget={self.min_budget} is larger than max_budget={self.max_budget}")
        if self.budgets is not None and self.max_items_per_graph is not None:
            check_items_fit(self.max_items_per_graph, self.budgets[0])
        if self.backed_size_oblivious and self.inner_compiler not in ("auto", "eager"):
            raise InvalidOptionError(
                f"backed_size_oblivious=True is invalid with inner_compiler="
                f"{self.inner_compiler!r}: it needs inner_compiler='eager' (turned on in a "
                "running process it ended an Inductor inner graph in an illegal memory access "
                "on torch 2.11; 'auto' picks 'eager' with it)")
        if self.batch_invariant:
            if self.capture == "background":
                raise InvalidOptionError(
                    "capture='background' is invalid with batch_invariant=True: the calls "
                    "answered before the switch to graphs run other kernels; use capture='all' "
                    "or 'lazy'")
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
                "or use inner_compiler='inductor'")

    def inner_compiler_for(self, *, cuda: bool, packed: bool = False) -> str:
        """The inner compiler a graph gets: ``inner_compiler`` itself unless it is ``"auto"``.

        ``"auto"`` resolves to ``"inductor"`` for a ``torch.compile`` graph on a CUDA device (fused
        elementwise kernels inside the graphs), and to ``"eager"`` on other devices, for packed
        towers (``packed``: a tower's compute under ``serve``, whose adapter fuses its own
        kernels), and with ``backed_size_oblivious`` or ``batch_invariant``."""
        if self.inner_compiler != "auto":
            return self.inner_compiler
        if packed or not cuda or self.backed_size_oblivious or self.batch_invariant:
            return "eager"
        return "inductor"

    @classmethod
    def from_compile_kwargs(cls, options: Mapping[str, Any] | None = None,
                            mode: str | None = None) -> VitGraphOptions:
        """Build options from ``torch.compile``'s ``options=`` dict or ``mode=`` string (not both:
        ``torch.compile`` refuses them together, and so does this function).

        Raises:
            InvalidOptionError: unknown mode or key (with the valid ones), or a bad value."""
        if options is not None and mode is not None:
            raise InvalidOptionError(
                f"mode={mode!r} and options={dict(options)!r} were both given: pass one of them")
        if mode is not None:
            if mode not in MODES:
                raise InvalidOptionError(
                    f"mode={mode!r} is invalid: must be one of {sorted(MODES)}")
            return cls(**MODES[mode])
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidOptionError(
                f"options={options!r} is invalid: must be a dict of option names to values")
        return cls.from_dict(options)

    @classmethod
    def given(cls, options: VitGraphOptions | None, fields: Mapping[str, Any]) -> VitGraphOptions:
        """``options``, or options built from keyword ``fields``: an entry point's two ways to
        take settings, never both (both given, or a bad field: :class:`InvalidOptionError`)."""
        if options is None:
            return cls(**fields)
        if fields:
            raise InvalidOptionError(
                f"give options or option keywords, not both (got {sorted(fields)})")
        return options

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
        """The one resolution of these options into budgets and per-graph caps: the runtime, the
        backend, ``vitgraph plan`` and ``vitgraph bench`` all resolve here, so the plan a user
        previews is the plan the runtime replays.

        Args:
            model_range: the model's ``(min_budget, max_budget)``; ``min_budget``/``max_budget``
                given here override its ends (a lone one past the other end moves that end too).
                ``None`` with ``batched=True``: ``(1, DEFAULT_BATCHED_MAX_BUDGET)`` rows.
            batched: a batched ``[B, C, H, W]`` graph: budgets count rows, a call is one item
                (one slot per graph), the ladder defaults to ``DEFAULT_BATCHED_LADDER_STEPS``.

        Raises:
            InvalidOptionError: a packed-only option on a batched graph, or a combination the
                model's range makes impossible (see :meth:`BudgetConfig.resolve`)."""
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
        steps = self.ladder_steps
        if steps is None:
            steps = DEFAULT_BATCHED_LADDER_STEPS if batched else DEFAULT_LADDER_STEPS
        return BudgetConfig.resolve((lo, hi), budgets=self.budgets,
                                    max_batch_size=1 if batched else self.max_items_per_graph,
                                    max_frames_per_batch=self.max_frames_per_batch,
                                    ladder_steps=steps, items_name="max_items_per_graph")


_dataclass_init = VitGraphOptions.__init__


@functools.wraps(_dataclass_init)
def _init(self: VitGraphOptions, *args: Any, **kwargs: Any) -> None:
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
