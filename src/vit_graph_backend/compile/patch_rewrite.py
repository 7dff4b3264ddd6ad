"""``patch_embedding="gemm"`` (the default): the ViTs' patch embedding as one GEMM over the
image's patches.

A patch embedding is a convolution whose kernel equals its stride, i.e. a matrix product of the
patches with the weight, which cuDNN runs far below GEMM speed (docs/performance.md).
:func:`patch_embeddings_as_gemm` rewrites such a ``torch.conv2d`` into two ``unfold`` views, one
copy into rows of ``C * k * k`` values zero-padded to a multiple of 8 (cuBLAS's fast kernels need
16-byte rows; the weight is padded alike), and ``F.linear``. The batch axis stays its own
dimension, so row independence is untouched, and the result is made contiguous so later ops see
the convolution's strides. PyTorch's own ops only: any device, any inner compiler.
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
    patches' GEMM; returns how many. A patch embedding: a 4-D weight that is a graph input,
    stride equal to the kernel, no padding or dilation, one group, a 4-D input.

    Inserted nodes call only ATen ops or public ``torch``/``F`` functions: a tensor method call
    on a node without Dynamo's fake value makes AOTAutograd's compile cache bypass the graph."""
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
            # [N, C, H/kh, W/kw, kh, kw] -> [N, H/kh, W/kw, C, kh, kw]: one row a patch
            patches = graph.call_function(torch.permute, (patches, (0, 2, 3, 1, 4, 5)))
            patches = graph.call_function(torch.flatten, (patches, 3))
            matrix = graph.call_function(torch.flatten, (weight, 1))
            pad = -(channels * kh * kw) % 8
            if pad:  # rows of 16-byte multiples for cuBLAS's fast kernels
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
