"""Moving rows in and out of a budget's static buffers: pad, split, reassemble, compare.

Pure tensor helpers of :mod:`~vit_graph_backend.runtime`, kept apart so the manager reads as
the life cycle of its graphs. A short replay buffer is copied into the head of its static buffer
and the tail is zeroed, so no stale or NaN padding survives from an earlier replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .planner import Segment

__all__ = ["assemble", "copy_padded", "infer_device_dtype", "input_tensors", "map_output",
           "max_rel_error", "needs_grad", "split_rows", "verify_tolerance"]

_DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def verify_tolerance(options: Any, dtype: torch.dtype) -> float:
    """The largest relative error ``verify=True`` accepts: the option's, else by ``dtype``."""
    return options.verify_tolerance or _DEFAULT_TOLERANCE.get(dtype, 1e-3)


def map_output(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to a tensor output, or to each tensor of a tuple/list output."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(t) for t in out)


def max_rel_error(actual: Any, expected: Any) -> float:
    """Largest absolute difference over the tensors of two outputs, relative to each expected
    tensor's largest magnitude (at least 1); ``inf`` if any difference is NaN."""
    worst = 0.0
    for a, e in zip(_tensors(actual), _tensors(expected)):
        scale = max(float(e.abs().max()) if e.numel() else 0.0, 1.0)
        diff = (a.float() - e.float()).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if not (err == err):  # NaN
            return float("inf")
        worst = max(worst, err / scale)
    return worst


def _tensors(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    """The tensors among a call's inputs (a mapping's values, a sequence, or one tensor)."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        return [values]
    return [v for v in values if isinstance(v, torch.Tensor)]


def copy_padded(static: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    """Copy ``value`` into the head of ``static[key]`` and zero the rest of its rows.

    A ``value`` in pinned host memory is copied to the GPU without waiting for it: a plain host
    tensor's copy synchronizes the stream, so the host could not run ahead of a busy GPU. The
    caller hands such a value over, never writing it again; PyTorch's pinned-memory allocator
    keeps a freed block until the copies from it are done.
    """
    try:
        target = static[key]
    except KeyError:
        raise KeyError(f"replay buffer {key!r} has no capture buffer (have {sorted(static)})"
                       ) from None
    if value.shape == target.shape:
        target.copy_(value, non_blocking=value.device != target.device and value.is_pinned())
        return
    n = value.shape[0]
    if value.dim() != target.dim() or value.shape[1:] != target.shape[1:] or n > target.shape[0]:
        raise ValueError(f"replay buffer {key!r} of shape {tuple(value.shape)} does not fit its "
                         f"capture buffer of shape {tuple(target.shape)}")
    target[:n].copy_(value)
    target[n:].zero_()


def split_rows(out: Any, segments: Sequence[Segment]) -> list[Any]:
    """Per-segment views of a packed output whose rows hold the segments back to back."""
    result, offset = [], 0
    for seg in segments:
        lo, hi = offset, offset + seg.tokens
        result.append(map_output(out, lambda t, lo=lo, hi=hi: t[lo:hi]))
        offset = hi
    return result


def assemble(pieces: list[tuple[int, Any]]) -> Any:
    """One item's output from its ``(start, output)`` pieces (chunks of a cut item)."""
    if len(pieces) == 1:
        return pieces[0][1]
    pieces.sort(key=lambda p: p[0])
    first = pieces[0][1]
    if isinstance(first, torch.Tensor):
        return torch.cat([p[1] for p in pieces])
    return type(first)(torch.cat([p[1][i] for p in pieces]) for i in range(len(first)))


def infer_device_dtype(model: Any, device: Any = None, dtype: Any = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` given, or else those of ``model``'s first parameter (CPU/fp32 if none)."""
    param = None
    if isinstance(model, torch.nn.Module):
        param = next(iter(model.parameters()), None)
    if device is None:
        device = param.device if param is not None else torch.device("cpu")
    if dtype is None:
        dtype = param.dtype if param is not None else torch.float32
    return torch.device(device), dtype


def needs_grad(model: Any, inputs: Any) -> bool:
    """True if a call of ``model`` on ``inputs`` needs autograd (the model's own
    ``requires_grad(inputs)`` if it has one, else any input or parameter requiring grad)."""
    grad_fn = getattr(model, "requires_grad", None)
    if callable(grad_fn):
        return bool(grad_fn(inputs))
    return any(t.requires_grad for t in input_tensors(inputs)) or (
        isinstance(model, torch.nn.Module) and any(p.requires_grad for p in model.parameters()))
