"""The graph runtime: one manager per encoder plans each call, pads it into budgets, replays one
CUDA graph per budget and slices the outputs back (``manager.py``).

Its parts: ``capture`` (largest budget first into one pool, within a memory bound, surviving a
capture that fails), ``launch`` (device-launch executables), ``stream_order`` (any thread, any
stream), ``replay_io`` (static buffers in and out), ``served_budgets`` (the budgets served and
the plans over them), ``weights`` (the weights contract and its per-call check), ``inner``
(what runs inside a graph), ``timing`` (GPU time of candidate kernels), ``report`` (the fields
of ``report()``).
"""

from .manager import EncoderCudaGraphManager

__all__ = ["EncoderCudaGraphManager"]
