"""The stress suite's ``ordering`` part: the host cost per call of
:class:`~vit_graph_backend.runtime.stream_order.StreamOrder`, beside the same calls without it."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["part_ordering"]


def part_ordering(cfg: Any, result: Any) -> Any:
    """Fill ``result.details`` with the ordering's host cost per call: the enter/exit pair on one
    stream and on two alternating streams (less the switching), and a launch-bound compiled ViT
    at batch 1 with and without it, interleaved in one run.

    Args:
        cfg: the stress config (its ``device``).
        result: the part's ``PartResult``.
    """
    import torch

    from vit_graph_backend.compile.backend import vitgraph
    from vit_graph_backend.runtime.stream_order import StreamOrder
    from vit_graph_backend.bench.models import MODELS, build_model

    order = StreamOrder(torch.device(cfg.device))
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        order.exit(order.enter())
    result.details["order_us_one_stream"] = round((time.perf_counter() - start) / n * 1e6, 2)
    streams = (torch.cuda.current_stream(), torch.cuda.Stream())
    spent = {}
    for label in ("switch_only", "switch_and_order"):
        start = time.perf_counter()
        for k in range(n):
            with torch.cuda.stream(streams[k % 2]):
                if label == "switch_and_order":
                    order.exit(order.enter())
        spent[label] = (time.perf_counter() - start) / n * 1e6
    result.details["order_us_two_streams"] = round(spent["switch_and_order"]
                                                   - spent["switch_only"], 2)
    built = build_model(MODELS["vit-micro"], device=cfg.device, dtype=torch.float16,
                        dynamic_size=False)
    compiled = torch.compile(built.module, backend=vitgraph)
    x = torch.randn(1, 3, 64, 64, device=cfg.device, dtype=torch.float16)
    times: dict[str, list[float]] = {"ordered": [], "unordered": []}
    with torch.inference_mode():
        for _ in range(3):
            compiled(x)
        managers = [m for e in vitgraph.encoders for m in e.managers]
        real = [m.order for m in managers]
        for _ in range(10):
            for label in ("ordered", "unordered"):
                for m, o in zip(managers, real):
                    m.order = o if label == "ordered" else _NoOrder()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    compiled(x)
                torch.cuda.synchronize()
                times[label].append((time.perf_counter() - t0) / 200 * 1e6)
        for m, o in zip(managers, real):
            m.order = o
    for label, values in times.items():
        result.details[f"vit_micro_b1_us_per_call_{label}"] = round(min(values), 1)
    torch.compiler.reset()
    return result


class _NoOrder:
    def enter(self) -> None:
        return None

    def exit(self, stream: Any) -> None:
        return None

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
