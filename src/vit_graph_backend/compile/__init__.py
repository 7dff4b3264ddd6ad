"""The ``torch.compile`` backend: ``torch.compile(model, backend="vitgraph")`` (``backend``),
batched encoders served from padded graphs (``batched``, over the graph's layout: ``layout``),
and the graph rewrites applied before the inner compiler (``patch_rewrite``,
``linear_rewrite``)."""

from .backend import VitGraphBackend, register, vitgraph

__all__ = ["VitGraphBackend", "register", "vitgraph"]
