"""``attention_kernel="timed"`` against ``"sdpa"`` (the default) on CLIP ViT-L/14-336, calls
interleaved in one process: two copies of the model compiled with ``backend="vitgraph"``
(budgets of the batches timed), each batch's calls alternating between them (the order flipped
every round), each call timed alone (a device sync before and after). Separate ``vitgraph
bench`` processes or modes run one after the other saw their differences move with the order
they ran in; this does not.

Prints, per batch, the median and mean ms of each and the ratio, and what the per-shape timing
chose (``attention_op.CHOICES``).

Usage: python benchmarks/attention_kernel_interleaved.py [--batches 8,24,48] [--rounds 30].
Text to stdout and to $OUT/attention_kernel_interleaved.txt when $OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _bench_out import emit

from vit_graph_backend.attention_op import CHOICES
from vit_graph_backend.compile.backend import vitgraph
from vit_graph_backend.bench.models import MODELS, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8,24,48")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model(MODELS["clip-l14-336"], device="cuda", dtype=torch.bfloat16,
                        dynamic_size=False).module
    modes = {name: torch.compile(copy.deepcopy(model) if name == "sdpa" else model,
                                 backend=vitgraph,
                                 options={"budgets": batches, "attention_kernel": name})
             for name in ("timed", "sdpa")}
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; CLIP "
             "ViT-L/14-336 (HF CLIPVisionModel, random weights), bf16; ms per call, each timed "
             f"alone, {args.rounds} rounds alternating the modes",
             f"{'batch':>6}{'timed p50':>10}{'sdpa p50':>10}{'timed mean':>11}{'sdpa mean':>11}"
             f"{'timed/sdpa p50':>15}"]
    print("\n".join(lines), flush=True)
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
            for fn in modes.values():
                for _ in range(3):
                    fn(x)
            times: dict[str, list[float]] = {name: [] for name in modes}
            for rnd in range(args.rounds):
                order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
                for name in order:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    modes[name](x)
                    torch.cuda.synchronize()
                    times[name].append((time.perf_counter() - start) * 1e3)
            p50 = {n: statistics.median(t) for n, t in times.items()}
            mean = {n: statistics.fmean(t) for n, t in times.items()}
            lines.append(f"{batch:>6}{p50['timed']:>10.2f}{p50['sdpa']:>10.2f}"
                         f"{mean['timed']:>11.2f}{mean['sdpa']:>11.2f}"
                         f"{p50['timed'] / p50['sdpa']:>15.3f}")
            print(lines[-1], flush=True)
    lines.append(f"chosen: {CHOICES.state['chosen']}")
    lines.append(f"refused: {CHOICES.state['refused']}")
    emit(lines, "attention_kernel_interleaved", echo=False)
    print("\n".join(lines[-2:]))


if __name__ == "__main__":
    main()
