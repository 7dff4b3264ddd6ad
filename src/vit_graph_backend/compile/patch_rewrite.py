"""``patch_embedding="gemm"`` (the default): the ViTs' patch embedding as one GEMM over the
image's patches.

A ViT embeds its image with a convolution whose kernel equals its stride (14 or 16 pixels in
CLIP, SigLIP, DINOv2 and timm's and HF's ViTs): each output position reads one patch, no patch
twice. That is a matrix product of the patches (``C * k * k`` values each) with the weight, but
cuDNN runs it as a convolution, far below a GEMM's speed: on an H100, in CUDA graphs with
Inductor, 1.05 ms at CLIP ViT-L/14-336 with 48 images against 0.23 ms as this GEMM and 0.13 ms
with the patch length padded to a multiple of 8; 0.42 against 0.035 ms at ViT-B/16
(``benchmarks/results/patch_embedding_conv_vs_gemm_*``). cuDNN's first convolution at each new
batch size also spends 0.8 to 2.8 ms of host time, the GEMM's 0.1 to 0.6 ms.

:func:`patch_embeddings_as_gemm` rewrites such a ``torch.conv2d`` of a Dynamo graph into
``x.unfold(2, k, k).unfold(3, k, k)`` (views: the patches, the remainder dropped as the
convolution drops it), one copy into rows of ``C * k * k`` values, zero-padded to a multiple of
8 (rows of 16-byte multiples, which cuBLAS's fast bf16 kernels need; CLIP's 588 becomes 592, the
weight's rows likewise, so the product is unchanged), and ``F.linear`` with the weight viewed as
``[out, C * k * k]``. The batch axis stays its own dimension throughout, so the graph's row
independence (``batched_layout.py``) is untouched.

The GEMM's result is the convolution's output with channels last; it is made contiguous, so
every later op sees the strides the convolution gave (a ``view`` of a channels-last tensor would
fail, and the graph's recorded metadata holds those strides).

Pure FX graph editing on PyTorch's own ops, so it runs on any device and under every inner
compiler; what it finds and replaces is tested on CPU (``tests/unit/test_patch_rewrite.py``),
on a GPU against a float32 convolution and eager (``tests/gpu/test_patch_rewrite_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat

__all__ = ["patch_embeddings_as_gemm"]


def patch_embeddings_as_gemm(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite, in place, every ``torch.conv2d`` of ``gm`` that is a patch embedding into the
    patches' GEMM (module docstring); returns how many.

    A patch embedding here: a 4-D weight that is a graph input, a stride equal to the kernel,
    no padding, no dilation, one group, and an input of four dimensions.

    Every inserted node calls a function AOTAutograd's compile cache accepts without the fake
    value Dynamo records on its own nodes (an ATen op, a public ``torch`` or
    ``torch.nn.functional`` function; torch/_functorch/_aot_autograd/autograd_cache.py): a
    tensor method call on a node without one makes the cache pass the graph by, and every
    process traced a rewritten CLIP-L again (``compile_fx`` 14 to 17 s against 3.4 s warm on an
    H100, ``benchmarks/results/clip_l14_336_first_pass_cold_warm_patch_gemm_vs_conv_*``)."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    rewritten = 0
    for node in list(gm.graph.nodes):
        parts = _patch_conv(node, index, example_inputs)
        if parts is None:
            continue
        x, weight, bias, (channels, kh, kw) = parts
        graph = gm.graph
        with graph.inserting_before(node):
            patches = graph.call_function(torch.ops.aten.unfold.default, (x, 2, kh, kh))
            patches = graph.call_function(torch.ops.aten.unfold.default, (patches, 3, kw, kw))
            # [N, C, H/kh, W/kw, kh, kw] -> [N, H/kh, W/kw, C, kh, kw]: one row a patch, in the
            # weight's (C, kh, kw) order
            patches = graph.call_function(torch.permute, (patches, (0, 2, 3, 1, 4, 5)))
            patches = graph.call_function(torch.flatten, (patches, 3))
            matrix = graph.call_function(torch.flatten, (weight, 1))
            pad = -(channels * kh * kw) % 8
            if pad:  # module docstring: rows of 16-byte multiples for cuBLAS's fast kernels
                patches = graph.call_function(F.pad, (patches, (0, pad)))
                matrix = graph.call_function(F.pad, (matrix, (0, pad)))
            out = graph.call_function(F.linear, (patches, matrix, bias))
            out = graph.call_function(torch.permute, (out, (0, 3, 1, 2)))
            out = graph.call_function(torch.clone, (out,),
                                      {"memory_format": torch.contiguous_format})
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _patch_conv(node: torch.fx.Node, index: dict[torch.fx.Node, int],
                example_inputs: Sequence[Any]) -> tuple[Any, Any, Any, tuple[int, int, int]] | None:
    """``(input, weight, bias, (input channels, kernel height, kernel width))`` of a
    patch-embedding ``torch.conv2d`` node, else ``None``."""
    if node.op != "call_function" or node.target is not torch.conv2d:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = (None, None, None, 1, 0, 1, 1)
    args = [node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
            for i, (name, default) in enumerate(zip(names, defaults))]
    x, weight_node, bias, stride, padding, dilation, groups = args
    source = index.get(weight_node)
    weight = None if source is None else example_inputs[source]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        return None
    kernel = tuple(weight.shape[2:])
    value = _compat.example_value(x) if isinstance(x, torch.fx.Node) else None
    if (not isinstance(value, torch.Tensor) or value.dim() != 4 or groups != 1
            or _pair(stride) != kernel or _pair(dilation) != (1, 1)
            or padding not in (0, (0, 0), [0, 0], "valid")):
        return None
    return x, weight_node, bias, (weight.shape[1], *kernel)


def _pair(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        return (value[0], value[0]) if len(value) == 1 else tuple(value)
    return None

