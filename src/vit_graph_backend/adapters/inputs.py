"""The call inputs of packed towers (``pixel_values`` + ``grid_thw``), checked in one place.

:func:`check_packed_inputs` is the only reader of a call's raw inputs: the item specs, the eager
forward and the replay buffers all go through it, so every path accepts the same inputs. A bad
input raises :class:`~vit_graph_backend.errors.InvalidInputError` from the specs call, before any
plan is made: an error inside a replay would disable the budget's graph for every later call.
:func:`grid_tensor` turns a list of ``[t, h, w]`` rows (or a NumPy array) into ``int64``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["PackedCall", "PackedInputs", "check_packed_inputs", "grid_tensor"]

#: ``(t, h, w)``: temporal patches, height and width in patches.
Grid = tuple[int, int, int]

_GRID_SHAPE = "shape (items, 3), one [t, h, w] row per image or video"


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def grid_tensor(grid_thw: Any) -> torch.Tensor:
    """``grid_thw`` (a tensor, NumPy array, or list/tuple of ``[t, h, w]`` rows) as a 2-D integer
    tensor ``(items, 3)``; a list or array becomes ``int64``. Values are checked by
    :func:`check_packed_inputs`.

    Raises:
        InvalidInputError: for another type, a ragged or non-integer list, a float or bool
            tensor, a shape other than ``(items, 3)`` or no items.
    """
    if not isinstance(grid_thw, torch.Tensor):
        # NumPy arrays too: what an HF processor returns with return_tensors="np"
        if not isinstance(grid_thw, (list, tuple)) and not hasattr(grid_thw, "__array__"):
            raise InvalidInputError(
                f"grid_thw of type {type(grid_thw).__name__} is invalid: must be an integer "
                f"tensor, array or list of [t, h, w] rows, {_GRID_SHAPE}")
        try:
            # no dtype here: int64 would silently truncate a float such as 4.5
            converted = torch.as_tensor(grid_thw)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError(
                f"grid_thw={grid_thw!r} is invalid: must be a list of [t, h, w] rows of "
                f"integers, {_GRID_SHAPE} ({exc})") from None
        if converted.numel() and not _integer_dtype(converted.dtype):
            raise InvalidInputError(
                f"grid_thw={grid_thw!r} is invalid: t, h and w must be integers")
        grid_thw = converted.to(torch.int64)
    elif not _integer_dtype(grid_thw.dtype):
        raise InvalidInputError(
            f"grid_thw of dtype {grid_thw.dtype} is invalid: must be an integer tensor "
            "(torch.int64 as the HF processor emits, or another integer dtype)")
    if grid_thw.numel() == 0:
        raise InvalidInputError(
            f"grid_thw of shape {tuple(grid_thw.shape)} is invalid: it holds no item; a call "
            f"needs at least one [t, h, w] row, {_GRID_SHAPE}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise InvalidInputError(
            f"grid_thw of shape {tuple(grid_thw.shape)} is invalid: must be {_GRID_SHAPE} "
            "(a single item is [[t, h, w]], not [t, h, w])")
    return grid_thw


class PackedCall(dict):
    """The input mapping of one packed call, made anew per call. It carries the call's checked
    grids, so specs and buffers read ``grid_thw`` once (each read of a CUDA grid is a host sync);
    living only as long as the call, the record is never stale."""

    __slots__ = ("checked", "rows")

    def __init__(self, pixel_values: Any, grid_thw: Any,
                 rows: list[Grid] | None = None) -> None:
        super().__init__(pixel_values=pixel_values, grid_thw=grid_thw)
        self.checked: tuple[Any, Any, list[Grid]] | None = None
        #: ``grid_thw``'s rows as Python ints when the caller gave a list (no read-back)
        self.rows = rows


@dataclass(frozen=True)
class PackedInputs:
    """A call's checked inputs."""

    grids: list[Grid]  # one (t, h, w) per item, Python ints
    pixel_values: torch.Tensor  # the (sum of t*h*w, patch_dim) patch rows, as given


def check_packed_inputs(inputs: Mapping[str, Any], *, merge: int, patch_dim: int,
                        rows: list[Grid] | None = None) -> PackedInputs:
    """Check a call's ``grid_thw`` and ``pixel_values`` against each other and the tower.

    Args:
        merge: the tower's ``spatial_merge_size``: ``h`` and ``w`` must be multiples of it.
        patch_dim: the tower's ``C * temporal_patch * patch**2``: the pixel rows' width.
        rows: ``grid_thw``'s rows as Python ints, if known (``PackedCall.rows``): checked
            instead of reading the tensor.

    Raises:
        InvalidInputError: (a ``ValueError``) naming the input, the value and what is allowed.
    """
    if not isinstance(inputs, Mapping) or "grid_thw" not in inputs:
        given = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise InvalidInputError(
            f"inputs {given} are invalid: must be a mapping with 'pixel_values' and 'grid_thw'")
    if rows is None:
        grid = grid_tensor(inputs["grid_thw"])
        grids = [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]
    else:
        grids = rows
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise InvalidInputError(
                f"grid_thw[{i}]={[t, h, w]} is invalid: t, h, w must be positive and h, w "
                f"multiples of spatial_merge_size={merge}")
    if "pixel_values" not in inputs:
        raise InvalidInputError(
            f"inputs {sorted(inputs)} are invalid: 'pixel_values' is missing (the patch rows "
            "the HF processor emits with grid_thw)")
    pixels = inputs["pixel_values"]
    rows = sum(t * h * w for t, h, w in grids)
    if not isinstance(pixels, torch.Tensor):
        raise InvalidInputError(
            f"pixel_values of type {type(pixels).__name__} is invalid: must be a tensor; "
            f"{_expected(rows, patch_dim)}")
    if not pixels.dtype.is_floating_point:
        raise InvalidInputError(
            f"pixel_values of dtype {pixels.dtype} is invalid: must be a floating tensor (the "
            "normalized patches the HF processor emits)")
    if pixels.dim() != 2 or pixels.shape[0] != rows or pixels.shape[1] != patch_dim:
        raise InvalidInputError(
            f"pixel_values of shape {tuple(pixels.shape)} does not match grid_thw "
            f"{[list(g) for g in grids]}: {_expected(rows, patch_dim)}")
    return PackedInputs(grids, pixels)


def _expected(rows: int, patch_dim: int) -> str:
    # built only for an error: the check runs on every call
    return (f"expected ({rows}, {patch_dim}): sum of t*h*w over grid_thw rows, each "
            "C*temporal_patch*patch**2 wide")
