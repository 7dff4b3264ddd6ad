"""The first call and the time until graphs serve, each in a new process, caches cold then warm.

Per stream (ViT-B/16 uniform batches; CLIP ViT-L/14-336, 8 to 48 images a call; the
Qwen2.5-VL-3B tower on mixed batches) and per mode (``vitgraph``: graphs captured inside the
first calls; ``vitgraph-background``: calls answered by the model's own forward while a thread
prepares the graphs), three new processes share one new cache folder (``vitgraph bench
--cache-dir``): the first finds it empty (cold) and fills it, under a compile job id
(``TORCH_COMPILE_JOB_ID``), so Dynamo keeps its record of the sizes that turned dynamic there
too; the second reads the kernels without a job id (warm, as a user who set none); the third
reads them under the job id (``job id``: it traces dynamic at once). Each process runs
``vitgraph bench --modes MODE --json``; the table gives its first call, first pass (every call of
the stream once), the time until graphs serve (the first pass plus the wait for a background
preparation, ``ready_s``) and the steady p50.

``--layer-regions off,on``: each mode also with ``vitgraph bench --layer-regions`` (the model's
repeated layers as nested compile regions), its own cache folder; the mode is then named
``MODE+regions``.

``--profile``: one more warm process per stream in mode ``vitgraph`` under cProfile, its 30
functions of most cumulative time (what a warm first pass spends its time on); the raw profile
lands in ``$OUT/first_call_<stream>.prof`` when ``$OUT`` is set.

Usage: python benchmarks/first_call.py [--streams vit,clip,qwen] [--modes a,b] [--calls 24]
[--layer-regions off,on] [--profile].
Text to stdout and to ``$OUT/first_call.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench_out import emit  # noqa: E402

#: stream name -> ``vitgraph bench`` arguments
STREAMS = {
    "vit": ["--model", "vit-b16", "--workload", "uniform-batch"],
    "clip": ["--model", "clip-l14-336", "--workload", "uniform-batch", "--max-batch", "48"],
    "qwen": ["--model", "qwen2.5-vl", "--workload", "mixed-batch"],
}


#: rows: (label, whether the process runs under the compile job id)
STATES = (("cold", True), ("warm", False), ("job id", True))
JOB_ID = "first-call-bench"


def run_one(stream: str, mode: str, calls: int, caches: Path, out: Path, job_id: bool = False,
            profile: Path | None = None, regions: bool = False) -> dict:
    """One new process: ``vitgraph bench`` on ``stream`` in ``mode``, its caches in ``caches``,
    under the compile job id or none."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_JOB_ID"}
    if job_id:
        env["TORCH_COMPILE_JOB_ID"] = JOB_ID
    prefix = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    cmd = [sys.executable, *prefix, "-m", "vit_graph_backend", "bench", *STREAMS[stream],
           "--modes", mode, "--calls", str(calls), "--no-progress", "--json", str(out),
           "--cache-dir", str(caches), *(["--layer-regions"] if regions else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        text = done.stderr or done.stdout
        return {"status": "failed", "error": text[max(0, text.rfind("Traceback")):][-2000:]}
    return json.loads(out.read_text())["modes"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="vit,clip,qwen")
    parser.add_argument("--modes", default="vitgraph,vitgraph-background")
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--layer-regions", default="off", help="off, on, or off,on")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import torch

    regions = [{"off": False, "on": True}[r] for r in args.layer_regions.split(",")]
    lines = [f"# python benchmarks/first_call.py --streams {args.streams} --modes {args.modes} "
             f"--calls {args.calls} --layer-regions {args.layer_regions}",
             f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16, random "
             "weights; each row one new process; cold: a new empty cache folder; warm: the "
             "kernels it kept, no compile job id; job id: the same under the cold one's job id",
             f"{'stream':<6} {'mode':<28} {'caches':<7} {'first call s':>12} "
             f"{'first pass s':>12} {'graphs serve s':>14} {'p50 ms':>8}  phases (s)"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for stream in args.streams.split(","):
            for mode, region in [(m, r) for m in args.modes.split(",") for r in regions]:
                caches = Path(tmp, f"{stream}-{mode}-{region}")
                label = mode + ("+regions" if region else "")
                for state, job_id in STATES:
                    out = Path(tmp, f"{stream}-{label}-{state.replace(' ', '-')}.json")
                    m = run_one(stream, mode, args.calls, caches, out, job_id, regions=region)
                    if m.get("status") != "ok":
                        line = f"{stream:<6} {label:<28} {state:<7} FAILED {m.get('error')}"
                    else:
                        p = m["first_pass_phases_s"] or {}
                        phases = " ".join(f"{k} {v:.2f}" for k, v in p.items())
                        line = (f"{stream:<6} {label:<28} {state:<7} {m['first_call_s']:>12.2f} "
                                f"{m['first_pass_s']:>12.2f} {m['ready_s']:>14.2f} "
                                f"{m['latency_ms']['p50']:>8.2f}  {phases}")
                    lines.append(line)
                    print(line, flush=True)
            if args.profile:
                lines += _profile(stream, args.calls, Path(tmp, f"{stream}-vitgraph-{regions[0]}"),
                                  Path(tmp), regions[0])
    emit(lines, "first_call", echo=False)


def _profile(stream: str, calls: int, caches: Path, tmp: Path, regions: bool) -> list[str]:
    """A warm ``vitgraph`` process under cProfile: its top functions by cumulative time."""
    import io
    import pstats

    stats_file = tmp / f"{stream}.prof"
    m = run_one(stream, "vitgraph", calls, caches, tmp / f"{stream}-profile.json",
                profile=stats_file, regions=regions)
    lines = [f"# {stream}, vitgraph, warm, under cProfile: first pass "
             f"{m.get('first_pass_s')} s (the profiler slows Python-heavy phases)"]
    if stats_file.exists():
        if os.environ.get("OUT"):   # the raw profile too, for pstats elsewhere
            shutil.copy(stats_file, Path(os.environ["OUT"], f"first_call_{stream}.prof"))
        text = io.StringIO()
        pstats.Stats(str(stats_file), stream=text).sort_stats("cumulative").print_stats(30)
        lines += [line for line in text.getvalue().splitlines() if line.strip()][-32:]
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
