"""cuDNN's own ragged (THD) attention through cudnn-frontend's graph API, against flash varlen,
on the packed towers' shapes (the cases of ``varlen_attention_probe.py``).

PyTorch's ``aten._cudnn_attention_forward`` with offsets fails CUDA-graph capture in torch 2.11
(``benchmarks/results/varlen_attention_probe_*``); this probe asks whether the same cuDNN kernel,
driven by ``nvidia-cudnn-frontend`` (optional, carried as a wheel), captures, and how fast it is.
One cuDNN graph per case: batch = the segment slots (zero-length ones included), max sequence =
the longest segment, ragged offsets in elements (token offset x heads x head_dim), padding mask
from per-segment lengths. ``pkg`` runs the package's ``RaggedAttention`` (its layout tensors computed
at every call, as a graph's first layer does), ``-views`` on the strided views the adapters pass
(q, k from one ``(rows, 2, heads, dim)`` buffer, v from the ``(rows, 3, heads, dim)`` projection).

Usage: python benchmarks/cudnn_ragged_attention_probe.py. Text to stdout and
$OUT/cudnn_ragged_attention_probe.txt.
"""

from __future__ import annotations

import torch
from _bench_out import emit
from varlen_attention_probe import (
    CASES,
    HEADER,
    case_inputs,
    flash,
    measure,
    offsets_of,
    reference,
)

from vit_graph_backend.kernels.cudnn_attention import RaggedAttention


def build_plans(cudnn, graph, device) -> torch.Tensor:
    """Validate a cuDNN graph and build its execution plans; returns its workspace."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return torch.empty(max(graph.get_workspace_size(), 1), device=device, dtype=torch.uint8)


def cudnn_ragged(q, k, v, lengths, zero_slots):
    """A callable running one cuDNN ragged SDPA graph over packed ``[rows, heads, dim]`` q/k/v."""
    import cudnn

    rows, heads, dim = q.shape
    slots = len(lengths) + zero_slots
    max_len = max(lengths)
    handle = cudnn.create_handle()
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    dims = [slots, heads, max_len, dim]
    strides = [max_len * heads * dim, dim, heads * dim, 1]
    one = dict(stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    ragged = graph.tensor(name="ragged", dim=[slots + 1, 1, 1, 1], **one)
    seq = graph.tensor(name="seq", dim=[slots, 1, 1, 1], **one)
    qkv = []
    for name in "qkv":
        t = graph.tensor(name=name, dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
        t.set_ragged_offset(ragged)
        qkv.append(t)
    try:
        o, _ = graph.sdpa(name="sdpa", q=qkv[0], k=qkv[1], v=qkv[2], generate_stats=False,
                          attn_scale=dim ** -0.5, use_padding_mask=True, seq_len_q=seq,
                          seq_len_kv=seq)
    except TypeError:  # older cudnn-frontend spells it is_inference
        o, _ = graph.sdpa(name="sdpa", q=qkv[0], k=qkv[1], v=qkv[2], is_inference=True,
                          attn_scale=dim ** -0.5, use_padding_mask=True, seq_len_q=seq,
                          seq_len_kv=seq)
    o.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(ragged)
    workspace = build_plans(cudnn, graph, q.device)
    lens = torch.tensor(lengths + [0] * zero_slots, dtype=torch.int32, device=q.device)
    ragged_t = offsets_of(lengths, zero_slots, q.device) * (heads * dim)
    out = torch.empty_like(q)
    feeds = {qkv[0]: q, qkv[1]: k, qkv[2]: v, o: out, ragged: ragged_t, seq: lens}

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute(feeds, workspace, handle=handle)
        return out

    return run


def main():
    import cudnn

    dev = "cuda"
    lines = [f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
             f"{torch.backends.cudnn.version()} (cudnn-frontend {cudnn.__version__}, backend "
             f"{cudnn.backend_version()}); bf16; ms = median graph replay", HEADER]
    print(lines[0], flush=True)
    inputs = case_inputs(dev)
    for name, (rows, heads, dim, lengths, zero_slots) in CASES.items():
        q, k, v = inputs[name]
        off = offsets_of(lengths, zero_slots, dev)
        max_len = max(lengths)
        ref = reference(q, k, v, lengths)
        kernels = {"flash": lambda: flash(q, k, v, off, max_len)}
        # the layout the adapters pass: q and k views of one (rows, 2, heads, dim) buffer, v a
        # view of the (rows, 3, heads, dim) projection; through the package's RaggedAttention
        qk = torch.stack([q, k], 1)
        qkv = torch.stack([q, k, v], 1)
        qs, ks, vs = qk[:, 0], qk[:, 1], qkv[:, 2]
        pkg = RaggedAttention()
        kernels["flash-views"] = lambda: flash(qs, ks, vs, off, max_len)
        kernels["pkg"] = lambda: pkg(q, k, v, off, max_len, dim ** -0.5)
        kernels["pkg-views"] = lambda: pkg(qs, ks, vs, off, max_len, dim ** -0.5)
        try:
            kernels["cudnn-fe"] = cudnn_ragged(q, k, v, lengths, zero_slots)
        except Exception as exc:
            lines.append(f"{name:<36}{'cudnn-fe':<11} build failed: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120]}")
            print(lines[-1], flush=True)
        for kname, fn in kernels.items():
            lines.append(measure(name, kname, fn, ref, rows))
            print(lines[-1], flush=True)
    emit(lines, "cudnn_ragged_attention_probe")


if __name__ == "__main__":
    main()
