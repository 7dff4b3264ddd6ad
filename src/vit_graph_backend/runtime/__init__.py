"""The graph runtime: one manager per encoder plans each call, pads it into budgets, replays one
CUDA graph per budget and slices the outputs back (``manager.py``). Parts: ``capture``,
``launch``, ``stream_order``, ``replay_io``, ``served_budgets``, ``weights``, ``inner``,
``timing``, ``report``.
"""

from .manager import EncoderCudaGraphManager

__all__ = ["EncoderCudaGraphManager"]
