"""Attention kernels at the packed towers' shapes, three questions in one run.

1. **Window layers** (Qwen2.5-VL: windows of at most 64 rows, the graph's segment slots mostly
   empty): flash varlen against the package's short-segment Triton kernel, which attends one
   short segment per program (``adapters/_short_attention_kernel.py``), with 4 and 8 warps.
2. **cuDNN's other execution plans** for the full-attention layers (head sizes 72 and 80, which
   the heuristic's first plan runs in a 128-wide kernel): every plan the frontend offers, timed.
3. **The rotary embedding inside the window kernel**: a window layer's rotary kernel then
   attention, against one prototype kernel (``window_triton_rotary``) that rotates q and k as it
   loads them from the unrotated projection.

Each window case checks both kernels against a float32 per-segment reference and times CUDA
graph replays (10 calls per graph, median of 20 replays). Usage:
``python benchmarks/attention_kernel_probe.py [windows] [rotary] [cudnn]``; text to stdout and $OUT.
"""

from __future__ import annotations

import random
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _bench_out import emit

from vit_graph_backend.kernels._short_attention_triton import attend
from vit_graph_backend.runtime.timing import graph_ms as _graph_ms


def window_triton(q, k, v, offsets, max_len, scale, warps=4):
    """The package's short-segment kernel (``adapters/_short_attention_kernel.py``)."""
    block = max(16, triton.next_power_of_2(max_len))
    return attend(q, k, v, offsets, block, scale, warps)


@triton.jit
def _rotary_window_kernel(qkv_ptr, o_ptr, offsets, qkv_row, o_row, cos_ptr, sin_ptr, table_row,
                          scale_log2, HEADS_ALL: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK: tl.constexpr, WIDTH: tl.constexpr, HALF_WIDTH: tl.constexpr,
                          HEADS: tl.constexpr):
    """The short-segment kernel on the unrotated ``(rows, 3, heads, dim)`` projection, q and k
    rotated as they are loaded (two contiguous half tiles each, float32 math, one rounding),
    ``HEADS`` heads per program sharing the program's table loads."""
    segment = tl.program_id(0)
    start = tl.load(offsets + segment)
    count = tl.load(offsets + segment + 1) - start
    if count > 0:
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, WIDTH)
        halves = tl.arange(0, HALF_WIDTH)[None, :]
        live = rows < count
        mask = live[:, None] & (cols[None, :] < HEAD_DIM)
        half_mask = live[:, None] & (halves < HEAD_DIM // 2)
        at = (start + rows).to(tl.int64)[:, None]
        table = at * table_row
        cos1 = tl.load(cos_ptr + table + halves, mask=half_mask, other=0.0)
        cos2 = tl.load(cos_ptr + table + HEAD_DIM // 2 + halves, mask=half_mask, other=0.0)
        sin1 = tl.load(sin_ptr + table + halves, mask=half_mask, other=0.0)
        sin2 = tl.load(sin_ptr + table + HEAD_DIM // 2 + halves, mask=half_mask, other=0.0)
        for step in tl.static_range(HEADS):
            head = tl.program_id(1) * HEADS + step
            base = qkv_ptr + at * qkv_row + head * HEAD_DIM
            q1 = tl.load(base + halves, mask=half_mask, other=0.0)
            q2 = tl.load(base + HEAD_DIM // 2 + halves, mask=half_mask, other=0.0)
            k1 = tl.load(base + HEADS_ALL * HEAD_DIM + halves, mask=half_mask, other=0.0)
            k2 = tl.load(base + HEADS_ALL * HEAD_DIM + HEAD_DIM // 2 + halves, mask=half_mask,
                         other=0.0)
            v = tl.load(base + 2 * HEADS_ALL * HEAD_DIM + cols[None, :], mask=mask, other=0.0)
            a, b = q1.to(tl.float32), q2.to(tl.float32)
            q1, q2 = (a * cos1 + b * sin1).to(v.dtype), (b * cos2 + a * sin2).to(v.dtype)
            a, b = k1.to(tl.float32), k2.to(tl.float32)
            k1, k2 = (a * cos1 + b * sin1).to(v.dtype), (b * cos2 + a * sin2).to(v.dtype)
            scores = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
            scores = tl.where(live[None, :], scores * scale_log2, float("-inf"))
            weights = tl.exp2(scores - tl.max(scores, 1)[:, None])
            out = tl.dot(weights.to(v.dtype), v) / tl.sum(weights, 1)[:, None]
            tl.store(o_ptr + at * o_row + head * HEAD_DIM + cols[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=mask)


def window_triton_rotary(qkv, cos, sin, offsets, scale, heads_per_program=1):
    rows, _, heads, dim = qkv.shape
    assert qkv.stride(3) == 1 and qkv.stride(2) == dim and qkv.stride(1) == heads * dim
    out = torch.empty(rows, heads, dim, device=qkv.device, dtype=qkv.dtype)
    _rotary_window_kernel[(offsets.numel() - 1, heads // heads_per_program)](
        qkv, out, offsets, qkv.stride(0), out.stride(0), cos, sin, cos.stride(0),
        scale * 1.4426950408889634, HEADS_ALL=heads, HEAD_DIM=dim, BLOCK=64,
        WIDTH=max(16, triton.next_power_of_2(dim)),
        HALF_WIDTH=max(16, triton.next_power_of_2(dim // 2)), HEADS=heads_per_program,
        num_warps=4, num_stages=1)
    return out


def flash(q, k, v, offsets, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, offsets, offsets, max_len, max_len)


def reference(q, k, v, lengths, scale):
    out, start = torch.zeros(q.shape, dtype=torch.float32, device=q.device), 0
    for n in lengths:
        if n:
            qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
            out[start:start + n] = F.scaled_dot_product_attention(
                qs, ks, vs, scale=scale).transpose(0, 1)
        start += n
    return out


def graph_ms(fn):
    """GPU ms per call, 10 calls per CUDA graph, median of 20 replays (the package's timer)."""
    return _graph_ms(fn, calls=10, reps=20)


def window_lengths(grid_h, grid_w, window=8):
    """Qwen2.5-VL window segment lengths (rows) of one image of ``grid_h x grid_w`` patches."""
    lengths = []
    for top in range(0, grid_h, window):
        for left in range(0, grid_w, window):
            lengths.append(min(window, grid_h - top) * min(window, grid_w - left))
    return lengths


def window_case(rows, lengths):
    """The graph's window segments: real windows, empty slots up to the slot bound, then the
    padding rows in 64-row chunks (``_qwen_packing.segments``)."""
    tokens = rows // 4
    slots = min(tokens, (tokens + 3) // 4)
    segs = lengths + [0] * (slots - len(lengths))
    used = sum(lengths)
    chunks = -(-rows // 64) + 1
    ends = [min(used + 64 * (i + 1), rows) for i in range(chunks)]
    pads = [b - a for a, b in zip([used] + ends[:-1], ends)]
    return segs + pads


def run_windows(lines):
    dev, dtype, heads, dim = "cuda", torch.bfloat16, 16, 80
    scale = dim ** -0.5
    rng = random.Random(0)
    odd = [rng.choice([0, 1, 7, 16, 33, 48, 63, 64]) for _ in range(120)]
    cases = {"16384 rows (128 x 128 patches)": (16384, window_lengths(128, 128)),
             "4096 rows (64 x 64)": (4096, window_lengths(64, 64)),
             "1024 rows (32 x 32)": (1024, window_lengths(32, 32)),
             "6020 rows (70 x 86, partial windows)": (6020, window_lengths(70, 86)),
             "odd lengths 0..64": (sum(odd) + 100, odd)}
    lines.append("== window attention (Qwen2.5-VL-3B: 16 heads of 80), bf16; ms per call")
    lines.append(f"{'case':38s} {'slots':>6s} {'flash':>8s} {'triton w4':>10s} {'w8':>8s} "
                 f"{'err flash':>10s} {'err triton':>10s}")
    for name, (rows, lengths) in cases.items():
        segs = window_case(rows, lengths)
        offsets = F.pad(torch.tensor(segs, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                        (1, 0)).to(dev)
        assert int(offsets[-1]) == rows
        gen = torch.Generator(device=dev).manual_seed(rows)
        qkv = torch.randn(rows, 3, heads, dim, device=dev, dtype=dtype, generator=gen)
        qk = qkv[:, :2].contiguous()  # the rotary kernel's output layout
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        ref = reference(q, k, v, segs, scale)
        err_f = (flash(q, k, v, offsets, 64, scale).float() - ref).abs().max().item()
        err_t = (window_triton(q, k, v, offsets, 64, scale).float() - ref).abs().max().item()
        ms_f = graph_ms(lambda: flash(q, k, v, offsets, 64, scale))
        ms_t4 = graph_ms(lambda: window_triton(q, k, v, offsets, 64, scale, 4))
        ms_t8 = graph_ms(lambda: window_triton(q, k, v, offsets, 64, scale, 8))
        lines.append(f"{name:38s} {len(segs):6d} {ms_f:8.4f} {ms_t4:10.4f} {ms_t8:8.4f} "
                     f"{err_f:10.2e} {err_t:10.2e}")
        print(lines[-1], flush=True)


def run_rotary_windows(lines):
    """A window layer's work after the qkv projection: the rotary embedding (Inductor-compiled
    ``_fused.rotate_qk``, as the graphs run it) then attention (flash varlen, or the
    short-segment kernel), against one kernel rotating q and k as it loads them
    (``window_triton_rotary``, 1, 2 or 4 heads a program)."""
    from vit_graph_backend.kernels.fused_ops import rotate_qk

    dev, dtype, heads, dim = "cuda", torch.bfloat16, 16, 80
    scale = dim ** -0.5
    rotate = torch.compile(rotate_qk, dynamic=False)
    lines.append("== window layer with its rotary embedding (16 heads of 80), bf16; ms per call")
    lines.append(f"{'case':38s} {'rot+flash':>10s} {'rot+short':>10s} {'fused 1h':>9s} "
                 f"{'2h':>8s} {'4h':>8s} {'err fused vs rot+short':>24s}")
    for name, (rows, lengths) in {"16384 rows (128 x 128 patches)":
                                  (16384, window_lengths(128, 128)),
                                  "4096 rows (64 x 64)": (4096, window_lengths(64, 64)),
                                  "1024 rows (32 x 32)": (1024, window_lengths(32, 32))}.items():
        segs = window_case(rows, lengths)
        offsets = F.pad(torch.tensor(segs, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                        (1, 0)).to(dev)
        gen = torch.Generator(device=dev).manual_seed(rows)
        qkv = torch.randn(rows, 3, heads, dim, device=dev, dtype=dtype, generator=gen)
        angle = torch.rand(rows, 1, dim, device=dev, generator=gen) * 6.3
        cos, sin = angle.cos(), angle.sin()
        sin[..., :dim // 2] *= -1  # signed, as the adapter passes it

        def rot_flash():
            q, k = rotate(qkv, cos.unsqueeze(1), sin.unsqueeze(1))
            return flash(q, k, qkv[:, 2], offsets, 64, scale)

        def rot_short():
            q, k = rotate(qkv, cos.unsqueeze(1), sin.unsqueeze(1))
            return window_triton(q, k, qkv[:, 2], offsets, 64, scale)

        def fused(n):
            return lambda: window_triton_rotary(qkv, cos.view(rows, dim), sin.view(rows, dim),
                                                offsets, scale, n)

        err = (fused(1)().float() - rot_short().float()).abs().max().item()
        times = [graph_ms(fn) for fn in (rot_flash, rot_short, fused(1), fused(2), fused(4))]
        lines.append(f"{name:38s} {times[0]:10.4f} {times[1]:10.4f} {times[2]:9.4f} "
                     f"{times[3]:8.4f} {times[4]:8.4f} {err:24.2e}")
        print(lines[-1], flush=True)


def run_cudnn_plans(lines):
    try:
        import cudnn
    except Exception as exc:  # noqa: BLE001 - the probe reports and goes on
        lines.append(f"== cuDNN plans: frontend not importable ({exc})")
        return
    dev, dtype = "cuda", torch.bfloat16
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    cases = {"qwen2.5 full 16384 rows, d80": (16384, 16, 80, [16384]),
             "qwen2.5 full 4096 rows, d80": (4096, 16, 80, [4096]),
             "qwen3-8b full 6724 rows, d72": (6728, 16, 72, [6724, 4])}
    for name, (rows, heads, dim, lengths) in cases.items():
        scale = dim ** -0.5
        slots = len(lengths)
        max_len = max(lengths)
        qkv = torch.randn(rows, 3, heads, dim, device=dev, dtype=dtype)
        qk = qkv[:, :2].contiguous()
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        offsets = F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                        (1, 0)).to(dev)
        io = cudnn.data_type.BFLOAT16
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        index = dict(stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        seq = graph.tensor(name="seq", dim=[slots, 1, 1, 1], **index)
        dims = [slots, heads, max_len, dim]
        descs, ragged, feeds = [], {}, {}
        for tname, x in zip("qkv", (q, k, v)):
            row = x.stride(0)
            if row not in ragged:
                ragged[row] = graph.tensor(name=f"r{row}", dim=[slots + 1, 1, 1, 1], **index)
                feeds[ragged[row]] = (offsets * row).view(-1, 1, 1, 1)
            d = graph.tensor(name=tname, dim=dims, stride=[max_len * row, x.stride(1), row, 1],
                             data_type=io)
            d.set_ragged_offset(ragged[row])
            descs.append(d)
            feeds[d] = x
        out, _ = graph.sdpa(name="sdpa", q=descs[0], k=descs[1], v=descs[2],
                            generate_stats=False, attn_scale=scale, use_padding_mask=True,
                            seq_len_q=seq, seq_len_kv=seq)
        orow = heads * dim
        out.set_output(True).set_dim(dims).set_stride([max_len * orow, dim, orow, 1])
        if orow not in ragged:
            ragged[orow] = graph.tensor(name=f"r{orow}", dim=[slots + 1, 1, 1, 1], **index)
            feeds[ragged[orow]] = (offsets * orow).view(-1, 1, 1, 1)
        out.set_ragged_offset(ragged[orow])
        o = torch.empty(rows, heads, dim, device=dev, dtype=dtype)
        feeds[out] = o
        feeds[seq] = (offsets[1:] - offsets[:-1]).view(-1, 1, 1, 1)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B,
                                      cudnn.heur_mode.FALLBACK])
        count = graph.get_execution_plan_count()
        flops = sum(4 * n * n * dim * heads for n in lengths)
        ref = reference(q, k, v, lengths, scale)
        lines.append(f"== cuDNN plans, {name}: {count} offered")
        for i in range(count):
            try:
                graph.build_plan_at_index(i)
                ws = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), device=dev,
                                 dtype=torch.uint8)
                graph.execute_plan_at_index(feeds, ws, index=i, handle=handle)
                torch.cuda.synchronize()
                err = (o.float()[:lengths[0]] - ref[:lengths[0]]).abs().max().item()
                times = []
                for _ in range(10):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    s.record()
                    for _ in range(5):
                        graph.execute_plan_at_index(feeds, ws, index=i, handle=handle)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 5)
                ms = statistics.median(times)
                plan = graph.get_plan_name_at_index(i)
                lines.append(f"  {i:2d} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
                             f"err {err:.1e}  {plan}")
            except Exception as exc:  # noqa: BLE001 - a plan that does not build or run
                lines.append(f"  {i:2d} refused: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}"[:160])
            print(lines[-1], flush=True)


def main():
    props = torch.cuda.get_device_properties(0)
    lines = [f"device {props.name}, torch {torch.__version__}, triton {triton.__version__}"]
    print(lines[0], flush=True)
    parts = sys.argv[1:] or ["windows", "rotary", "cudnn"]
    if "windows" in parts:
        run_windows(lines)
    if "rotary" in parts:
        run_rotary_windows(lines)
    if "cudnn" in parts:
        run_cudnn_plans(lines)
    emit(lines, "attention_kernel_probe", echo=False)


if __name__ == "__main__":
    main()
