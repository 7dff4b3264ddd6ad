"""Why launching a captured graph costs the host 0.3 ms for some budgets and 0.01 ms for others.

``CUDAGraph.replay()`` of the Qwen2.5-VL-3B-shaped tower's graphs took 0.01 to 0.05 ms of host
time for budgets up to 512 tokens and 0.25 to 0.41 ms from 768 up
(``benchmarks/results/packed_call_host_time_*``), the GPU idle at each launch. This probe looks at
what the graphs hold and what a launch costs:

- ``synthetic``: graphs of 300 identical ops (matmuls of a few row counts, an elementwise add),
  replay host time and node census: which kernel properties make a launch slow.
- ``tower``: the tower served with several kernel and launch settings; per captured budget how
  the runtime launches it (``graph_launch``), the replay host time, the GPU time, and the census
  of the same computation captured again with ``keep_graph=True``: node types, edges
  (programmatic ones apart), kernel nodes with a thread block cluster or programmatic
  serialization, and the memsets of two budgets with the kernel each precedes.
- ``parts``: where one packed call's host time goes (the GPU idle at each call's start), the
  runtime's and the adapter's steps timed one by one, for 40 grids in turn (each call loads
  its batch's metadata) and for one grid repeated (the metadata stays in place), once the host
  is quiet (``packed_host_overhead.settle``).

The census reads the graph through the CUDA driver API (``ctypes`` on ``libcuda``).

Usage: python benchmarks/graph_launch_probe.py [--parts synthetic,tower,parts]
       [--configs default,varlen,unfused,epilogue-off,plain]. Text to stdout and to
$OUT/graph_launch_probe.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import gc
import os
import random
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child", 5: "empty",
              6: "wait", 7: "record", 10: "alloc", 11: "free", 12: "memop", 13: "cond"}
CLUSTER_DIMENSION, PROGRAMMATIC_SERIALIZATION = 4, 6  # CUlaunchAttributeID


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _kernel_name(node) -> str:
    cu = _driver()
    params = (ctypes.c_byte * 128)()  # CUDA_KERNEL_NODE_PARAMS_v2: func first, kern at 56
    if cu.cuGraphKernelNodeGetParams_v2(node, params) != 0:
        return "?"
    func, kern = struct.unpack_from("Q", params, 0)[0], struct.unpack_from("Q", params, 56)[0]
    name = ctypes.c_char_p()
    if func and cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)) == 0:
        return name.value.decode()[:70]
    if kern and cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(kern)) == 0:
        return name.value.decode()[:70]
    return "?"


def census(raw_graph: int) -> dict:
    """Node types, edges and the kernel nodes with launch attributes of one ``cudaGraph_t``."""
    cu, graph = _driver(), ctypes.c_void_p(raw_graph)
    count = ctypes.c_size_t(0)
    cu.cuGraphGetNodes(graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    cu.cuGraphGetNodes(graph, nodes, ctypes.byref(count))
    types, cluster, serial = collections.Counter(), collections.Counter(), collections.Counter()
    for node in nodes:
        kind = ctypes.c_int()
        cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        types[NODE_TYPES.get(kind.value, str(kind.value))] += 1
        if kind.value != 0:
            continue
        value = (ctypes.c_byte * 64)()
        if cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), CLUSTER_DIMENSION, value) == 0:
            dims = struct.unpack_from("III", value)
            if max(dims) > 1:
                cluster[_kernel_name(ctypes.c_void_p(node))] += 1
        value = (ctypes.c_byte * 64)()
        if cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), PROGRAMMATIC_SERIALIZATION,
                                            value) == 0 and struct.unpack_from("i", value)[0]:
            serial[_kernel_name(ctypes.c_void_p(node))] += 1
    edges = ctypes.c_size_t(0)
    cu.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(edges))
    programmatic = 0
    if edges.value:
        n = edges.value
        src, dst = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        data = (ctypes.c_byte * (8 * n))()
        cu.cuGraphGetEdges_v2(graph, src, dst, data, ctypes.byref(edges))
        programmatic = sum(1 for i in range(n) if data[8 * i + 2] != 0)
    return {"nodes": count.value, "types": dict(types), "edges": edges.value,
            "programmatic_edges": programmatic, "cluster": dict(cluster), "serial": dict(serial)}


def memsets(raw_graph: int) -> collections.Counter:
    """``(bytes, element size, the kernel that follows)`` of each memset node."""
    cu, graph = _driver(), ctypes.c_void_p(raw_graph)
    count = ctypes.c_size_t(0)
    cu.cuGraphGetNodes(graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    cu.cuGraphGetNodes(graph, nodes, ctypes.byref(count))
    found = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int()
        cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != 2:
            continue
        params = (ctypes.c_byte * 40)()
        cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), params)
        _, _, _, element, width, height = struct.unpack_from("QQIIQQ", params)
        n = ctypes.c_size_t(4)
        after = (ctypes.c_void_p * 4)()
        cu.cuGraphNodeGetDependentNodes_v2(ctypes.c_void_p(node), after, None, ctypes.byref(n))
        name = _kernel_name(ctypes.c_void_p(after[0])) if n.value else "-"
        found[(width * height * element, element, name)] += 1
    return found


def driver_launch_ms(raw_graph: int, flags: int, reps=20) -> tuple[float, float]:
    """Host ms of ``cuGraphLaunch`` of the graph instantiated by the driver with ``flags`` and
    uploaded first (the GPU idle at each launch), and the latency to the end of its GPU work."""
    cu = _driver()
    exec_ = ctypes.c_void_p()
    rc = cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), ctypes.c_void_p(raw_graph),
                                        ctypes.c_ulonglong(flags))
    if rc != 0:
        return float("nan"), float("nan")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cu.cuGraphUpload(exec_, stream)
    times, latency = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cu.cuGraphLaunch(exec_, stream)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - t0) * 1e3)
    cu.cuGraphExecDestroy(exec_)
    return statistics.median(times), statistics.median(latency)


def replay_host_ms(graph, reps=20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def gpu_ms(graph, reps=5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def capture(fn, keep=True):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fn()
    if keep:
        graph.instantiate()
    return graph, out


def describe(c: dict) -> str:
    types = " ".join(f"{k}={v}" for k, v in sorted(c["types"].items()))
    text = f"nodes {c['nodes']} ({types}), edges {c['edges']}"
    if c["programmatic_edges"]:
        text += f", programmatic edges {c['programmatic_edges']}"
    if c["cluster"]:
        text += f", cluster kernels {sum(c['cluster'].values())}"
    if c["serial"]:
        text += f", programmatic-serialized kernels {sum(c['serial'].values())}"
    return text


def synthetic(lines):
    lines += ["", "== synthetic: graphs of 300 identical ops (bf16), the GPU idle at each launch",
              f"{'op':<28}{'replay host ms':>16}{'gpu ms':>10}  census"]
    weight = torch.randn(1280, 1280, device="cuda", dtype=torch.bfloat16)
    for name, rows in (("mm 256x1280x1280", 256), ("mm 1024x1280x1280", 1024),
                       ("mm 4096x1280x1280", 4096), ("mm 16384x1280x1280", 16384),
                       ("add 4096x1280", 0), ("add 64x1280", -64)):
        n = rows if rows > 0 else (-rows or 4096)
        x = torch.randn(max(n, 4096), 1280, device="cuda", dtype=torch.bfloat16)[:n]

        def body(x=x, rows=rows):
            y = x
            for _ in range(300):
                y = y @ weight if rows > 0 else y + 1
            return y
        graph, _ = capture(body)
        c = census(graph.raw_cuda_graph())
        lines.append(f"{name:<28}{replay_host_ms(graph):16.3f}{gpu_ms(graph):10.3f}  "
                     f"{describe(c)}")
        plain, device = (driver_launch_ms(graph.raw_cuda_graph(), f) for f in (0, 4))
        lines.append(f"    driver launch host ms / launch-to-done ms: instantiated with no flags "
                     f"{plain[0]:.3f} / {plain[1]:.3f}, for device launch {device[0]:.3f} / "
                     f"{device[1]:.3f}")
        for (size, element, kernel), n in memsets(graph.raw_cuda_graph()).items():
            lines.append(f"    memset: {n} x {size} B (element {element} B) before {kernel}")
        for key in ("cluster", "serial"):
            for kernel, n in c[key].items():
                lines.append(f"    {key}: {n} x {kernel}")
        del graph
    torch.cuda.empty_cache()


CONFIGS = {"default": {}, "torch-launch": {"graph_launch": "torch"},
           "varlen": {"attention": "varlen"}, "unfused": {"fuse": False},
           "epilogue-off": {"epilogue_fusion": "off"},
           "plain": {"fuse": False, "align_mlp": False, "attention": "varlen"}}


def calls(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        grid = [[1, rng.randrange(448, 897, 28) // 14, rng.randrange(448, 897, 28) // 14]]
        out.append((torch.randn(grid[0][1] * grid[0][2], 1176, device="cuda",
                                dtype=torch.bfloat16), grid))
    return out


def tower_part(lines, configs, model):
    from vit_graph_backend import serve

    lines += ["", "== tower: Qwen2.5-VL-3B-shaped, every default budget captured; per budget the "
              "runtime graph's replay host ms (GPU idle), its GPU ms, and the census of the same "
              "computation captured again with keep_graph=True (its own replay host ms in [])"]
    for config in configs:
        served = serve(model, capture="all", **CONFIGS[config])
        with torch.inference_mode():
            pv, grid = calls(1)[0]
            served(pv, grid)
            torch.cuda.synchronize()
            lines += ["", f"-- {config} {CONFIGS[config]}",
                      f"{'budget':>8}{'launch':>8}{'replay host ms':>16}{'gpu ms':>9}"
                      f"{'[kept]':>9}  census"]
            entries = served.manager.graphs.entries
            for budget, entry in sorted(entries.items()):
                if entry.graph is None:
                    continue
                host, gpu = replay_host_ms(entry.graph), gpu_ms(entry.graph)
                kept, _ = capture(lambda e=entry, m=served.manager.model:
                                  m.encoder_cudagraph_forward(e.static))
                c = census(kept.raw_cuda_graph())
                kind = getattr(entry.graph, "kind", "torch")
                lines.append(f"{budget:>8}{kind:>8}{host:16.3f}{gpu:9.3f}"
                             f"{replay_host_ms(kept):9.3f}  "
                             f"{describe(c)}")
                if budget in (384, 2048):
                    for (size, element, kernel), n in memsets(kept.raw_cuda_graph()).items():
                        lines.append(f"    memset: {n} x {size} B (element {element} B) before "
                                     f"{kernel}")
                del kept
        del served
        gc.collect()
        torch.cuda.empty_cache()


def parts_part(lines, model):
    """Per-step host time of packed calls: wrap the steps, sum per call, median over calls."""
    import vit_graph_backend.runtime.launch as graph_launch
    import vit_graph_backend.runtime.replay_io as replay_io
    import vit_graph_backend.runtime.manager as runtime
    from vit_graph_backend import serve

    from packed_host_overhead import host_probe, settle

    quiet = host_probe()
    served = serve(model)
    adapter = served.manager.model
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    stream = calls(40)
    with torch.inference_mode():
        for pv, grid in stream:
            served(pv, grid)
        # a step the tree under test lacks is left out (runtime.copy_padded of older trees)
        patches = [(adapter, "get_encoder_cudagraph_item_specs"), (adapter.packer, "check"),
                   (adapter, "prepare_encoder_cudagraph_replay_buffers"), (adapter.packer, "batch"),
                   (adapter.kernels, "sync"), (runtime, "write_inputs"), (runtime, "copy_padded"),
                   (replay_io, "copy_padded"), (runtime, "split_rows"), (runtime, "assemble"),
                   (graph_launch.DeviceLaunchGraph, "replay"), (served.manager.served, "plan"),
                   (served.manager.order, "enter"), (served.manager.order, "exit"),
                   (served.manager.stats, "record_replay")]
        saved = [(obj, name, getattr(obj, name)) for obj, name in patches if hasattr(obj, name)]
        for obj, name, fn in saved:
            setattr(obj, name, timed(name, fn))
        replay = torch.cuda.CUDAGraph.replay
        torch.cuda.CUDAGraph.replay = timed("CUDAGraph.replay", replay)
        # one grid with new pixels each call: its metadata stays in the static buffers
        same = [(torch.randn_like(stream[0][0]), stream[0][1]) for _ in range(40)]
        per_call: dict[str, dict[str, list[float]]] = {}
        waited, busy = settle(quiet)
        try:
            for label, calls_ in (("40 grids in turn", stream), ("one grid", same)):
                per_call[label] = collections.defaultdict(list)
                for _ in range(3):
                    for pv, grid in calls_:
                        spent.clear()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        served(pv, grid)
                        spent["whole call"] = time.perf_counter() - t0
                        torch.cuda.synchronize()
                        for key, value in spent.items():
                            per_call[label][key].append(value * 1e3)
        finally:
            torch.cuda.CUDAGraph.replay = replay
            for obj, name, fn in saved:
                setattr(obj, name, fn)
    for label, steps in per_call.items():
        lines += ["", f"== parts, {label}: one image of 448..896 px per call, list grid, 120 "
                  "calls, the GPU idle at each start; host ms per call (steps nest: check is in "
                  "the specs and the buffers, sync in the buffers, copy_padded in write_inputs); "
                  f"host probe {quiet:.0f} us before serving, {busy:.0f} after the first pass, "
                  f"settled after {waited} s",
                  f"{'step':<44}{'p50 ms':>8}{'mean ms':>9}"]
        for key, values in sorted(steps.items(), key=lambda kv: -statistics.mean(kv[1])):
            lines.append(f"{key:<44}{statistics.median(values):8.3f}"
                         f"{statistics.mean(values):9.3f}")
    del served
    gc.collect()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="synthetic,tower,parts")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--matmul", choices=("default", "cublaslt", "no-reduced-precision"),
                        default="default", help="a process-wide matmul setting to try")
    args = parser.parse_args()
    if args.matmul == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    elif args.matmul == "no-reduced-precision":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    version = ctypes.c_int()
    _driver().cuDriverGetVersion(ctypes.byref(version))
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA driver "
             f"API {version.value}, matmul setting {args.matmul}, CUBLAS_WORKSPACE_CONFIG="
             f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG', '-')}, CUBLASLT_WORKSPACE_SIZE="
             f"{os.environ.get('CUBLASLT_WORKSPACE_SIZE', '-')}"]
    parts = args.parts.split(",")
    try:
        if "synthetic" in parts:
            synthetic(lines)
        if "tower" in parts or "parts" in parts:
            from qwen_stream import tower
            model = tower()
            if "tower" in parts:
                tower_part(lines, args.configs.split(","), model)
            if "parts" in parts:
                parts_part(lines, model)
    finally:
        text = "\n".join(lines)
        print(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "graph_launch_probe.txt").write_text(text)


if __name__ == "__main__":
    main()
