"""Which rank encodes which item: the pure assignment behind data-parallel encoders.

Pure Python, a function of the items' specs and the world size only, so every rank computes the
same assignment from the same call without talking to the others. :func:`assign_items` takes
the longest processing time first, ties to caller order and lowest rank: deterministic; every rank
gets an item when there are enough; the busiest rank's cost is at most
``total / world_size + max_item_cost``. A world of 1 gives rank 0 every item in caller order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..specs import EncoderItemSpec, check_positive_int

__all__ = ["DEFAULT_ATTENTION_ROWS", "Assignment", "assign_items", "item_cost"]

#: Rows at which an item's attention costs as much as its linear layers (a starting point, not a
#: measurement).
DEFAULT_ATTENTION_ROWS = 4096


def item_cost(spec: EncoderItemSpec, attention_rows: int = DEFAULT_ATTENTION_ROWS) -> float:
    """Relative encoding cost of one item: input rows plus attention's quadratic term per frame,
    ``frames * (rows / frames) ** 2 / attention_rows``."""
    per_frame = spec.input_size / spec.frames
    return spec.input_size + spec.frames * per_frame * per_frame / attention_rows


@dataclass(frozen=True)
class Assignment:
    """Items per rank, each rank's in caller order, and each rank's total cost."""

    #: ``ranks[r]``: the sorted tuple of item indices rank ``r`` encodes
    ranks: tuple[tuple[int, ...], ...]
    #: ``costs[r]``: the summed :func:`item_cost` of those items
    costs: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """``(busiest - least busy) / busiest`` rank cost; 0.0 for no work."""
        busiest = max(self.costs, default=0.0)
        return (busiest - min(self.costs, default=0.0)) / busiest if busiest else 0.0

    def rank_of(self) -> list[int]:
        """``rank_of()[i]`` is the rank that encodes item ``i``."""
        owner = [0] * sum(len(items) for items in self.ranks)
        for rank, items in enumerate(self.ranks):
            for item in items:
                owner[item] = rank
        return owner


def assign_items(specs: Sequence[EncoderItemSpec], world_size: int, *,
                 attention_rows: int = DEFAULT_ATTENTION_ROWS) -> Assignment:
    """Spread ``specs`` (the call's, in caller order) over ``world_size`` ranks, balancing
    :func:`item_cost`.

    Raises:
        InvalidOptionError: (a ``ValueError``) for a ``world_size`` or ``attention_rows`` that is
            not a positive integer, or an item that is not an ``EncoderItemSpec``.
    """
    check_positive_int("world_size", world_size)
    check_positive_int("attention_rows", attention_rows)
    for i, spec in enumerate(specs):
        if not isinstance(spec, EncoderItemSpec):
            raise InvalidOptionError(
                f"specs[{i}]={spec!r} is invalid: must be an EncoderItemSpec")
    costs = [item_cost(spec, attention_rows) for spec in specs]
    loads = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for item in sorted(range(len(specs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += costs[item]
        owned[rank].append(item)
    return Assignment(tuple(tuple(sorted(items)) for items in owned), tuple(loads))
