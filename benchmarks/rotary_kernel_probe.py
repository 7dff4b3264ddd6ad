"""The Qwen adapters' fused rotary embedding (``adapters/_fused.rotate_qk``) against two rewrites,
each compiled by Inductor with the row dimension dynamic, as the adapters compile it.

- ``roll``: as committed: ``addcmul(qk * cos, roll(qk, half), signed_sin)`` over full-width
  float32 ``cos``/``signed_sin``.
- ``halves``: the two halves written out, ``[x1 c - x2 s, x2 c + x1 s]``, with full-width tables.
- ``half-tables``: the same with half-width ``cos``/``sin`` tables (HF's tables repeat their first
  half, so half the table traffic).

Shapes: Qwen2.5-VL-3B at 16,384 rows (16 heads of 80) and Qwen3-VL-8B at 6,724 rows (16 of 72),
bf16 ``qkv`` of ``(rows, 3, heads, head_dim)``. Reports ms per call (median of CUDA-event timed
calls) and the max abs difference from ``roll``.

Usage: python benchmarks/rotary_kernel_probe.py. Text to stdout and $OUT/rotary_kernel_probe.txt.
"""

from __future__ import annotations

import statistics

import torch
from _bench_out import emit

from vit_graph_backend import _compat
from vit_graph_backend.kernels.fused_ops import rotate_qk
from vit_graph_backend.bench.timing import CallTimer


def halves(qkv, cos, sin):
    qk = qkv[:, :2].float()
    half = qk.shape[-1] // 2
    x1, x2 = qk[..., :half], qk[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], -1).to(qkv.dtype)
    return out.unbind(1)


def half_tables(qkv, cos_half, sin_half):
    qk = qkv[:, :2].float()
    half = qk.shape[-1] // 2
    x1, x2 = qk[..., :half], qk[..., half:]
    out = torch.cat([x1 * cos_half - x2 * sin_half, x2 * cos_half + x1 * sin_half], -1)
    return out.to(qkv.dtype).unbind(1)


def timed(fn, *args, reps=20):
    """Median CUDA-event ms of ``fn(*args)``, after 3 warm-up calls."""
    timer = CallTimer("cuda")
    for _ in range(3):
        fn(*args)
    return statistics.median(timer.time_call(fn, args)[1] for _ in range(reps))


def main():
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ms per call"]
    compiled = {name: torch.compile(fn, fullgraph=True)
                for name, fn in (("roll", rotate_qk), ("halves", halves),
                                 ("half-tables", half_tables))}
    for rows, heads, dim in ((16384, 16, 80), (6724, 16, 72)):
        qkv = torch.randn(rows, 3, heads, dim, device="cuda", dtype=torch.bfloat16)
        freqs = torch.randn(rows, dim // 2, device="cuda")
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().view(rows, 1, 1, dim), emb.sin().view(rows, 1, 1, dim)
        half = dim // 2
        signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        args = {"roll": (qkv, cos, signed), "halves": (qkv, cos, sin),
                "half-tables": (qkv, cos[..., :half].contiguous(), sin[..., :half].contiguous())}
        for tensors in args.values():
            for t in tensors:
                _compat.maybe_mark_dynamic(t, 0)
        ref = compiled["roll"](*args["roll"])
        for name, fn in compiled.items():
            out = fn(*args[name])
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
            ms = timed(fn, *args[name])
            lines.append(f"rows {rows:>6} heads {heads} dim {dim}  {name:<12}{ms:8.3f} ms   "
                         f"max abs diff {diff:.3g}")
            print(lines[-1], flush=True)
    emit(lines, "rotary_kernel_probe", echo=False)  # printed line by line above


if __name__ == "__main__":
    main()
