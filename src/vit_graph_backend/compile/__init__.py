"""The ``torch.compile`` backend (``backend``), batched encoders served from padded graphs
(``batched``, ``layout``) and the graph rewrites before the inner compiler."""

from .backend import VitGraphBackend, register, vitgraph

__all__ = ["VitGraphBackend", "register", "vitgraph"]
