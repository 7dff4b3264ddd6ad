"""``epilogue_fusion="auto"``: a linear layer and its activation as one GEMM where that is faster.

Inductor runs ``act(F.linear(x, W, b))`` as a cuBLAS GEMM plus a pointwise kernel and never fuses
the two (its Triton GEMMs lose to cuBLAS at ViT shapes). ``compile.linear_rewrite`` turns such
pairs into ``vitgraph::linear_act``, which picks per shape among a Triton GEMM with the activation
in its epilogue, cuBLAS + an activation kernel and (tanh GELU with bias) cuBLASLt's epilogue,
timed from CUDA-graph replays the first time the shape runs outside a capture; neither wins
everywhere (docs/performance.md). ``vitgraph::linear_silu_mul`` is the SiLU-gated form on a weight
packed by :func:`pack_gated`. Without CUDA, Hopper, Triton or aligned operands, both ops run
PyTorch's ops. :meth:`LinearActChoices.prefetch` starts kernel builds in the background.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from ..cache_dir import keep_choice, kept_choice
from ..errors import error_line, out_of_memory
from ..runtime.capture import capture_lock
from ..runtime.timing import choice_key, graph_ms, time_each

__all__ = ["ACTIVATIONS", "CHOICES", "DTYPES", "GATED", "GATE_CHUNK", "LinearActChoices",
           "activation_of", "activation_reference", "fused_epilogue_unavailable", "gated_width",
           "linear_act", "linear_act_reference", "linear_silu_mul", "linear_silu_mul_reference",
           "pack_gated", "tma_unavailable"]

log = logging.getLogger(__name__)

#: The activations the op takes (``_linear_act_triton.ACTIVATIONS`` codes them for the kernels).
ACTIVATIONS: tuple[str, ...] = ("quick_gelu", "gelu", "gelu_tanh")
#: The gated form's name where the choices and kernels name an activation.
GATED = "silu_mul"
#: Rows of the gate, then of the up projection, that alternate in a packed gated weight: half
#: the fused kernel's tile width.
GATE_CHUNK = 128
#: Fused tile configurations timed per shape (the kernel module's ``CONFIGS`` names the fields):
#: 128x256 wins large shapes, 128x128 small ones.
FUSED_CONFIGS: tuple[tuple[int, ...], ...] = ((128, 256, 64, 3, 8, 0),
                                              (128, 256, 64, 4, 8, 0),
                                              (128, 128, 64, 4, 8, 0))
#: The gated form's configurations: tiles ``2 * GATE_CHUNK`` wide (a gate chunk and its up chunk).
GATED_CONFIGS: tuple[tuple[int, ...], ...] = tuple(c for c in FUSED_CONFIGS
                                                   if c[1] == 2 * GATE_CHUNK)
#: The tensor memory accelerator the kernel loads through: Hopper (9.0) and newer.
MIN_CAPABILITY = (9, 0)
#: The dtypes the fused kernels take.
DTYPES = (torch.bfloat16, torch.float16)
_UNFUSED = "cublas+activation"  # cuBLAS, then one activation (or SiLU-mul) kernel
#: cuBLASLt's GEMM with bias and tanh GELU in its epilogue (``_compat.addmm_gelu_tanh``)
_CUBLASLT = "cublaslt epilogue"
_PYTORCH = "pytorch"  # what runs when neither Triton path does for a shape
#: Calls per timing graph and replays timed (``runtime.timing.graph_ms``).
_GRAPH_CALLS, _GRAPH_REPS = 3, 3
#: Shapes timed at most; past this, new shapes take cuBLAS + activation untimed.
MAX_TIMED_SHAPES = 1024


def activation_reference(y: torch.Tensor, activation: str) -> torch.Tensor:
    """One of :data:`ACTIVATIONS` in PyTorch's ops."""
    if activation == "quick_gelu":
        return y * torch.sigmoid(1.702 * y)
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


def linear_act_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """What the rewritten nodes computed, in PyTorch's ops."""
    return activation_reference(F.linear(x, weight, bias), activation)


def gated_width(width: int) -> int:
    """The packed width of a gated MLP ``width`` wide: a multiple of :data:`GATE_CHUNK`."""
    return -(-width // GATE_CHUNK) * GATE_CHUNK


def pack_gated(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The gate and up weights (``[W, K]``) or biases (``[W]``) packed for :func:`linear_silu_mul`:
    ``[2 * gated_width(W), ...]``, :data:`GATE_CHUNK`-row chunks alternating gate, up, with zero
    rows past ``W``. Written into ``out`` when given (its padding rows must already be zero)."""
    width, rest = gate.shape[0], tuple(gate.shape[1:])
    padded = gated_width(width)
    if out is None:
        out = gate.new_zeros((2 * padded, *rest))
    chunks = out.view(padded // GATE_CHUNK, 2, GATE_CHUNK, *rest)
    full, tail = divmod(width, GATE_CHUNK)
    for half, src in enumerate((gate, up)):
        chunks[:full, half].copy_(src[:full * GATE_CHUNK].view(full, GATE_CHUNK, *rest))
        if tail:
            chunks[full, half, :tail].copy_(src[full * GATE_CHUNK:])
    return out


def linear_silu_mul_reference(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_silu_mul` in PyTorch's ops."""
    y = F.linear(x, weight, bias).unflatten(-1, (-1, 2, GATE_CHUNK))
    return (F.silu(y[..., 0, :]) * y[..., 1, :]).flatten(-2)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str) -> torch.Tensor:
    if activation == GATED:
        return linear_silu_mul_reference(x, weight, bias)
    return linear_act_reference(x, weight, bias, activation)


def activation_of(module: Any) -> str | None:
    """Which of :data:`ACTIVATIONS` a callable computes (``None``: none), judged by its values on
    a float64 probe, so any class computing one counts."""
    probe = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = module(probe)
    except Exception:  # not an elementwise function of one tensor
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    return next((name for name in ACTIVATIONS
                 if torch.allclose(got, activation_reference(probe, name), rtol=1e-9,
                                   atol=1e-12)), None)


@torch.library.custom_op("vitgraph::linear_act", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor")
def _linear_act_op(x, weight, bias, activation):
    return CHOICES.run(x, weight, bias, activation)


@_linear_act_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` through the op ``vitgraph::linear_act``: the faster
    way per shape on a Hopper GPU, PyTorch's ops elsewhere."""
    return torch.ops.vitgraph.linear_act.default(x, weight, bias, activation)


def _check_packed(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape[0] % (2 * GATE_CHUNK):
        raise ValueError(f"linear_silu_mul takes a weight packed by pack_gated: 2-D with rows a "
                         f"multiple of {2 * GATE_CHUNK}, not of shape {tuple(weight.shape)}")


@torch.library.custom_op("vitgraph::linear_silu_mul", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
def _linear_silu_mul_op(x, weight, bias):
    _check_packed(weight)
    return CHOICES.run(x, weight, bias, GATED)


@_linear_silu_mul_op.register_fake
def _(x, weight, bias):
    _check_packed(weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)`` through the op
    ``vitgraph::linear_silu_mul``, ``weight``/``bias`` packed by :func:`pack_gated` (result
    ``gated_width(W)`` wide, padding columns zero); the faster way per shape on Hopper."""
    return torch.ops.vitgraph.linear_silu_mul.default(x, weight, bias)


def tma_unavailable(device: torch.device | None) -> str | None:
    """Why a Triton kernel that loads through Hopper's TMA cannot run on ``device`` (``None``: it can)."""
    if device is None or device.type != "cuda":
        return f"the graph runs on {device}, not a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{capability[0]}.{capability[1]}; the kernel needs {MIN_CAPABILITY[0]}."
                f"{MIN_CAPABILITY[1]} (Hopper's tensor memory accelerator) or newer")
    return None


def fused_epilogue_unavailable(device: torch.device | None) -> str | None:
    """Why the fused kernel cannot run on ``device`` (``None``: it can)."""
    return tma_unavailable(device) or _kernels()[1]


@functools.cache
def _kernels() -> tuple[Any, str | None]:
    """The Triton kernels module, or why it does not import."""
    try:
        from . import _linear_act_triton
        return _linear_act_triton, None
    except Exception as exc:  # Triton missing or too old for host tensor descriptors
        return None, f"Triton's kernels do not import ({type(exc).__name__}: {exc})"


#: What runs for a shape: ``_UNFUSED``, ``_CUBLASLT``, ``_PYTORCH`` or a fused tile
#: configuration.
Choice = str | tuple[int, ...]


class LinearActChoices:
    """Which way each shape runs, timed once per shape (thread-safe; one per process)."""

    def __init__(self) -> None:
        #: (device index, dtype, rows, K, N, activation, has bias) -> :data:`Choice`
        self.chosen: dict[tuple[Any, ...], Choice] = {}
        #: (gated, fused configuration or ``_CUBLASLT``) -> why it failed (not tried again)
        self.refused: dict[tuple[bool, Choice], str] = {}
        #: (device index, dtype, K, N, activation, has bias) -> the build :meth:`prefetch` began
        self._builds: dict[tuple[Any, ...], Future[None]] = {}
        self._builder: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def prefetch(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        """Begin compiling, in a background thread, the fused configurations a shape with this
        weight will time (they do not depend on the row count); the timing waits for what is
        left. Nothing when the kernels cannot run on the weight or no thread can start."""
        kernels = _kernels()[0]
        if (kernels is None or activation not in ACTIVATIONS  # the weight stands for rows of
                or not self._fusable(weight, weight, bias)):  # its device, dtype and width
            return
        key = (weight.device.index, weight.dtype, *weight.shape[::-1], activation,
               bias is not None)
        with self._lock:
            if key in self._builds:
                return
            configs = [c for c in FUSED_CONFIGS if (False, c) not in self.refused]
            # a few rows stand for all, allocated here rather than in the thread
            rows = weight.new_empty((128, weight.shape[1]))
            try:
                if self._builder is None:
                    self._builder = ThreadPoolExecutor(1, thread_name_prefix="vitgraph-prefetch")
                self._builds[key] = self._builder.submit(kernels.precompile, rows, weight, bias,
                                                         activation, configs)
            except RuntimeError:  # no thread to start: the timing compiles them
                pass

    @property
    def state(self) -> dict[str, Any]:
        """Shapes timed and what won each, and refused configurations with their reasons."""
        with self._lock:
            return {"chosen": {_describe(k): _name(v) for k, v in self.chosen.items()},
                    "refused": {_name(c).removeprefix("fused ") + (" gated" if gated else ""): why
                                for (gated, c), why in self.refused.items()}}

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: str) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not self._fusable(rows, weight, bias):
            return _reference(x, weight, bias, activation)
        n = weight.shape[0] // 2 if activation == GATED else weight.shape[0]
        key = (x.device.index, x.dtype, *rows.shape, n, activation, bias is not None)
        with torch.cuda.device(x.device):  # Triton launches on the current device
            with self._lock:
                choice = self.chosen.get(key)
                timed = (choice is None and len(self.chosen) < MAX_TIMED_SHAPES
                         and not torch.cuda.is_current_stream_capturing())
            kept = None
            if timed:  # an earlier process's timing (use_cache_dir); never first run in a capture
                kept = self._kept(rows, weight, bias, activation)
                if kept is not None:
                    with self._lock:
                        choice, timed = self.chosen.setdefault(key, kept), False
                    kept = kept if choice == kept else None   # else another thread's, launched
            # the capture lock first, as a capture's warm-up holds it; busy (another thread
            # captures): cuBLAS + activation this time, timed at a later call
            lock = capture_lock(x.device)
            if timed and lock.acquire(blocking=False):
                try:   # timed without self._lock: a timing's capture waits for other threads'
                    # calls beside a background preparation (capture._Gate), which take it
                    with self._lock:
                        choice = self.chosen.get(key)
                        timed = choice is None and len(self.chosen) < MAX_TIMED_SHAPES
                    if timed:  # one thread at a time: the capture lock is held
                        choice = self._time(rows, weight, bias, activation)
                        with self._lock:
                            choice = self.chosen.setdefault(key, choice)
                finally:
                    lock.release()
            if kept is not None and kept != _UNFUSED:   # its first launch in this process
                out = self._first_kept_launch(key, kept, rows, weight, bias, activation)
            else:
                out = self._launch(_UNFUSED if choice is None else choice, rows, weight, bias,
                                   activation)
        return out.reshape(*x.shape[:-1], n)

    def _first_kept_launch(self, key: tuple[Any, ...], choice: Choice, rows: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor | None,
                           activation: str) -> torch.Tensor:
        """Launch a choice read back from an earlier process; one that fails here (a kernel
        that does not build on this host) is refused as a timed one would be, the shape timed
        again at its next call, and cuBLAS + activation serves this one."""
        try:
            return self._launch(choice, rows, weight, bias, activation)
        except Exception as exc:
            reason = error_line(exc)
            with self._lock:
                if not out_of_memory(exc):
                    self.refused[(activation == GATED, choice)] = reason
                if self.chosen.get(key) == choice:
                    del self.chosen[key]
            log.warning("vitgraph: linear+%s: the kept %s failed (%s); cuBLAS + activation "
                        "serves this call, and the shape is timed again", activation,
                        _name(choice), reason)
            return self._launch(_UNFUSED, rows, weight, bias, activation)

    @staticmethod
    def _fusable(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        # the descriptors need 16-byte aligned bases and row strides
        return (rows.is_cuda and rows.dtype in DTYPES and weight.dtype == rows.dtype
                and rows.is_contiguous() and weight.is_contiguous() and rows.shape[0] > 0
                and rows.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0
                and rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
                and (bias is None or bias.is_contiguous())
                and _kernels()[0] is not None
                and tuple(torch.cuda.get_device_capability(rows.device)) >= MIN_CAPABILITY)

    @staticmethod
    def _launch(choice: Choice, rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, activation: str) -> torch.Tensor:
        kernels = _kernels()[0]
        if choice == _PYTORCH:
            return _reference(rows, weight, bias, activation)
        if choice == _UNFUSED:
            if activation == GATED:
                return kernels.silu_mul_packed(F.linear(rows, weight, bias), GATE_CHUNK)
            return kernels.activation_(F.linear(rows, weight, bias), activation)
        if choice == _CUBLASLT:
            return _compat.addmm_gelu_tanh(rows, weight, bias)
        return kernels.linear_act(rows, weight, bias, activation, choice)

    def _candidates(self, activation: str, bias: torch.Tensor | None) -> list[Choice]:
        """The ways a shape may run: cuBLAS + activation, then those not refused."""
        gated = activation == GATED
        fused = [c for c in (GATED_CONFIGS if gated else FUSED_CONFIGS)
                 if (gated, c) not in self.refused]
        lt = ([_CUBLASLT] if activation == "gelu_tanh" and bias is not None
              and (False, _CUBLASLT) not in self.refused else [])
        return [_UNFUSED, *lt, *fused]

    def _kept(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str) -> Choice | None:
        """The choice an earlier timing kept for this shape, if still a candidate."""
        kept = kept_choice(_kept_key(rows, weight, bias, activation))
        choice = tuple(kept) if isinstance(kept, list) else kept
        if choice is not None and choice in self._candidates(activation, bias):
            log.debug("vitgraph: linear+%s at %d x %d -> %d: %s, as kept", activation,
                      *rows.shape, weight.shape[0], _name(choice))
            return choice
        return None

    def _time(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str) -> Choice:
        """The fastest way for this shape, each candidate timed from CUDA-graph replays; kept for
        later processes unless memory ran short for one."""
        gated = activation == GATED
        candidates = self._candidates(activation, bias)
        fused = [c for c in candidates if isinstance(c, tuple)]
        kernels = _kernels()[0]
        build = self._builds.get((rows.device.index, rows.dtype, rows.shape[1], weight.shape[0],
                                  activation, bias is not None))
        if build is not None:  # begun by prefetch: wait for it (a failure recurs at the launch)
            build.exception()
        if kernels is not None and rows.is_cuda:  # cold caches: the compiles side by side
            kernels.precompile(rows, weight, bias, activation, fused)
        times, failures = time_each(
            candidates, lambda choice: self._launch(choice, rows, weight, bias, activation),
            calls=_GRAPH_CALLS, reps=_GRAPH_REPS, timer=graph_ms)
        short = [(choice, reason) for choice, (reason, memory) in failures.items() if memory]
        short_of_memory = bool(short)
        if short:  # the moment's memory, not the kernels: refused for no other shape
            log.warning("vitgraph: linear+%s at %d x %d -> %d: %d of %d kernels not timed, %s",
                        activation, *rows.shape, weight.shape[0], len(short), len(candidates),
                        short[0][1])
        for choice, (reason, memory) in failures.items():
            if memory:
                continue
            if choice == _UNFUSED:
                log.warning("vitgraph: the %s kernel after cuBLAS failed at %d x %d -> %d "
                            "(%s)", activation, *rows.shape, weight.shape[0], reason)
            else:
                with self._lock:
                    self.refused[(gated, choice)] = reason
                log.warning("vitgraph: linear+%s: %s refused (%s); not tried again",
                            activation, _name(choice), reason)
        if not times:  # out of memory: cuBLAS + activation, as for a shape met in a capture
            return _UNFUSED if short_of_memory else _PYTORCH
        best = min(times, key=times.__getitem__)
        if not short_of_memory:   # the moment's memory aside, the winner is the shape's
            keep_choice(_kept_key(rows, weight, bias, activation), best)
        log.debug("vitgraph: linear+%s at %d x %d -> %d: %s (%s)", activation, *rows.shape,
                  weight.shape[0], _name(best),
                  ", ".join(f"{_name(k)} {v:.4f} ms" for k, v in times.items()))
        return best


def _kept_key(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str) -> str:
    return choice_key("linear_act", rows.device, rows.dtype, *rows.shape, weight.shape[0],
                      activation, bias is not None)


def _name(choice: Choice) -> str:
    """A choice's name for logs and state."""
    return choice if isinstance(choice, str) else "fused " + "x".join(map(str, choice))


def _describe(key: tuple[Any, ...]) -> str:
    index, dtype, m, k, n, activation, has_bias = key
    return (f"cuda:{index} {str(dtype).removeprefix('torch.')} {m}x{k} -> {n} {activation}"
            f"{' +bias' if has_bias else ''}")


#: The process's choices (shared by every graph).
CHOICES = LinearActChoices()
