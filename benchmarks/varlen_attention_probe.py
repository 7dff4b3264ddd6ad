"""Variable-length attention on the packed towers' shapes: flash (``varlen_attn``) against cuDNN
(``aten._cudnn_attention_forward`` with cumulative offsets), and the dense SDPA HF eager runs.

For each case (rows, heads, head_dim, segment lengths as the Qwen adapters lay them out: real
segments, then the padding segment, then zero-length slots), on CUDA in bf16:

- max abs error of each against a float32 per-segment reference (zero-length slots included, so
  a kernel that mishandles a repeated offset shows here);
- whether it captures in a CUDA graph and replays with the same result;
- ms per call (median of CUDA-event timed graph replays, 20 repeats).

Usage: python benchmarks/varlen_attention_probe.py. Text to stdout and
$OUT/varlen_attention_probe.txt.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from _bench_out import emit
from diagnose import capture

CASES = {
    # Qwen3-VL-8B tower, one 1312 px image (41 x 41 tokens, 6724 rows) in the 1681-token budget
    "qwen3-8b full, 1 image 6724 rows": (6724 + 4, 16, 72, [6724, 4], 2),
    # the same budget holding a 640 px image: most rows are the padding segment
    "qwen3-8b full, 1 image 1600 rows": (6728, 16, 72, [1600, 5128], 2),
    # Qwen2.5-VL-3B full-attention layer, 16384 patches (128 x 128)
    "qwen2.5-3b full, 16384 rows": (16384, 16, 80, [16384], 2),
    # Qwen2.5-VL-3B window layer at 16384 rows: 64 windows of 256 rows
    "qwen2.5-3b window, 64 x 256 rows": (16384, 16, 80, [256] * 64, 4),
    # Qwen2.5-VL-3B window layer at 4096 rows with partial windows
    "qwen2.5-3b window, 4096 rows mixed": (4096, 16, 80, [256] * 12 + [128] * 4 + [64] * 8, 6),
}


def offsets_of(lengths, zero_slots, device):
    ends = torch.tensor(lengths + [0] * zero_slots, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return F.pad(ends, (1, 0)).to(device)


def reference(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def flash(q, k, v, off, max_len):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, off, off, max_len, max_len)


def cudnn(q, k, v, off, max_len):
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, off, off, max_len, max_len, False, 0.0, False, False)[0]


def dense(q, k, v, off, max_len):  # what HF eager runs for one segment: plain SDPA
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)


def masked_keys(backend=None):
    """Dense SDPA over all rows, keys past the first segment masked out by an additive bias of
    shape (1, 1, 1, rows): right for the first segment's queries (the padding rows after it get
    finite values nobody reads). ``backend`` forces one SDPA backend."""
    def fn(q, k, v, off, max_len):
        from torch.nn.attention import sdpa_kernel

        rows = q.shape[0]
        keep = torch.arange(rows, device=q.device) < off[1]
        bias = torch.zeros(rows, device=q.device, dtype=q.dtype).masked_fill(~keep, float("-inf"))
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        mask = bias.view(1, 1, 1, rows)
        if backend is None:
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        return out[0].transpose(0, 1)
    return fn


def time_graph(fn, reps=20):
    graph, out = capture(fn, warmup=2)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return out, statistics.median(times)


def measure(name, kname, fn, ref, rows):
    """One table line: ``fn()``'s max abs error against ``ref`` over its first ``rows`` rows,
    ms per captured replay, and whether the replay equals the eager call; or why it failed."""
    try:
        eager = fn().clone()
        torch.cuda.synchronize()
        err = (eager[:rows].float() - ref[:rows]).abs().max().item()
        replayed, ms = time_graph(fn)
        torch.cuda.synchronize()
        same = torch.equal(replayed, eager)
        return f"{name:<36}{kname:<11}{ms:8.3f}{err:13.3g}{str(same):>10}"
    except Exception as exc:  # a kernel that refuses the case is a result too
        return (f"{name:<36}{kname:<11} failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120]}")


def case_inputs(dev):
    """q, k, v of every case, seeded: all drawn before any capture, since a capture that fails
    can leave the generator unusable."""
    torch.manual_seed(0)
    return {name: [torch.randn(rows, heads, dim, device=dev, dtype=torch.bfloat16)
                   for _ in range(3)]
            for name, (rows, heads, dim, _, _) in CASES.items()}


HEADER = f"{'case':<36}{'kernel':<11}{'ms':>8}{'max abs err':>13}{'graph ok':>10}"


def main():
    dev = "cuda"
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
             f"{torch.backends.cudnn.version()}; bf16; ms = median graph replay", HEADER]
    print(lines[0], flush=True)
    inputs = case_inputs(dev)
    for name, (rows, heads, dim, lengths, zero_slots) in CASES.items():
        assert sum(lengths) == rows, name
        q, k, v = inputs[name]
        off = offsets_of(lengths, zero_slots, dev)
        max_len = max(lengths)
        ref = reference(q, k, v, lengths)
        first = lengths[0] if len(lengths) <= 2 else rows  # masked kernels: the first segment
        from torch.nn.attention import SDPBackend

        kernels = {"flash": flash}
        if len(lengths) == 1:
            kernels["dense"] = dense
        if len(lengths) <= 2:  # one real segment (+ the padding one)
            kernels["mask"] = masked_keys()
            kernels["mask-cudnn"] = masked_keys(SDPBackend.CUDNN_ATTENTION)
            kernels["mask-eff"] = masked_keys(SDPBackend.EFFICIENT_ATTENTION)
        kernels["cudnn"] = cudnn  # last: its failed capture can poison later ones
        for kname, fn in kernels.items():
            n = first if kname.startswith("mask") else rows
            lines.append(measure(name, kname, lambda fn=fn: fn(q, k, v, off, max_len), ref, n))
            print(lines[-1], flush=True)
    emit(lines, "varlen_attention_probe")


if __name__ == "__main__":
    main()
