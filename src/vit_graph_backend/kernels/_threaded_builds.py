"""Build several kernel configurations side by side in threads, launching nothing.

Triton compiles mostly outside the GIL, so building the configurations a shape will time in
threads overlaps cold compiles of seconds each. Failures are swallowed: the configuration's launch
compiles it again and raises where its caller sees why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["build_side_by_side"]

Config = TypeVar("Config")


def build_side_by_side(build: Callable[[Config], object], configs: Sequence[Config]) -> None:
    """Call ``build(config)`` for every configuration, each in its own thread, and wait for all.

    Fewer than two configurations: nothing to overlap, nothing built. Build exceptions and a pool
    with no thread to start are swallowed; each launch then compiles in turn."""
    if len(configs) < 2:
        return
    try:
        with ThreadPoolExecutor(len(configs), thread_name_prefix="vitgraph-triton") as pool:
            for done in [pool.submit(build, config) for config in configs]:
                done.exception()  # a failure recurs at the launch
    except RuntimeError:
        pass
