"""Moving rows in and out of a budget's static buffers: pad, split, reassemble, compare.

A short replay buffer is copied into the head of its static buffer and the tail zeroed, so no
stale or NaN padding survives. :func:`write_inputs` skips copies a replay does not need, since
host time per call is tight on the packed path: a budget remembers per buffer how many leading
rows may be non-zero (not for buffers sharing storage), and
:class:`~vit_graph_backend.protocol.StampedBuffers` whose stamp filled the buffers last are not
loaded again. Anything else that writes static buffers calls the entry's ``forget_inputs()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..planner import Segment
from ..protocol import StampedBuffers

__all__ = ["assemble", "copy_padded", "head_copy", "infer_device_dtype", "input_tensors",
           "map_output", "max_rel_error", "needs_grad", "output_rows", "output_tensors",
           "split_rows", "verify_tolerance", "write_inputs"]

_DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def verify_tolerance(options: Any, dtype: torch.dtype) -> float:
    """The largest relative error ``verify=True`` accepts: the option's, else by ``dtype``."""
    return options.verify_tolerance or _DEFAULT_TOLERANCE.get(dtype, 1e-3)


def map_output(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to a tensor output, or to each tensor of a tuple/list output."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(t) for t in out)


def head_copy(out: Any, rows: int) -> Any:
    """A copy of the first ``rows`` rows of a tensor output, or of each tensor of a tuple/list
    output (no closure per call: this runs after every replay)."""
    if isinstance(out, torch.Tensor):
        return out[:rows].clone()
    return type(out)(t[:rows].clone() for t in out)


def max_rel_error(actual: Any, expected: Any) -> float:
    """Largest absolute difference over the tensors of two outputs, relative to each expected
    tensor's largest magnitude (at least 1); ``inf`` if any difference is NaN."""
    worst = 0.0
    for a, e in zip(output_tensors(actual), output_tensors(expected)):
        scale = max(float(e.abs().max()) if e.numel() else 0.0, 1.0)
        diff = (a.float() - e.float()).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        if not (err == err):  # NaN
            return float("inf")
        worst = max(worst, err / scale)
    return worst


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an output: one tensor or a sequence of them."""
    return [out] if isinstance(out, torch.Tensor) else list(out)


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    """The tensors among a call's inputs (a mapping's values, a sequence, or one tensor)."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        return [values]
    return [v for v in values if isinstance(v, torch.Tensor)]


def write_inputs(entry: Any, values: Mapping[str, torch.Tensor]) -> None:
    """Write one replay's buffers into ``entry``'s static buffers (a ``capture.BudgetGraph``),
    skipping what they already hold."""
    stamp = values.stamp if isinstance(values, StampedBuffers) else None
    aliased, dirty = entry.aliased_keys(), entry.dirty
    if stamp is None or entry.stamp is not stamp:
        entry.stamp = None  # a write that fails half way leaves no stamp behind
        if stamp is not None:
            loaded = values.load()  # type: ignore[attr-defined]
            for key, value in loaded.items():
                copy_padded(entry.static, key, value, None if key in aliased else dirty)
            entry.written.update(loaded)
    for key, value in values.items():
        copy_padded(entry.static, key, value, None if key in aliased else dirty)
    if not entry.written.issuperset(values):
        entry.written.update(values)
    entry.stamp = stamp


def copy_padded(static: dict[str, torch.Tensor], key: str, value: torch.Tensor,
                dirty: dict[str, int] | None = None) -> None:
    """Copy ``value`` into the head of ``static[key]`` and zero the rest of its rows. A pinned
    host ``value`` is copied without a host sync (the caller never writes it again). ``dirty``,
    when given, holds per key how many leading rows may be non-zero (absent: all); only rows
    between ``value``'s end and that count are zeroed, and the count is updated."""
    try:
        target = static[key]
    except KeyError:
        raise KeyError(f"replay buffer {key!r} has no capture buffer (have {sorted(static)})"
                       ) from None
    if value.shape == target.shape:
        target.copy_(value, non_blocking=value.device != target.device and value.is_pinned())
        if dirty is not None:
            dirty.pop(key, None)  # every row may be non-zero now
        return
    n = value.shape[0]
    if value.dim() != target.dim() or value.shape[1:] != target.shape[1:] or n > target.shape[0]:
        raise ValueError(f"replay buffer {key!r} of shape {tuple(value.shape)} does not fit its "
                         f"capture buffer of shape {tuple(target.shape)}")
    target[:n].copy_(value)
    if dirty is None:
        target[n:].zero_()
        return
    end = dirty.get(key, target.shape[0])
    if end > n:
        target[n:end].zero_()
    dirty[key] = n  # only once the tail is zero: a failed write leaves the larger count


def split_rows(out: Any, segments: Sequence[Segment]) -> list[Any]:
    """Per-segment views of a packed output whose rows hold the segments back to back."""
    if len(segments) == 1 and output_rows(out) == segments[0].tokens:
        return [out]  # one segment filling the output: no view needed
    result, offset = [], 0
    for seg in segments:
        lo, hi = offset, offset + seg.tokens
        result.append(map_output(out, lambda t, lo=lo, hi=hi: t[lo:hi]))
        offset = hi
    return result


def output_rows(out: Any) -> int:
    """The rows of an output's first tensor."""
    return (out if isinstance(out, torch.Tensor) else out[0]).shape[0]


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
    """``(device, dtype)`` given, else those of ``model``'s first parameter (CPU/fp32 if none)."""
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
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
