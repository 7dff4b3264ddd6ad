"""`EncoderItemSpec`: the one description of an encoder item that every layer reads.

An *item* is one image or one video. The planner, the budget choice and the output slicing read
only specs, never model-specific inputs. Units: ``input_size`` counts input rows (patches, or batch
rows for batched encoders); ``output_tokens`` counts rows emitted after any spatial merge (the unit
of budgets); ``frames`` counts temporal frames (1 for an image).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidOptionError

__all__ = ["EncoderItemSpec", "check_positive_int"]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive ``int`` (``bool`` rejected), else :class:`InvalidOptionError`
    (a ``ValueError``) naming ``name``, the bad value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(
            f"{name}={value!r} is invalid: must be a positive integer, got {type(value).__name__}")
    if value <= 0:
        raise InvalidOptionError(f"{name}={value!r} is invalid: must be a positive integer (>= 1)")
    return value


@dataclass(frozen=True)
class EncoderItemSpec:
    """Size of one encoder item (an image or a video); a field that is not a positive integer
    raises :class:`InvalidOptionError` (a ``ValueError``).

    Args:
        input_size: input rows of the item (patches, or batch rows for batched encoders).
        output_tokens: rows the encoder emits for the item, after spatial merge.
        frames: temporal frames, 1 for an image.

    Example::

        >>> # a 448x448 image, patch 14, 2x2 spatial merge: 32*32 patches -> 16*16 tokens
        >>> EncoderItemSpec(input_size=1024, output_tokens=256)
        EncoderItemSpec(input_size=1024, output_tokens=256, frames=1)
    """

    input_size: int
    output_tokens: int
    frames: int = 1

    def __post_init__(self) -> None:
        check_positive_int("input_size", self.input_size)
        check_positive_int("output_tokens", self.output_tokens)
        check_positive_int("frames", self.frames)
