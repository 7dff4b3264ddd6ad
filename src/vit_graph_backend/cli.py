"""The ``vitgraph`` command (also ``python -m vit_graph_backend``).

Subcommands: ``bench`` (a seeded stream through several modes side by side: table, ``--json``,
``--plot``), ``plan`` (the budget ladder and the plan of one call's items; never imports torch)
and ``info`` (versions, CUDA, whether the ``vitgraph`` backend is registered and importable).

Bad arguments exit with status 2 and an argparse message naming the bad value. Everything heavy
(torch, the harness, matplotlib) is imported inside the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .bench.modes import MODES as _MODES
from .budgets import DEFAULT_PACKED_MAX_BUDGET, MAX_LADDER_STEPS, packed_budget_range
from .options import DEFAULT_BATCHED_MAX_BUDGET
from .planner import POLICIES

__all__ = ["build_parser", "main"]

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


# argument types: each raises ArgumentTypeError naming the bad value (argparse exits 2)
def _int_from(low: int) -> Any:
    word = "positive integer" if low == 1 else "integer"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {word}: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"invalid {word}: {text!r} (must be >= {low})")
        return value
    return parse


_positive_int, _non_negative_int = _int_from(1), _int_from(0)


def _ladder_steps(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_LADDER_STEPS:
        raise argparse.ArgumentTypeError(
            f"invalid ladder steps: {text!r} (must be 1..{MAX_LADDER_STEPS})")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"invalid list: {text!r} (give comma-separated integers)")
    return tuple(_positive_int(p) for p in parts)


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(p.strip() for p in text.split(",") if p.strip())
    for mode in modes:
        if mode not in _MODES:
            raise argparse.ArgumentTypeError(
                f"invalid mode: {mode!r} (choose from {', '.join(_MODES)})")
    if not modes:
        raise argparse.ArgumentTypeError(f"invalid mode list: {text!r}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"invalid mode list: {text!r} (a mode is repeated)")
    return modes


def _size_list(text: str) -> tuple[tuple[int, int], ...]:
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)[xX](\d+)", part)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise argparse.ArgumentTypeError(f"invalid size: {part!r} (expected HxW, e.g. 448x448)")
        sizes.append((int(match[1]), int(match[2])))
    if not sizes:
        raise argparse.ArgumentTypeError(f"invalid size list: {text!r}")
    return tuple(sizes)


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"invalid device: {text!r} (cpu, cuda or cuda:N)")
    return text


def _add_bench(sub: Any) -> argparse.ArgumentParser:
    from .bench.models import MODELS
    from .bench.runner import DTYPES
    from .bench.workloads import MODALITIES, WORKLOADS

    p = sub.add_parser(
        "bench", help="compare eager, torch.compile and vitgraph on a seeded stream",
        description="Run one model on one seeded stream through several modes side by side and "
        "print p50/p99/mean latency, stream total, first pass, peak memory, graphs, hit rate, "
        "padding, max error vs eager and speed-up. Defaults: on CPU vit-micro, 24 calls, modes "
        "eager,vitgraph, float32; on CUDA vit-b16, 120 calls, all modes, bfloat16.")
    p.add_argument("--model", choices=list(MODELS), metavar="NAME",
                   help="registry model (see --list); default vit-micro on CPU, vit-b16 on CUDA")
    p.add_argument("--workload", choices=list(WORKLOADS), default="uniform-batch",
                   metavar="NAME", help="seeded stream (default uniform-batch; see --list)")
    p.add_argument("--modality", choices=MODALITIES,
                   help="image, video or image+video (default image; video for --workload video)")
    p.add_argument("--modes", type=_mode_list, metavar="LIST",
                   help=f"comma-separated, from {','.join(_MODES)} (default eager,vitgraph on "
                   "CPU, all on CUDA)")
    p.add_argument("--enable-vit-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="single-mode run: vitgraph on (--enable-...) or off, i.e. eager "
                   "(--no-enable-...); not with --modes")
    p.add_argument("--calls", type=_positive_int, help="calls in the stream (default 24 on CPU, "
                   "120 on CUDA, 60 for packed models on CUDA)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="stream and weights seed")
    p.add_argument("--max-batch", type=_positive_int,
                   help="most images per call (default 8 on CPU, 32 on CUDA, 4 for packed models)")
    p.add_argument("--budgets", type=_int_list, metavar="LIST",
                   help="budgets: rows for batched models, output tokens for packed ones "
                   "(default: a ladder covering the stream)")
    p.add_argument("--max-budget", type=_positive_int,
                   help="largest ladder budget when --budgets is not given")
    p.add_argument("--ladder-steps", type=_ladder_steps, metavar="K",
                   help="ladder without --budgets: split each doubling into K steps, 1..16 "
                   "(default 4 rows for batched models, 2 for packed: the runtime's defaults)")
    p.add_argument("--max-items-per-graph", type=_positive_int,
                   help="packed models: items per graph (default 1 for image or video, 2 for "
                   "image+video, as vLLM's examples)")
    p.add_argument("--max-frames-per-batch", type=_positive_int,
                   help="packed models: frame cap per graph (default none)")
    p.add_argument("--policy", choices=POLICIES, default="baseline",
                   help="planner policy (default baseline)")
    p.add_argument("--check-calls", type=_non_negative_int, default=3,
                   help="calls compared with eager for the max error (default 3)")
    p.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default cuda if present)")
    p.add_argument("--dtype", choices=DTYPES, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--json", metavar="PATH",
                   help="write the result document (versioned JSON schema)")
    p.add_argument("--plot", metavar="PATH", help="write the latency distribution as a PNG")
    p.add_argument("--data-parallel", action="store_true", help="under torchrun: each vitgraph "
                   "mode also runs data-parallel over the ranks, as <mode>+dp (rank 0 reports)")
    caches = p.add_mutually_exclusive_group()
    caches.add_argument("--cold", action="store_true", help="start Inductor's and Triton's "
                        "caches empty, in a folder removed at exit (Python's bytecode and CUDA's "
                        "caches stay warm); without it they are read as earlier runs left them")
    caches.add_argument("--cache-dir", metavar="PATH", help="read and keep compiled kernels in "
                        "PATH (use_cache_dir), so the next run with it starts warm")
    p.add_argument("--layer-regions", action="store_true", help="mark the model's repeated "
                   "layers as nested compile regions (mark_layer_regions): each compiled mode "
                   "traces and compiles one layer for all")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--strict", action="store_true", help="exit 1 if any mode failed")
    p.add_argument("--list", action="store_true", help="list models, workloads and modes")
    p.set_defaults(subparser=p)
    return p


def _add_plan(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="print the budget ladder and the plan of one call (no torch)",
        description="Plan one call's items into budgeted batches exactly as the vitgraph runtime "
        "does, and print the ladder, the batches, eager items and padding waste. Budgets and "
        "items count output tokens (after merge). Pure Python: no torch, instant.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--items", type=_int_list, metavar="LIST",
                      help="output tokens of each item, e.g. 256,1024,64")
    what.add_argument("--sizes", type=_size_list, metavar="LIST",
                      help="image sizes in pixels, e.g. 448x448,224x336 (with --patch, --merge)")
    p.add_argument("--budgets", type=_int_list, metavar="LIST", help="explicit budgets")
    p.add_argument("--min-budget", type=_positive_int,
                   help="ladder start without --budgets (default: the tokens of a 224 px square "
                   "image at --patch and --merge, as the packed adapters; 1 with --chunk; or "
                   "--max-budget when that is smaller)")
    p.add_argument("--max-budget", type=_positive_int,
                   help=f"ladder end without --budgets (default {DEFAULT_PACKED_MAX_BUDGET} at "
                   f"--merge 2, {DEFAULT_PACKED_MAX_BUDGET * 4} at --merge 1, "
                   f"{DEFAULT_BATCHED_MAX_BUDGET} with --chunk, or --min-budget when larger)")
    p.add_argument("--ladder-steps", type=_ladder_steps, metavar="K",
                   help="split each doubling of the ladder into K steps, 1..16 (default 2, the "
                   "packed runtime's; 4 with --chunk, the batched runtime's)")
    p.add_argument("--max-items-per-graph", type=_positive_int,
                   help="items per graph (default: derived, never above the smallest budget; "
                   "packed only)")
    p.add_argument("--patch", type=_positive_int, default=14, help="patch side (default 14)")
    p.add_argument("--merge", type=_positive_int, default=2, help="spatial merge (default 2)")
    p.add_argument("--policy", choices=POLICIES, default="baseline")
    p.add_argument("--chunk", action="store_true",
                   help="batched layout, as torch.compile graphs: each item is a call of rows, "
                   "one per graph, cut into chunks above the largest budget")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(subparser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``vitgraph`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="vitgraph", description="CUDA-graph serving of vision encoders through "
        "torch.compile(backend=\"vitgraph\"): benchmark, plan, inspect.")
    parser.add_argument("--version", action="version", version=f"vitgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,plan,info}")
    _add_bench(sub)
    _add_plan(sub)
    info = sub.add_parser("info", help="versions, CUDA, backend registration, extras",
                          description="Versions, CUDA devices, whether the vitgraph backend is "
                          "registered (torch.compiler.list_backends) and importable, extras.")
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(subparser=info)
    return parser


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .errors import InvalidOptionError
    from .options import VitGraphOptions
    from .plan_preview import format_plan, plan_to_dict
    from .planner import plan_batches
    from .specs import EncoderItemSpec

    if args.items is not None:
        specs = [EncoderItemSpec(t if args.chunk else t * args.merge**2, t) for t in args.items]
        labels = [f"{t} tokens" for t in args.items]
    else:
        if args.chunk:
            parser.error("argument --chunk: applies to --items (row items), not to --sizes")
        unit = args.patch * args.merge
        specs, labels = [], []
        for h, w in args.sizes:
            if h % unit or w % unit:
                parser.error(f"argument --sizes: {h}x{w} is not a multiple of patch*merge="
                             f"{args.patch}*{args.merge}={unit} in both sides")
            gh, gw = h // args.patch, w // args.patch
            specs.append(EncoderItemSpec(gh * gw, (gh // args.merge) * (gw // args.merge)))
            labels.append(f"{h}x{w} px -> {gh * gw} patches -> {specs[-1].output_tokens} tokens")
    try:
        # the runtime's own resolution, so plan and runtime cannot disagree
        options = VitGraphOptions(budgets=args.budgets, min_budget=args.min_budget,
                                  max_budget=args.max_budget, ladder_steps=args.ladder_steps,
                                  max_items_per_graph=args.max_items_per_graph)
        config = (options.resolve(batched=True) if args.chunk
                  else options.resolve(packed_budget_range(args.patch, args.merge)))
        plan = plan_batches(specs, config, policy=args.policy, chunk=args.chunk)
    except InvalidOptionError as exc:
        parser.error(f"invalid --budgets/--min-budget/--max-budget/--max-items-per-graph: {exc}")
    doc = plan_to_dict(plan, specs)
    if args.json:
        print(json.dumps({"budgets": list(config.budgets),
                          "max_items_per_graph": config.max_batch_size, "policy": args.policy,
                          **doc}, indent=2))
        return 0
    graphs = len(config.budgets)
    print(f"budget ladder (tokens): {' '.join(map(str, config.budgets))} "
          f"({graphs} graph{'s' if graphs > 1 else ''})")
    print(f"items per graph: {config.max_batch_size} | policy {args.policy}"
          + (" | chunked" if args.chunk else ""))
    print(f"items ({len(specs)}):")
    for i, label in enumerate(labels):
        print(f"  #{i}  {label}")
    print("plan:")
    print("\n".join(format_plan(doc, indent="  ")))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .bench.environment import backend_status, collect_environment

    env = collect_environment()
    backend = backend_status()
    if args.json:
        print(json.dumps({"environment": env, "backend": backend}, indent=2))
        return 0
    import torch

    print(f"vit_graph_backend {env['vit_graph_backend']} | python {env['python']} | "
          f"{env['platform']}")
    print(f"torch {env['torch']} (built for CUDA {env['cuda_version'] or 'none'})")
    if env["cuda_available"]:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"CUDA: available, {len(names)} device(s): {', '.join(names)}")
    else:
        print(f"CUDA: not available (CPU: {env['device_name']}, {env['cpu_count']} cores); "
              "CUDA graphs need a CUDA device, vitgraph runs its routing without graphs here")
    listed = "yes" if backend["listed"] else "no"
    print(f"backend 'vitgraph': in torch.compiler.list_backends(): {listed}; entry point: "
          f"{backend['entry_point'] or 'not installed'}; importable: "
          + ("yes" if backend["importable"] else f"no ({backend['error']})"))
    extras = ", ".join(f"{k} {v}" if v else f"{k} missing" for k, v in env["packages"].items())
    print(f"optional: {extras}")
    return 0


def _list_bench() -> int:
    from .bench.models import MODELS, availability
    from .bench.workloads import WORKLOADS

    print("models:")
    for entry in MODELS.values():
        status = availability(entry) or "available"
        print(f"  {entry.name:<16} {entry.layout:<8} {entry.description} [{status}]")
    print("workloads:\n" + "\n".join(f"  {w.name:<16} {w.description}" for w in WORKLOADS.values()))
    print(f"modes: {', '.join(_MODES)}")
    return 0


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.list:
        return _list_bench()
    if args.enable_vit_cuda_graph is not None and args.modes is not None:
        parser.error("argument --enable-vit-cuda-graph: not allowed with --modes (it picks the "
                     "single mode: vitgraph, or eager with --no-enable-vit-cuda-graph)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"argument --plot: {args.plot!r} needs matplotlib "
                     "(pip install 'vit-graph-backend[bench]')")
    modes = args.modes
    if args.enable_vit_cuda_graph is not None:
        modes = ("vitgraph",) if args.enable_vit_cuda_graph else ("eager",)

    import torch

    from .bench import format_text, write_json, write_plot
    from .bench.distributed import is_rank_zero
    from .bench.models import MODELS, availability
    from .bench.runner import BenchConfig, resolve, run_benchmark
    from .errors import InvalidOptionError

    config = BenchConfig(
        model=args.model, workload=args.workload, modality=args.modality, modes=modes,
        calls=args.calls, seed=args.seed, max_batch=args.max_batch, budgets=args.budgets,
        max_budget=args.max_budget, ladder_steps=args.ladder_steps,
        max_items_per_graph=args.max_items_per_graph,
        max_frames_per_batch=args.max_frames_per_batch, policy=args.policy, device=args.device,
        dtype=args.dtype, check_calls=args.check_calls, data_parallel=args.data_parallel,
        cold=args.cold, cache_dir=args.cache_dir, layer_regions=args.layer_regions,
        progress=not args.no_progress and sys.stderr.isatty())
    try:
        run = resolve(config, cuda_available=torch.cuda.is_available())
    except (ValueError, InvalidOptionError) as exc:
        parser.error(str(exc))
    reason = availability(MODELS[run.config.model])
    if reason is not None:
        parser.error(f"argument --model: {run.config.model!r} is unavailable here: {reason}")
    doc = run_benchmark(config)
    if not is_rank_zero():  # --data-parallel: every rank ran the stream, rank 0 reports
        return 0
    print(format_text(doc))
    if args.json:
        print(f"wrote {write_json(doc, args.json)}")
    if args.plot:
        print(f"wrote {write_plot(doc, args.plot)}")
    failed = [m["mode"] for m in doc["modes"] if m["status"] != "ok"]
    return 1 if args.strict and failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vitgraph`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Raises:
        SystemExit: (status 2, from argparse) on a bad argument.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _cmd_bench(args, args.subparser)
    if args.command == "plan":
        return _cmd_plan(args, args.subparser)
    return _cmd_info(args)
