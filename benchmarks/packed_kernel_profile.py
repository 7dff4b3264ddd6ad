"""Where the GPU time of one large-image packed call goes: kernels summed by kind.

Two calls issue 13's targets are about, each served from its CUDA graph and profiled with
``torch.profiler`` over 5 calls (after a warm-up), kernels summed by kind with
``clip_kernel_profile._kind`` (GEMM, attention, Inductor's Triton kernels, other):

- the Qwen3-VL-8B-shaped tower on one 1312 x 1312 px image in the budget that fits it exactly
  (``budgets=[1681]``, ``max_items_per_graph=1``), with ``attention="varlen"`` and ``"dense"``;
- the Qwen2.5-VL-3B-shaped tower on one image of 16,384 patches (defaults, with
  ``epilogue_fusion="off"`` in part ``qwen25-epilogue-off``, and with the window layers on flash
  varlen instead of the short-segment kernel in part ``qwen25-windows-flash``).

Each row also gives the FLOP rate of the attention kernels (attention FLOPs counted as
``4 * rows^2 * hidden`` per full-attention layer, the window layers' as ``4 * rows * window_rows *
hidden``) so the attention's distance from the matmul peak shows.

Each row also gives the kernels per call and the wall time of one call (the GPU idle at its
start): where the kernels' sum falls short of it, the graph's GPU waits between kernels. A
second line splits that wall: the call's host time (call to return, the GPU idle at its start),
the span from the first kernel's start to the last one's end, and the GPU's idle time inside the
span (the gaps between kernels, summed; how many exceed 5 us; the three largest, with the kernels
on either side), from one profile per call (median of 3). With ``--back-to-back N``, a third
line gives the same for N calls issued with no sync between them, per call, beside their
unprofiled wall: whether the kernels run slower in a sustained stream (clocks under the power
limit) than one call at a time.

Usage: python benchmarks/packed_kernel_profile.py [--parts qwen3,qwen25,qwen25-epilogue-off]
[--side 128] [--back-to-back 20]. Text to stdout and $OUT/packed_kernel_profile.txt when $OUT
is set.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402
from clip_kernel_profile import _kind  # noqa: E402
from qwen_stream import flash_windows  # noqa: E402
from qwen_stream import tower as qwen25_tower  # noqa: E402

from vit_graph_backend import serve  # noqa: E402
from vit_graph_backend.bench.models import MODELS, build_model  # noqa: E402
from vit_graph_backend.bench.timing import CallTimer  # noqa: E402


def kernel_events(fn, calls: int = 5) -> list[tuple[str, float]]:
    """Every CUDA kernel of ``calls`` calls of ``fn`` (after 3 warm-up calls), in launch order:
    ``(name, ms)``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(event.name, event.device_time / 1e3) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0]


def kernel_times(fn, calls: int = 5) -> tuple[dict[str, float], dict[str, float], float]:
    kinds: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    events = kernel_events(fn, calls)
    for name, ms in events:
        kinds[_kind(name)] += ms / calls
        kernels[name[:80]] += ms / calls
    return dict(kinds), dict(kernels.most_common(5)), len(events) / calls


def _gaps(fn, calls: int = 1) -> tuple[float, float, list[float], list[tuple[float, str, str]],
                                       float]:
    """``calls`` calls' kernels, issued with no sync between them and profiled alone: span ms,
    idle ms inside it, every gap (ms), the largest three with the kernels around them, and the
    kernels' busy ms."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0)
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append(((start - end) / 1e3, before[:40], name[:40]))
        if stop > end:
            end, before = stop, name
    idle = sum(g for g, _, _ in gaps)
    span = (end - spans[0][0]) / 1e3
    return span, idle, [g for g, _, _ in gaps], sorted(gaps)[-3:][::-1], span - idle


def _named(top: list[tuple[float, str, str]]) -> str:
    return "; ".join(f"{g * 1e3:.0f} us {a} -> {b}" for g, a, b in top)


def back_to_back(fn, calls: int) -> str:
    """Per call, ``calls`` calls issued with no sync between them: the kernels' busy time and the
    idle time inside the profiled span, and the unprofiled wall (the host hidden behind the GPU):
    whether the kernels themselves run slower in a sustained stream than one call at a time."""
    span, idle, gaps, top, busy = _gaps(fn, calls)
    timer = CallTimer("cuda")
    wall = timer.wall(lambda: [fn() for _ in range(calls)])[1] * 1e3 / calls
    return (f"    back to back, {calls} calls: kernels busy {busy / calls:.2f} ms per call, idle "
            f"inside the span {idle / calls:.3f} ms per call; unprofiled wall {wall:.2f} ms per "
            f"call; largest gaps: {_named(top)}")


def timeline(fn, calls: int = 3) -> str:
    """Host ms, span and idle inside the span (see the module docstring), medians of ``calls``."""
    timer = CallTimer("cuda")
    host = [timer.host(fn)[1] * 1e3 for _ in range(calls)]
    runs = sorted((_gaps(fn) for _ in range(calls)), key=lambda run: run[1])
    span, idle, gaps, top, _ = runs[len(runs) // 2]
    return (f"    host {statistics.median(host):.3f} ms; span {span:.2f} ms, idle inside it "
            f"{idle:.3f} ms in {len(gaps)} gaps ({sum(g > 5e-3 for g in gaps)} over 5 us, "
            f"{sum(g for g in gaps if g > 5e-3):.3f} ms); largest: {_named(top)}")


def wall_ms(fn, reps: int = 10) -> float:
    """Median ms of one call between device syncs (the GPU idle at each start)."""
    timer = CallTimer("cuda")
    return statistics.median(timer.wall(fn)[1] * 1e3 for _ in range(reps))


def report(name: str, fn, attention_flops: float, streamed: int = 0) -> list[str]:
    kinds, top, count = kernel_times(fn)
    total = sum(kinds.values())
    wall = wall_ms(fn)
    attn = kinds.get("attention", 0.0)
    rate = attention_flops / (attn / 1e3) / 1e12 if attn else float("nan")
    lines = [f"{name}: {total:.2f} ms of kernels per call; attention {attn:.2f} ms "
             f"({rate:.0f} TFLOP/s); {count:.0f} kernels per call; wall {wall:.2f} ms per "
             f"call, the kernels busy {total / wall:.0%} of it", timeline(fn)]
    if streamed:
        lines.append(back_to_back(fn, streamed))
    lines += [f"    {kind:<52}{ms:8.2f} ms" for kind, ms in sorted(kinds.items(),
                                                                  key=lambda kv: -kv[1])]
    lines += ["    top kernels:"] + [f"      {ms:7.2f} ms  {k}" for k, ms in top.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="qwen3,qwen25")
    parser.add_argument("--side", type=int, default=128,
                        help="the Qwen2.5 image's side in patches (128: 16,384 patches)")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="also profile N calls issued with no sync between them (Qwen2.5)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; bf16, random "
             "weights; ms per call, summed over the graph's kernels"]
    # towers built outside inference_mode: inference-tensor weights turn the padded MLP copies
    # off (adapters/_aligned_mlp.py), which would not be the default configuration
    if "qwen3" in parts:
        lines += qwen3_rows()
    for part, settings in (("qwen25", {}), ("qwen25-epilogue-off", {"epilogue_fusion": "off"}),
                           ("qwen25-windows-flash", {})):
        if part in parts:
            lines += qwen25_rows(settings, part.endswith("windows-flash"), args.side,
                                 args.back_to_back)
    emit(lines, "packed_kernel_profile")


def qwen3_rows() -> list[str]:
    lines = []
    built = build_model(MODELS["qwen3-vl-8b"], device="cuda", dtype=torch.bfloat16,
                        dynamic_size=True)
    rows, hidden, depth = 82 * 82, 1152, 27
    pv = torch.randn(rows, 3 * 2 * 16 * 16, device="cuda", dtype=torch.bfloat16)
    grid = [[1, 82, 82]]
    flops = depth * 4 * rows * rows * hidden
    for attention in ("varlen", "dense"):
        served = serve(built.module, budgets=[1681], max_items_per_graph=1, attention=attention)
        with torch.inference_mode():
            lines += report(f"qwen3-vl-8b, 1312 px (6724 rows), attention={attention}",
                            lambda served=served: served(pv, grid), flops)
        del served
    del built
    torch.cuda.empty_cache()
    return lines


def qwen25_rows(settings: dict, windows_flash: bool = False, side: int = 128,
                streamed: int = 0) -> list[str]:
    served = serve(qwen25_tower(), **settings)
    if windows_flash:
        flash_windows(served)
    rows, hidden = side * side, 1280
    pv = torch.randn(rows, 1176, device="cuda", dtype=torch.bfloat16)
    grid = [[1, side, side]]
    window_rows = 4 * 4 * 4  # 112 px windows: 4 x 4 merged tokens of 4 rows
    flops = 4 * 4 * rows * rows * hidden + 28 * 4 * rows * window_rows * hidden
    name = "default options" if not settings else str(settings)
    name += ", window layers on flash varlen" if windows_flash else ""
    with torch.inference_mode():
        lines = report(f"qwen2.5-vl-3b, {rows} patches ({name})", lambda: served(pv, grid),
                       flops, streamed)
    lines.append(f"    window kernels by static rows: "
                 f"{served.encoder.attention_state['windows']['by_rows']}")
    return lines


if __name__ == "__main__":
    main()
