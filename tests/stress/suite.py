"""The stress suite (`PYTHONPATH=tests python -m stress`): many threads, many streams, poisoned memory, little
memory, every output checked against eager.

Parts, each a row of the closing table: ``batched`` (``torch.compile(vit, backend=vitgraph)``,
batch sizes past the largest budget), ``packed`` (``serve()`` on a Qwen2.5-VL-shaped tower:
images of many sizes, videos, items past the largest budget), ``clear`` (graphs dropped and
captured again into the same pool between calls), ``switch`` (``capture="background"``: every
thread calls from the first request on while graphs are prepared, the switch to them happens
mid-stream, and graphs dropped between calls are prepared again), and on CUDA ``memory``
(capture beside a filler tensor taking most free memory) and ``ordering`` (the stream
ordering's host cost, :mod:`.ordering_cost`).

``threads`` workers, odd ones on their own stream; every ``poison_every`` calls a worker writes NaN
over static buffers and free pool memory (``vit_graph_backend.testing.poison``). An output is wrong if it has NaN or
differs from eager by more than ``tolerance`` of eager's largest magnitude.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StressConfig", "format_stress", "run_stress"]


@dataclass(frozen=True)
class StressConfig:
    """Settings of one stress run (CUDA sizes; ``small()`` for a CPU run in seconds)."""

    calls: int = 5000               # checked calls per path
    threads: int = 4
    poison_every: int = 7
    seed: int = 0
    tolerance: float = 5e-2
    device: str = "cuda"
    parts: tuple[str, ...] = ("batched", "packed", "clear", "switch", "memory", "ordering")

    @staticmethod
    def small(calls: int = 120) -> StressConfig:
        """A CPU run: tiny models, no streams, no memory part."""
        return StressConfig(calls=calls, device="cpu", parts=("batched", "packed", "clear",
                                                              "switch"))


@dataclass
class PartResult:
    """Counts of one part."""

    part: str
    calls: int = 0
    wrong: int = 0
    nan: int = 0
    exceptions: list[str] = field(default_factory=list)
    worst_error: float = 0.0
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"part": self.part, "calls": self.calls, "wrong": self.wrong, "nan": self.nan,
                "exceptions": len(self.exceptions), "first_exceptions": self.exceptions[:5],
                "worst_error": self.worst_error, "seconds": round(self.seconds, 3),
                **self.details}


def _error(out: Any, ref: Any) -> float:
    import torch

    out = out if isinstance(out, torch.Tensor) else out[0]
    ref = ref if isinstance(ref, torch.Tensor) else ref[0]
    if out.shape != ref.shape:
        return float("inf")
    diff = (out.float() - ref.float()).abs().max()
    scale = max(float(ref.float().abs().max()), 1.0)
    return float(diff) / scale


def _hammer(result: PartResult, cfg: StressConfig, call: Callable[[int], Any], refs: list[Any],
            poison: Callable[[], None] | None, between: Callable[[int], None] | None = None
            ) -> None:
    """Run ``cfg.calls`` checked calls of ``call(input_index)`` from ``cfg.threads`` threads."""
    import torch

    cuda = cfg.device.startswith("cuda")
    lock = threading.Lock()
    counter = iter(range(cfg.calls))

    def worker(w: int) -> None:
        rng = random.Random(cfg.seed * 1000 + w)
        stream = torch.cuda.Stream() if cuda and w % 2 else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                if between is not None:
                    between(k)
                if poison is not None and k % cfg.poison_every == 0:
                    poison()
                i = rng.randrange(len(refs))
                try:
                    out = call(i)
                    err = _error(out, refs[i])
                except Exception as exc:  # counted, never raised: the suite reports them
                    with lock:
                        result.calls += 1
                        result.exceptions.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with lock:
                    result.calls += 1
                    if err != err:
                        result.nan += 1
                    elif err > cfg.tolerance:
                        result.wrong += 1
                    if err == err:
                        result.worst_error = max(result.worst_error, err)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(cfg.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.perf_counter() - start


def _batched(cfg: StressConfig) -> tuple[Any, list[tuple[Any]], Any]:
    import torch

    from vit_graph_backend.bench.models import MODELS, build_model

    cuda = cfg.device.startswith("cuda")
    built = build_model(MODELS["vit-s16" if cuda else "vit-micro"], device=cfg.device,
                        dtype=torch.bfloat16 if cuda else torch.float32, dynamic_size=False)
    size = 224 if cuda else 64
    sizes = [1, 2, 3, 5, 7, 8, 12, 16, 23, 32, 37, 48] if cuda else [1, 2, 3, 5, 9, 12]
    g = torch.Generator().manual_seed(cfg.seed)
    inputs = [(torch.randn(b, 3, size, size, generator=g).to(cfg.device, built.dtype),)
              for b in sizes for _ in range(2)]
    return built.module, inputs, {} if cuda else {"max_budget": 8}


def _qwen_tower(cfg: StressConfig, depth: int | None = None) -> Any:
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel as Tower)

    torch.manual_seed(cfg.seed)
    if cfg.device.startswith("cuda"):  # the 3B tower's block shape
        depth = depth or 4
        config = Qwen2_5_VLVisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420,
                                        num_heads=16, out_hidden_size=2048,
                                        fullatt_block_indexes=list(range(1, depth, 2)))
        return Tower._from_config(config).to(cfg.device, torch.bfloat16).eval()
    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=122, num_heads=2,
                                    out_hidden_size=96, window_size=112, fullatt_block_indexes=[1])
    return Tower._from_config(config).eval()


def _packed_inputs(cfg: StressConfig, tower: Any, count: int) -> list[tuple[Any, Any]]:
    import torch

    rng = random.Random(cfg.seed)
    cuda = cfg.device.startswith("cuda")
    dtype = next(tower.parameters()).dtype
    dim = 3 * 2 * 14 * 14
    calls = []
    for k in range(count):
        grids = []
        for _ in range(rng.randint(1, 4)):
            if cuda:
                h, w = 2 * rng.randint(8, 32), 2 * rng.randint(8, 32)   # 224..896 px
            else:
                h, w = 2 * rng.randint(2, 8), 2 * rng.randint(2, 8)
            grids.append([rng.choice((2, 3)) if k % 5 == 4 else 1, h, w])   # every 5th: video
        rows = sum(t * h * w for t, h, w in grids)
        g = torch.Generator().manual_seed(cfg.seed + k)
        calls.append((torch.randn(rows, dim, generator=g).to(cfg.device, dtype),
                      torch.tensor(grids, dtype=torch.int64, device=cfg.device)))
    return calls


def _packed_options(cfg: StressConfig) -> dict[str, Any]:
    if cfg.device.startswith("cuda"):
        return {"max_items_per_graph": 4, "max_budget": 1024, "max_frames_per_batch": 8}
    return {"max_items_per_graph": 4, "max_budget": 96, "max_frames_per_batch": 8}


def _references(fn: Callable[..., Any], inputs: list[tuple[Any, ...]]) -> list[Any]:
    import torch

    from vit_graph_backend.bench.models import primary_output

    with torch.inference_mode():
        return [primary_output(fn(*x)).clone() for x in inputs]


def _poisoner(managers: Callable[[], list[Any]], cuda: bool) -> Callable[[], None]:
    from vit_graph_backend.testing.poison import PoolPoisoner, poison_static_buffers

    pool_poisoners: dict[int, Any] = {}

    def poison() -> None:
        for manager in managers():
            poison_static_buffers(manager)
            if cuda and manager.graph_pool is not None:
                # per pool: a background preparation's set comes with a pool of its own
                key = (id(manager), manager.graph_pool)
                if key not in pool_poisoners:
                    pool_poisoners[key] = PoolPoisoner(manager)
                pool_poisoners[key]()
    return poison


def _part_batched(cfg: StressConfig) -> PartResult:
    import torch

    from vit_graph_backend.compile.backend import vitgraph

    module, inputs, options = _batched(cfg)
    refs = _references(module, inputs)
    compiled = torch.compile(module, backend=vitgraph, options=options or None)
    with torch.inference_mode():
        for x in inputs:   # compiles and captures up front, on one thread
            compiled(*x)
    managers = lambda: [m for e in vitgraph.encoders for m in e.managers]  # noqa: E731
    result = PartResult("batched")
    _hammer(result, cfg, lambda i: compiled(*inputs[i]), refs,
            _poisoner(managers, cfg.device.startswith("cuda")))
    report = vitgraph.report()
    stats = report["stats"]
    result.details = {"compiles": report["compiles"], "graphs": report["graphs_captured"],
                      "replays": stats["graph_replays"] + stats["no_graph_batches"],
                      "eager_batches": stats["eager_batches"]}
    return result


def _served(cfg: StressConfig, tower: Any, **extra: Any) -> Any:
    from vit_graph_backend.adapters.serve import serve

    return serve(tower, **{**_packed_options(cfg), **extra})


def _part_packed(cfg: StressConfig, tower: Any, inputs: list[Any], refs: list[Any],
                 name: str = "packed", clear_every: int | None = None, **extra: Any
                 ) -> PartResult:
    import torch

    from vit_graph_backend.runtime.manager import PREPARING

    served = _served(cfg, tower, **extra)
    result = PartResult(name)
    background = extra.get("capture") == "background"
    try:
        if not background:   # background: the threads' first calls start the preparation
            with torch.inference_mode():
                served(*inputs[0])
    except Exception as exc:  # counted: the table must still print
        result.exceptions.append(f"first call: {type(exc).__name__}: {exc}"[:300])
        return result
    manager = served.manager
    pool = manager.graph_pool
    between = None
    if clear_every:
        def between(k: int) -> None:
            if k and k % clear_every == 0:
                if background:   # switched yet? then drop the graphs: the next call prepares
                    switched = not manager.memory_report()["preparing"] and manager.num_graphs
                    result.details["switches"] = result.details.get("switches", 0) + bool(
                        switched)
                manager.clear()
                if pool is not None:
                    manager.capture(pool)   # the same pool handle, reused
                result.details["recaptures"] = result.details.get("recaptures", 0) + 1
    _hammer(result, cfg, lambda i: served(*inputs[i]), refs,
            _poisoner(lambda: [manager], cfg.device.startswith("cuda")), between)
    if background and cfg.device.startswith("cuda"):   # the switch must have happened
        served.wait_prepared()
        with torch.inference_mode():
            served(*inputs[0])
        if not manager.stats.graph_replays:
            result.exceptions.append("no call was served from graphs after the preparation")
    stats = manager.stats.as_dict()
    memory = manager.memory_report()
    result.details.update({
        "graphs": memory["graphs"], "replays": stats["graph_replays"] + stats["no_graph_batches"],
        "eager_batches": stats["eager_batches"], "fallback_reasons": stats["fallback_reasons"],
        "while_preparing": stats["fallback_reasons"].get(PREPARING, 0),
        "captured_budgets": memory["captured_budgets"],
        "skipped_budgets": {b: why[:60] for b, why in memory["skipped_budgets"].items()},
        "graph_bytes": memory["total_bytes"]})
    return result


def _part_memory(cfg: StressConfig, tower: Any, inputs: list[Any], refs: list[Any]) -> PartResult:
    """Packed calls with 1.5 GiB left free, budgets up to 8192 tokens, graphs within 60 % of it."""
    import torch

    import gc

    gc.collect()   # the earlier parts' graphs and pools
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - (1536 << 20)), dtype=torch.uint8, device=cfg.device)
    free_left, _ = torch.cuda.mem_get_info()
    try:
        result = _part_packed(cfg, tower, inputs, refs, name="memory", max_budget=8192,
                              max_graph_memory=0.6)
    finally:
        del filler
        torch.cuda.empty_cache()
    result.details["free_bytes_at_capture"] = free_left
    return result


def run_stress(cfg: StressConfig) -> list[dict[str, Any]]:
    """Run the parts of ``cfg``; one dict per part (see :func:`format_stress`)."""
    import torch

    results = []
    if "batched" in cfg.parts:
        results.append(_part_batched(cfg))
        torch.compiler.reset()
    tower = _qwen_tower(cfg)
    inputs = _packed_inputs(cfg, tower, 48)
    refs = _references(tower, inputs)
    if "packed" in cfg.parts:
        results.append(_part_packed(cfg, tower, inputs, refs))
    if "clear" in cfg.parts:
        results.append(_part_packed(cfg, tower, inputs, refs, name="clear",
                                    clear_every=max(10, cfg.calls // 8)))
    if "switch" in cfg.parts:
        results.append(_part_packed(cfg, tower, inputs, refs, name="switch",
                                    clear_every=max(10, cfg.calls // 4), capture="background"))
    if cfg.device.startswith("cuda") and "memory" in cfg.parts:
        results.append(_part_memory(cfg, tower, inputs, refs))
    if cfg.device.startswith("cuda") and "ordering" in cfg.parts:
        from .ordering_cost import part_ordering

        results.append(part_ordering(cfg, PartResult("ordering")))
    return [r.as_dict() for r in results]


def format_stress(rows: list[dict[str, Any]]) -> str:
    """The closing table: one line per part."""
    lines = [f"{'part':<9} {'calls':>6} {'wrong':>6} {'nan':>4} {'exc':>4} {'worst err':>9} "
             f"{'s':>7}  details"]
    for r in rows:
        details = {k: v for k, v in r.items() if k not in (
            "part", "calls", "wrong", "nan", "exceptions", "first_exceptions", "worst_error",
            "seconds", "estimated_bytes", "fallback_reasons")}
        lines.append(f"{r['part']:<9} {r['calls']:>6} {r['wrong']:>6} {r['nan']:>4} "
                     f"{r['exceptions']:>4} {r['worst_error']:>9.2e} {r['seconds']:>7.2f}  "
                     f"{details}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``PYTHONPATH=tests python -m stress``: run, print the table, write JSON."""
    import argparse
    import json
    import logging

    import torch

    from vit_graph_backend.bench.environment import collect_environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=None,
                        help="checked calls per part (default: 5000 on CUDA, 120 on CPU)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the rows and versions here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.device.startswith("cuda"):
        cfg = StressConfig(calls=args.calls or 5000, threads=args.threads, device=args.device)
    else:
        cfg = StressConfig.small(args.calls or 120)
    rows = run_stress(cfg)
    print(format_stress(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": collect_environment(args.device), "config": cfg.__dict__,
                       "rows": rows}, f, indent=1, default=str)
    bad = sum(r["wrong"] + r["nan"] + r["exceptions"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
