"""Serving inside other code: a whole Hugging Face model in place (``hf``: ``serve_vision_``)
and encoders spread over a ``torch.distributed`` group (``parallel``: ``data_parallel``, with
the pure assignment of items to ranks in ``assignment``)."""

from .hf import restore_vision_, serve_vision_
from .parallel import data_parallel

__all__ = ["data_parallel", "restore_vision_", "serve_vision_"]
