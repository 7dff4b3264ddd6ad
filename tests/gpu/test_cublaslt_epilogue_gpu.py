"""The cuBLASLt candidate of ``epilogue_fusion`` on CUDA: the GEMM with bias and tanh GELU in its
epilogue (``_compat.addmm_gelu_tanh``) replayed from a CUDA graph on new data, and the op's
per-shape choice at SigLIP so400m's fc1 for one image, where it is timed beside the fused kernel
and cuBLAS + GELU (``fused_linear``)."""

from __future__ import annotations

import logging

import pytest
import torch

from vit_graph_backend import _compat
from vit_graph_backend.kernels import fused_linear
from vit_graph_backend.kernels.fused_linear import CHOICES, linear_act_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fused_linear.fused_epilogue_unavailable(
                  torch.device("cuda")) is not None if torch.cuda.is_available() else False,
                  reason="the op's timed choice needs a Hopper or newer GPU with Triton")]

DEV, DT = "cuda", torch.bfloat16


def _operands(rows, k, n, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, device=DEV, dtype=DT, generator=gen)
    w = torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k ** 0.5
    b = torch.randn(n, device=DEV, dtype=DT, generator=gen)
    return x, w, b


def _max_error(out, x, w, b):
    ref = linear_act_reference(x.float(), w.float(), b.float(), "gelu_tanh")
    return (out.float() - ref).abs().max().item()


def test_the_epilogue_replays_from_a_graph_on_new_data():
    x, w, b = _operands(729, 1152, 4304, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _compat.addmm_gelu_tanh(x, w, b)   # cuBLASLt's workspace and heuristics, outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = _compat.addmm_gelu_tanh(x, w, b)
    x.copy_(_operands(729, 1152, 4304, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert _max_error(out, x, w, b) < 0.05   # bf16 rounding of outputs up to about 5


def test_the_op_times_the_epilogue_at_siglip_fc1_for_one_image(caplog):
    x, w, b = _operands(729, 1152, 4304, seed=2)
    with caplog.at_level(logging.DEBUG, logger="vit_graph_backend.kernels.fused_linear"):
        out = fused_linear.linear_act(x, w, b, "gelu_tanh")
    torch.cuda.synchronize()
    timed = [r.getMessage() for r in caplog.records if "729 x 1152 -> 4304" in r.getMessage()]
    print("siglip fc1, one image:", timed)
    assert timed and "cublaslt epilogue" in timed[-1] and "cublas+activation" in timed[-1]
    chosen = CHOICES.state["chosen"][f"cuda:{x.device.index} bfloat16 729x1152 -> 4304 "
                                     f"gelu_tanh +bias"]
    assert chosen in {"cublaslt epilogue", "cublas+activation"} or chosen.startswith("fused ")
    assert _max_error(out, x, w, b) < 0.05
