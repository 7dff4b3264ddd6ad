"""Named, seeded request streams for ``vitgraph bench``.

A stream is a list of :class:`Call`, each the items (images or videos) one forward receives, in
pixels and frames; the model registry turns them into tensors and specs. The same name, modality,
seed and size space always give the same stream (``random.Random`` seeded with a string).
:data:`WORKLOADS` describes each workload (``max_batch`` caps a call's items).

Modality: ``image`` keeps a workload's images, ``video`` makes each a video (lower resolution,
a frame count from the model's list), ``image+video`` adds one video to every call. Batched
``[B, C, H, W]`` models take images of one size per call only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MODALITIES", "WORKLOADS", "Call", "Item", "SizeSpace", "Workload", "make_stream",
           "resolve_modality"]

MODALITIES: tuple[str, ...] = ("image", "video", "image+video")


@dataclass(frozen=True)
class Item:
    """One image (``frames == 1``) or video, in pixels and frames."""

    height: int
    width: int
    frames: int = 1

    @property
    def is_video(self) -> bool:
        """True for a video item."""
        return self.frames > 1


@dataclass(frozen=True)
class Call:
    """The items of one forward call, in the caller's order."""

    items: tuple[Item, ...]


@dataclass(frozen=True)
class SizeSpace:
    """The sizes a model accepts, from its registry entry.

    Attributes:
        base: the default square side, in pixels.
        sizes: allowed sides, in pixels (multiples of the model's patch, times merge if packed).
        one_size_per_call: batched ``[B, C, H, W]`` models: all items of a call share one square
            size; packed models draw height and width per item.
        video_frames: allowed frame counts of a video; empty if the model takes no video.
    """

    base: int
    sizes: tuple[int, ...]
    one_size_per_call: bool
    video_frames: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    """A named stream shape: ``draw(rng, max_batch, space)`` gives one call's images."""

    name: str
    description: str
    draw: Callable[[random.Random, int, SizeSpace], list[Item]]
    modality: str | None = None  # the modality the workload implies, if any


def _square(side: int, n: int) -> list[Item]:
    return [Item(side, side)] * n


def _sized(rng: random.Random, space: SizeSpace, n: int) -> list[Item]:
    """``n`` images: of one drawn square size on batched models, each its own h x w on packed."""
    if space.one_size_per_call:
        return _square(rng.choice(space.sizes), n)
    return [Item(rng.choice(space.sizes), rng.choice(space.sizes)) for _ in range(n)]


def _mixed_sizes(rng: random.Random, max_batch: int, space: SizeSpace) -> list[Item]:
    if space.one_size_per_call:  # the size is drawn before the count
        return _square(rng.choice(space.sizes), rng.randint(1, min(4, max_batch)))
    return _sized(rng, space, 1)


def _gpu_bound(rng: random.Random, max_batch: int, space: SizeSpace) -> list[Item]:
    if space.one_size_per_call:
        return _square(space.base, rng.randint(min(8, max_batch), max_batch))
    large = space.sizes[len(space.sizes) * 2 // 3:]  # the largest third, at least one size
    return [Item(rng.choice(large), rng.choice(large))]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("fixed-batch", "every call: max-batch images of the base size",
                 lambda rng, n, space: _square(space.base, n)),
        Workload("uniform-batch", "1..max-batch images of the base size, uniformly",
                 lambda rng, n, space: _square(space.base, rng.randint(1, n))),
        Workload("mixed-sizes", "the image size changes per call (packed: 1 image, any h x w)",
                 _mixed_sizes),
        Workload("multi-image", "1..4 images per call, each its own size on packed models",
                 lambda rng, n, space: _sized(rng, space, rng.randint(1, min(4, n)))),
        Workload("mixed-batch", "every call: max-batch images, each its own size on packed "
                 "models (batched: one size per call)",
                 lambda rng, n, space: _sized(rng, space, n)),
        Workload("video", "one video per call, frame count and size drawn per call",
                 lambda rng, n, space: _square(space.base, 1), modality="video"),
        Workload("gpu-bound", "batched: 8..max-batch images per call; packed: one image from the "
                 "largest third of sizes", _gpu_bound),
    )
}


def resolve_modality(workload: str, modality: str | None, *, packed: bool) -> str:
    """The modality a run uses, or ``ValueError`` naming the clash.

    Args:
        workload: a :data:`WORKLOADS` name.
        modality: the user's ``--modality``, or ``None`` for the workload's own (``image`` unless
            the workload is ``video``).
        packed: whether the model takes packed items (only those take video).
    """
    implied = WORKLOADS[workload].modality
    resolved = modality or implied or "image"
    if resolved not in MODALITIES:
        raise ValueError(f"modality={resolved!r} is invalid: choose from {', '.join(MODALITIES)}")
    if implied == "video" and resolved == "image":
        raise ValueError(
            f"workload {workload!r} streams videos: use --modality video or image+video, not image")
    if resolved != "image" and not packed:
        raise ValueError(f"modality {resolved!r} needs a packed (Qwen-VL) model: batched "
                         "[B, C, H, W] models take images only")
    return resolved


def _video(rng: random.Random, space: SizeSpace) -> Item:
    low = space.sizes[: max(1, len(space.sizes) // 2)]  # videos come at lower resolution
    return Item(rng.choice(low), rng.choice(low), rng.choice(space.video_frames))


def make_stream(workload: str, modality: str, space: SizeSpace, *, calls: int, seed: int,
                max_batch: int) -> list[Call]:
    """The seeded stream of ``calls`` calls (>= 1) of ``workload`` in ``modality`` (resolved: see
    :func:`resolve_modality`); ``max_batch`` (>= 1) caps the images a call gets from the workload.

    Raises:
        ValueError: for an unknown workload or modality, or video on a model without video.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is invalid: choose from {', '.join(WORKLOADS)}")
    if modality not in MODALITIES:
        raise ValueError(f"modality={modality!r} is invalid: choose from {', '.join(MODALITIES)}")
    if modality != "image" and not space.video_frames:
        raise ValueError(f"modality {modality!r} needs a model that takes video")
    if calls < 1 or max_batch < 1:
        raise ValueError(f"calls={calls} and max_batch={max_batch} must both be >= 1")
    rng = random.Random(f"{workload}/{modality}/{seed}")
    draw = WORKLOADS[workload].draw
    stream = []
    for _ in range(calls):
        images = draw(rng, max_batch, space)
        if modality == "video":
            items = [_video(rng, space) for _ in images]
        elif modality == "image+video":
            items = [*images, _video(rng, space)]
        else:
            items = images
        stream.append(Call(tuple(items)))
    return stream
