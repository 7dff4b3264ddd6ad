"""Host time of one served packed tower's calls in two or more modes interleaved call by call, for
the probes of this folder that compare modes in one process (across processes the host varies by
more than the changes they measure: ``benchmarks/results/packed_call_host_time_*``).

Per mode, right after a device sync (as at a request's start) and back to back (the GPU busy
with the previous call), the medians of: ``to launch``, from the call's start to its first
graph launch; ``call``, its host time; ``call + sync``, the call and a device sync after it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

CONDITIONS = ("after sync", "back to back")
_COLUMNS = (("to launch", 11), ("call", 9), ("call + sync", 13))


def arguments(doc: str, sides: str, name: str,
              required: Sequence[tuple[str, str]] = ()) -> argparse.Namespace:
    """The probes' options: ``--sides`` (image sides in patches, comma-separated), ``--calls``
    (per mode and condition) and ``--name`` (of the output file), and a probe's own ``required``
    ones, ``(flag, help)``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag, text in required:
        parser.add_argument(flag, required=True, help=text)
    parser.add_argument("--sides", default=sides)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--name", default=name)
    return parser.parse_args()


@contextmanager
def launches(*served: Any) -> Iterator[dict[str, int]]:
    """While open, the dict it yields holds under ``"launch"`` the ``perf_counter_ns`` of the
    first graph launch since it was last cleared (the graph classes of every tower given: two
    builds of the package have a class each)."""
    marks: dict[str, int] = {}
    types = {type(next(iter(one.manager.graphs.entries.values())).graph) for one in served}
    replays = {graph_type: graph_type.replay for graph_type in types}

    def marked(replay):
        def mark(self, *args, **kwargs):
            marks.setdefault("launch", time.perf_counter_ns())
            return replay(self, *args, **kwargs)
        return mark

    for graph_type, replay in replays.items():
        graph_type.replay = marked(replay)
    try:
        yield marks
    finally:
        for graph_type, replay in replays.items():
            graph_type.replay = replay


def interleaved(served: Any, pixels: Any, grid: Any, modes: Sequence[str],
                set_mode: Callable[[str], None], calls: int, warm: int = 4,
                ) -> dict[tuple[str, str], dict[str, list[float]]]:
    """``calls`` calls of ``served(pixels, grid)`` per mode and condition, the modes taken in
    turn call by call (``set_mode(mode)`` before each, outside the timing), after ``warm``
    calls not counted; us per call, by (condition, mode) and column. ``served`` may also map
    each mode to its own served tower (two builds of the package, say)."""
    import torch

    per_mode = served if isinstance(served, Mapping) else dict.fromkeys(modes, served)
    rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with launches(*per_mode.values()) as marks, torch.inference_mode():
        for condition in CONDITIONS:
            sync = condition == "after sync"
            for i in range(len(modes) * calls + warm):
                mode = modes[i % len(modes)]
                set_mode(mode)
                if sync:
                    torch.cuda.synchronize()
                marks.clear()
                call = per_mode[mode]
                start = time.perf_counter_ns()
                call(pixels, grid)
                end = time.perf_counter_ns()
                if sync:
                    torch.cuda.synchronize()
                if i < warm:
                    continue
                row = rows[(condition, mode)]
                row["to launch"].append((marks["launch"] - start) / 1e3)
                row["call"].append((end - start) / 1e3)
                if sync:
                    row["call + sync"].append((time.perf_counter_ns() - start) / 1e3)
            torch.cuda.synchronize()
    return rows


def header(mode_label: str, width: int) -> str:
    """The column titles of :func:`table_lines`' rows."""
    return (f"{'patches':>8} {'condition':<13} {mode_label:<{width}}"
            + "".join(f"{name:>{n}}" for name, n in _COLUMNS))


def table_lines(rows: dict[tuple[str, str], dict[str, list[float]]], patches: int,
                modes: Sequence[str], width: int) -> list[str]:
    """One line per condition and mode: the medians of :func:`interleaved`'s columns."""
    lines = []
    for condition in CONDITIONS:
        for mode in modes:
            row = rows[(condition, mode)]
            lines.append(f"{patches:>8} {condition:<13} {mode:<{width}}" + "".join(
                f"{statistics.median(row[name]):>{n}.1f}" if row.get(name) else f"{'':>{n}}"
                for name, n in _COLUMNS))
    return lines
