"""Build several kernel configurations side by side in threads, launching nothing.

The package's Triton kernels (``_linear_act_kernels``, ``adapters/_segment_attention_kernel``)
time a few tile configurations per shape; cold, each configuration is a compile of seconds. Triton
compiles outside the GIL for most of that time, so building them in threads before the timing
launches them overlaps the compiles. Each caller says how to build one configuration; this module
only runs the builds and keeps a failure from escaping, since the launch of that configuration
compiles it again and raises there, where its caller sees why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["build_side_by_side"]

Config = TypeVar("Config")


def build_side_by_side(build: Callable[[Config], object], configs: Sequence[Config]) -> None:
    """Call ``build(config)`` for every configuration, each in its own thread, and wait for all.

    Fewer than two configurations: nothing is built (the launch compiles the one there is, with
    nothing to overlap). A build's exception is swallowed; so is a pool with no thread to start
    (a thread limit, the interpreter's shutdown), after which each launch compiles in turn."""
    if len(configs) < 2:
        return
    try:
        with ThreadPoolExecutor(len(configs), thread_name_prefix="vitgraph-triton") as pool:
            for done in [pool.submit(build, config) for config in configs]:
                done.exception()  # waited for; a failure recurs at the launch, with its reason
    except RuntimeError:
        pass
