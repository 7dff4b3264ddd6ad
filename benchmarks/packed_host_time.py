"""Host time of one packed call, and what in it waits for the GPU.

The Qwen2.5-VL-3B-shaped tower (random weights, bf16) served with the defaults, one image per call
of 448 to 896 px. Its GPU work (several ms) is far longer than the host's, so a call that returns
to Python before the GPU finishes shows its true host time; a call whose host time grows to the GPU
time hides a blocking device-to-host sync or a pageable copy that waits for the stream.

Per grid form (a CUDA tensor, as ``generate()`` passes it; a CPU tensor, as the processor makes
it; a list): median host ms (call start to return, no sync) and total ms (to the end of the GPU
work), and the issue time per call when the 40 calls run back to back without a sync (median of
5 such passes): a call that never waits for the GPU is issued in its host time, one that waits (a
device-to-host read, a plain host-to-device copy, which synchronizes the stream) in about its GPU
time. Then the host time of ``CUDAGraph.replay()`` alone per captured budget, and ``cProfile`` of
the calls (a CUDA grid and a list, the GPU idle at each call's start; a list of 40 grids and a list
of one grid, back to back; a list of grids not seen before, the GPU idle): the top host functions
by own and by cumulative time, in microseconds per call. The forms' rows repeat 40 calls of
different grids three times (each call's batch metadata is staged but not in its budget's static
buffers); the row ``list, same`` repeats one grid with new pixels (the metadata stays in place:
only the pixel rows are copied); the row
``list, new`` has 40 calls whose grids the tower has not seen (nothing staged yet).

Measurement starts once the host is quiet: right after the first pass, Inductor's compile workers
(started by the adapters' first ``torch.compile``) load every core for several seconds, and host
times measured then are many times too high. The first line gives the probe before serving, after
the first pass, and how long the settling took.

Usage: python benchmarks/packed_host_time.py [--label NAME] [--no-profile]. Text to stdout
and to $OUT/packed_host_time[_NAME].txt when $OUT is set. To compare two source trees in one
run, call it once per tree with ``PYTHONPATH=<tree>/src`` and a label each.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen_stream import tower  # noqa: E402

import vit_graph_backend  # noqa: E402
from vit_graph_backend import serve  # noqa: E402


def calls(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        grid = [[1, rng.randrange(448, 897, 28) // 14, rng.randrange(448, 897, 28) // 14]]
        rows = grid[0][1] * grid[0][2]
        out.append((torch.randn(rows, 1176, device="cuda", dtype=torch.bfloat16), grid))
    return out


def timed(served, args, passes=5):
    """Host and total ms of each call (3 passes over ``args``, the GPU idle at each start), and
    the ms per call of a pass issued back to back (the median of ``passes`` such passes: one
    pass alone moved by a third between rows of one run)."""
    host, total = [], []
    for _ in range(3):
        for pv, grid in args:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            served(pv, grid)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append((t1 - t0) * 1e3)
            total.append((time.perf_counter() - t0) * 1e3)
    issues = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for pv, grid in args:  # back to back: the host runs ahead unless a call waits
            served(pv, grid)
        issues.append((time.perf_counter() - t0) * 1e3 / len(args))
        torch.cuda.synchronize()
    return host, total, statistics.median(issues)


def host_probe():
    """Microseconds of one small multi-threaded CPU op: its time rises many-fold while other
    processes load the cores (e.g. Inductor's compile workers starting after a first compile)."""
    x = torch.arange(100_000)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        (x * 2).sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


#: Microseconds the host probe reads at most on a quiet H100 machine (40 to 100 us measured).
QUIET_US = 150.0


def settle(quiet, limit=90.0):
    """Wait until the host probe is below twice the quieter of ``quiet`` and :data:`QUIET_US`
    three times in a row (or ``limit`` seconds; a probe taken while other processes loaded the
    host, 6.5 ms once, would otherwise let a busy host pass); returns the seconds waited and
    the probe's first value, the seconds with `` (not settled)`` appended at the limit."""
    start, first, calm = time.perf_counter(), host_probe(), 0
    bound = 2 * min(quiet, QUIET_US)
    while calm < 3 and time.perf_counter() - start < limit:
        calm = calm + 1 if host_probe() < bound else 0
        time.sleep(0.5)
    waited = f"{time.perf_counter() - start:.1f}" + ("" if calm >= 3 else " (not settled)")
    return waited, first


def profile_rows(prof, calls):
    """Every function of a ``cProfile`` run: ``(own us, cumulative us, calls, where)`` per
    served call (pstats' own table rounds to milliseconds)."""
    rows = []
    for (path, line, func), (_, ncalls, own, cumulative, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(path).name}:{line}({func})" if path != "~" else func
        rows.append((own * 1e6 / calls, cumulative * 1e6 / calls, ncalls / calls, where))
    return rows


def profile_table(prof, calls, count=28):
    """The top functions of a ``cProfile`` run, by own time then by cumulative, in microseconds
    per served call."""
    rows = profile_rows(prof, calls)
    out = [f"{'own us':>8}{'cum us':>8}{'n/call':>7}  function"]
    for key in (0, 1):
        out += [f"{o:8.1f}{c:8.1f}{n:7.1f}  {w[:110]}"
                for o, c, n, w in sorted(rows, key=lambda r: -r[key])[:count]]
        out.append("")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="", help="names the source tree in the output")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile tables")
    args_ = parser.parse_args()
    served = serve(tower())
    stream = calls(40)
    forms = {"cuda tensor": lambda g: torch.tensor(g, device="cuda"),
             "cpu tensor": lambda g: torch.tensor(g), "list": lambda g: g}
    source = Path(vit_graph_backend.__file__).parent
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
             "Qwen2.5-VL-3B-shaped tower, one image of 448..896 px per call",
             f"source {args_.label or '-'}: {source}",
             f"{'grid':<12}{'host ms p50':>12}{'total ms p50':>14}{'issue ms/call, no sync':>24}"]
    quiet = host_probe()
    with torch.inference_mode():
        for pv, g in stream:  # first pass: captures
            served(pv, forms["cuda tensor"](g))
        waited, busy = settle(quiet)
        lines.insert(2, f"host probe (a 1e5-element CPU op): {quiet:.0f} us before serving, "
                     f"{busy:.0f} us after the first pass, settled after {waited} s")
        rows = [(name, [(pv, form(g)) for pv, g in stream]) for name, form in forms.items()]
        # one grid, new pixels each call: the staged metadata is in place in the static buffers
        pv0, g0 = stream[0]
        rows.append(("list, same", [(torch.randn_like(pv0), g0) for _ in range(40)]))
        for name, args in rows:
            host, total, issue = timed(served, args)
            lines.append(f"{name:<12}{statistics.median(host):12.3f}"
                         f"{statistics.median(total):14.3f}{issue:24.3f}")
        # grids never seen before (nothing staged for them yet: adapters/_qwen_packing.py)
        host = []
        for pv, grid in calls(40, seed=1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            served(pv, grid)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        lines.append(f"{'list, new':<12}{statistics.median(host):12.3f}{'':>14}{'':>24}")
        # the host time of the graph launch alone, per captured budget, the GPU idle
        lines += ["", f"{'budget':>8}{'replay() host ms p50':>22}"]
        for budget, entry in sorted(served.manager.graphs.entries.items()):
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                entry.graph.replay()
                times.append((time.perf_counter() - t0) * 1e3)
            lines.append(f"{budget:>8}{statistics.median(times):22.3f}")
        torch.cuda.synchronize()
        profiled = (("cuda tensor", stream, False), ("list", stream, False),
                    ("list", stream, True), ("list, same", rows[-1][1], True),
                    ("list, new", calls(40, seed=2), False))
        for name, source, back_to_back in () if args_.no_profile else profiled:
            form = forms.get(name, forms["list"])
            args = [(pv, form(g)) for pv, g in source]
            prof = cProfile.Profile()
            for pv, grid in args:
                if not back_to_back:
                    torch.cuda.synchronize()  # the GPU idle at each call: host time alone
                prof.enable()
                served(pv, grid)
                prof.disable()
            torch.cuda.synchronize()
            how = "back to back" if back_to_back else "the GPU idle at each start"
            lines += ["", f"cProfile, {name} grid, {len(args)} calls, {how} (us per call):",
                      *profile_table(prof, len(args))]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        suffix = f"_{args_.label}" if args_.label else ""
        Path(os.environ["OUT"], f"packed_host_time{suffix}.txt").write_text(text)


if __name__ == "__main__":
    main()
