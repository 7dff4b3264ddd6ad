"""Full attention at the Qwen towers' head sizes (80, 72): does zero-padding the head help?

cuDNN's kernel for Qwen2.5-VL-3B's full-attention layers (16 heads of 80) is named for a 128-wide
head tile (``..._64x128x128_...`` in ``benchmarks/results/qwen2_5_vl_3b_16384_patches_*``), and it
ran those layers at about 360 TFLOP/s counted at head size 80. If the kernel pads 80 to 128, q, k
and v padded with zeros to a head size it tiles exactly (96, say) would run fewer FLOPs for the
same result: zero channels add nothing to ``q . k``, and v's zero channels give zero output
columns, which are dropped. The scale stays ``80 ** -0.5``.

Per case (one image's full attention: one segment of ``rows`` rows, then a padding segment when
``pad_rows``), each kernel is timed from CUDA-graph replays (``gpu_timing.graph_ms``) on q, k, v
already at the head size named, the padding copy timed apart (``pad``):

- ``cudnn-ragged``: the package's ``RaggedAttention`` (cuDNN through nvidia-cudnn-frontend), what
  the packed graphs run;
- ``sdpa``: ``F.scaled_dot_product_attention`` on the real segment alone (PyTorch's pick, cuDNN on
  an H100: what a budget that fits the image exactly could run);
- ``flash-varlen``: ``varlen_attn``, the fallback;
- ``cudnn-padmask``: cuDNN through the frontend without ragged offsets: one sequence of all the
  rows, the keys past the real rows hidden by cuDNN's padding mask (sequence lengths as device
  tensors, so it would capture as the ragged graph does). Asks whether the ragged graph's gap to
  ``sdpa`` is the ragged addressing or the mask.

TFLOP/s are counted at the real head size (4 * real_rows^2 * heads * head), so a padded kernel
that is no faster reads lower. ``err`` is the max abs difference from the same kernel at the real
head size, and at the real head size from ``sdpa`` on the real rows (bf16 inputs of unit
variance).

Usage: python benchmarks/attention_head_padding_probe.py. Text to stdout and
$OUT/attention_head_padding_probe.txt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bench_out import emit
from cudnn_ragged_attention_probe import build_plans

from vit_graph_backend.kernels.cudnn_attention import RaggedAttention, cudnn_frontend_reason
from vit_graph_backend.runtime.timing import graph_ms

#: name -> (rows of the image, padding rows after it, heads, head size, padded sizes to try)
CASES = {
    "qwen2.5-vl-3b 4096": (4096, 0, 16, 80, (88, 96, 128)),
    "qwen2.5-vl-3b 16384": (16384, 0, 16, 80, (88, 96, 128)),
    "qwen2.5-vl-3b 12000 in 16384": (12000, 4384, 16, 80, (96,)),
    "qwen3-vl-8b 6724": (6724, 0, 16, 72, (80, 96, 128)),
}


def cudnn_padding_mask(q, k, v, real, scale):
    """A callable running one cuDNN SDPA graph over ``(rows, heads, head)`` q, k, v as a batch
    of one sequence whose first ``real`` rows are real (cuDNN's padding mask hides the rest)."""
    import cudnn

    rows, heads, dim = q.shape
    handle = cudnn.create_handle()
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    dims, strides = [1, heads, rows, dim], [rows * heads * dim, dim, heads * dim, 1]
    seq = graph.tensor(name="seq", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                       data_type=cudnn.data_type.INT32)
    qkv = [graph.tensor(name=n, dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
           for n in "qkv"]
    o, _ = graph.sdpa(name="sdpa", q=qkv[0], k=qkv[1], v=qkv[2], generate_stats=False,
                      attn_scale=scale, use_padding_mask=True, seq_len_q=seq, seq_len_kv=seq)
    o.set_output(True).set_dim(dims).set_stride(strides)
    workspace = build_plans(cudnn, graph, q.device)
    lengths = torch.full((1, 1, 1, 1), real, dtype=torch.int32, device=q.device)
    out = torch.zeros_like(q)
    feeds = {qkv[0]: q, qkv[1]: k, qkv[2]: v, o: out, seq: lengths}

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute(feeds, workspace, handle=handle)
        return out

    return run


def _kernels(q, k, v, offsets, real, scale):
    from torch.nn.attention.varlen import varlen_attn

    ragged = RaggedAttention() if cudnn_frontend_reason() is None else None
    rows = q.shape[0]
    dense = [x[:real].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    out = {"sdpa": lambda: F.scaled_dot_product_attention(*dense, scale=scale)[0].transpose(0, 1)}
    if ragged is not None:
        out["cudnn-ragged"] = lambda: ragged(q, k, v, offsets, rows, scale)
        try:
            out["cudnn-padmask"] = cudnn_padding_mask(q, k, v, real, scale)
        except Exception as exc:  # the frontend refuses the graph
            print(f"cudnn-padmask not built: {type(exc).__name__}: {exc}".splitlines()[0])
    out["flash-varlen"] = lambda: varlen_attn(q, k, v, offsets, offsets, rows, rows, scale=scale)
    return out


def main() -> None:
    dev = "cuda"
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
             f"{torch.backends.cudnn.version()}; bf16; ms per call from CUDA-graph replays; "
             "TFLOP/s at the real head size",
             f"{'case':<30}{'head':>5}  {'kernel':<14}{'ms':>8}{'TFLOP/s':>9}{'pad ms':>8}"
             f"{'err':>10}"]
    print("\n".join(lines), flush=True)
    for name, (real, pad_rows, heads, head, widths) in CASES.items():
        rows = real + pad_rows
        gen = torch.Generator(device=dev).manual_seed(rows)
        q, k, v = (torch.randn(rows, heads, head, device=dev, dtype=torch.bfloat16,
                               generator=gen) for _ in range(3))
        ends = [0, real] + ([rows] if pad_rows else [])
        offsets = torch.tensor(ends, dtype=torch.int32, device=dev)
        scale = head ** -0.5
        flop = 4 * real * real * heads * head
        base = {}
        with torch.no_grad():
            for width in (head, *widths):
                qkv = [F.pad(x, (0, width - head)) for x in (q, k, v)]
                pad_ms = graph_ms(lambda: [F.pad(x, (0, width - head)) for x in (q, k, v)])
                for kname, run in _kernels(*qkv, offsets, real, scale).items():
                    try:
                        got = run()
                        if got is None:
                            raise RuntimeError("refused (see RaggedAttention.state)")
                        got = got[:real, :, :head].float()
                        ms = graph_ms(run)
                    except Exception as exc:  # a kernel that cannot take this head size
                        lines.append(f"{name:<30}{width:>5}  {kname:<14} failed: "
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                        print(lines[-1], flush=True)
                        continue
                    if width == head:
                        base[kname] = got
                    # at the real head size against sdpa on the real rows, padded against itself
                    ref = base.get("sdpa" if width == head else kname)
                    err = (got - ref).abs().max().item() if ref is not None else float("nan")
                    lines.append(f"{name:<30}{width:>5}  {kname:<14}{ms:>8.3f}"
                                 f"{flop / ms / 1e9:>9.0f}"
                                 f"{(pad_ms if width != head else 0.0):>8.3f}{err:>10.2e}")
                    print(lines[-1], flush=True)
    emit(lines, "attention_head_padding_probe", echo=False)


if __name__ == "__main__":
    main()
