"""One call on a whole Hugging Face model: :func:`serve_vision_`, undone by :func:`restore_vision_`.

``serve_vision_(model)`` serves each vision tower of the model from CUDA graphs **in place**, so
``generate()``, ``forward()`` and ``get_image_features`` run unchanged:

- a **packed** tower (Qwen-VL, GLM-V, ERNIE-4.5-VL, ...) goes through
  :func:`vit_graph_backend.serve` and returns HF's output class with the fields the model reads
  (the adapter's ``hf_output_fields``: ``pooler_output``, Qwen3-VL's ``deepstack_features``,
  ERNIE's ``last_hidden_state``; the others ``None``); a call asking for hidden states or
  attentions runs the tower's own forward;
- a **batched** tower (CLIP, SigLIP, Idefics) runs through ``torch.compile(backend="vitgraph")``.

Only the tower's ``forward`` is replaced, by an instance attribute: the module tree,
``state_dict()`` keys and ``save_pretrained`` are unchanged, and :func:`restore_vision_` deletes
the attribute. Call it after moving the model to its device and dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..adapters import adapter_for, supported_classes, unserved_reason
from ..errors import InvalidInputError, UnsupportedModelError
from ..options import PACKED_ONLY_OPTIONS, VitGraphOptions
from ..adapters.serve import PackedGraphEncoder, serve

__all__ = ["BATCHED_TOWERS", "DEFAULT_VIDEO_FRAMES", "restore_vision_", "serve_vision_",
           "served_towers"]

log = logging.getLogger(__name__)

#: Batched ``[B, C, H, W]`` vision towers of HF vision-language models, served through the
#: ``torch.compile`` backend (class names; the outermost match of a model is served).
BATCHED_TOWERS = ("CLIPVisionModel", "CLIPVisionTransformer", "SiglipVisionModel",
                  "SiglipVisionTransformer", "Siglip2VisionModel", "Siglip2VisionTransformer",
                  "Idefics3VisionTransformer", "Idefics2VisionTransformer")

#: ``max_frames_per_batch`` of packed towers unless given: frames (temporal patches) per graph.
DEFAULT_VIDEO_FRAMES = 32

_SERVED = "_vitgraph_served"          # the tower's serving object, kept outside the module tree
_HIDDEN = ("output_hidden_states", "output_attentions")


def serve_vision_(model: nn.Module, options: VitGraphOptions | None = None,
                  **kwargs: Any) -> nn.Module:
    """Serve every vision tower of ``model`` from CUDA graphs, in place; returns ``model``.

    Args:
        model: a Hugging Face vision-language model (or a bare vision tower), on its device.
        options: :class:`VitGraphOptions` for every tower; or give its fields as keyword
            arguments (then ``max_frames_per_batch`` defaults to :data:`DEFAULT_VIDEO_FRAMES`).

    Raises:
        UnsupportedModelError: (a ``TypeError``) if ``model`` holds no tower this package serves.
        InvalidOptionError: for bad options, before any tower is touched.

    Example::

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(name, dtype=torch.bfloat16)
        vit_graph_backend.serve_vision_(model.to("cuda").eval())
        out = model.generate(**inputs)          # the vision tower replays CUDA graphs
        vit_graph_backend.restore_vision_(model)
    """
    towers = list(_towers(model))
    if not towers:
        known = next((f" ({type(m).__name__} at {name or 'the top'}: {why})"
                      for name, m in model.named_modules()
                      if (why := unserved_reason(m)) is not None), "")
        raise UnsupportedModelError(
            f"{type(model).__name__} holds no vision tower vit_graph_backend serves{known}. Packed "
            f"towers: {', '.join(c.rsplit('.', 1)[-1] for c in supported_classes())}; batched "
            f"towers: {', '.join(BATCHED_TOWERS)}")
    has_packed = any(packed for _, _, packed in towers)
    if has_packed and options is None and "max_frames_per_batch" not in kwargs:
        # size the graphs for videos, so a video replays instead of running eagerly
        kwargs = {**kwargs, "max_frames_per_batch": DEFAULT_VIDEO_FRAMES}
    batched = _batched_options(options, kwargs, has_packed)
    for name, tower, packed in towers:
        if _SERVED in tower.__dict__:
            continue  # served already: a second call changes nothing
        if packed:
            served = serve(tower, options, **kwargs)
            forward = functools.partial(_packed_forward, tower, served, type(tower).forward)
        else:
            served = torch.compile(tower.forward, backend="vitgraph", options=batched)
            forward = functools.partial(_batched_forward, served)
        object.__setattr__(tower, _SERVED, served)   # not a submodule: state_dict unchanged
        object.__setattr__(tower, "forward", forward)
        on_cuda = next(tower.parameters()).device.type == "cuda"
        log.info("vitgraph: serving %s (%s) %s", name or type(tower).__name__,
                 "packed" if packed else "batched", "from CUDA graphs" if on_cuda else
                 "eagerly, batch by batch (CUDA graphs need the tower on a CUDA device)")
    return model


def restore_vision_(model: nn.Module) -> nn.Module:
    """Undo :func:`serve_vision_`: every tower runs its own forward again. A packed tower's
    graphs are freed here; a batched tower's with ``torch.compiler.reset()``."""
    for _, tower, _ in _towers(model):
        served = tower.__dict__.pop(_SERVED, None)
        if served is None:
            continue
        tower.__dict__.pop("forward", None)
        if isinstance(served, PackedGraphEncoder):
            served.manager.clear()
    return model


def served_towers(model: nn.Module) -> dict[str, Any]:
    """The served towers of ``model`` by module name: a ``PackedGraphEncoder`` (with its
    ``report()``) or the ``torch.compile`` wrapper of a batched tower."""
    return {name: tower.__dict__[_SERVED] for name, tower, _ in _towers(model)
            if _SERVED in tower.__dict__}


def _towers(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, tower, packed?)`` of the outermost towers in ``model``, in module order."""
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        packed = adapter_for(module) is not None
        if packed or type(module).__name__ in BATCHED_TOWERS:
            taken.append(name)
            yield name, module, packed


def _batched_options(options: VitGraphOptions | None, kwargs: dict[str, Any],
                     has_packed: bool) -> dict[str, Any] | None:
    """Batched towers' ``torch.compile`` options, validated now; packed-only options are
    dropped when the model has packed towers, else refused."""
    if options is None:
        options = VitGraphOptions(**kwargs)
    if has_packed:
        options = dataclasses.replace(options, **{k: None for k in PACKED_ONLY_OPTIONS})
    options.resolve(batched=True)  # raises here, before any tower changes
    default = VitGraphOptions().to_dict()
    changed = {k: v for k, v in options.to_dict().items() if v != default[k]}
    return changed or None


def _batched_forward(compiled: Any, *args: Any, **kwargs: Any) -> Any:
    """A batched tower's call; an empty batch is refused before Dynamo traces it."""
    pixels = args[0] if args else kwargs.get("pixel_values")
    if isinstance(pixels, torch.Tensor) and pixels.dim() > 0 and pixels.shape[0] == 0:
        raise InvalidInputError(
            f"pixel_values holds an empty batch (shape {tuple(pixels.shape)}): a vision tower "
            "call needs at least one image")
    return compiled(*args, **kwargs)


def _packed_forward(tower: nn.Module, served: PackedGraphEncoder, own_forward: Any,
                    hidden_states: torch.Tensor, grid_thw: torch.Tensor | None = None,
                    **kwargs: Any) -> Any:
    """The HF packed tower's call, answered from the graphs."""
    if grid_thw is None:
        grid_thw = kwargs.pop("grid_thw", None)
    return_dict = kwargs.pop("return_dict", True)
    param = next(tower.parameters())
    moved = (param.device, param.dtype) != (served.manager.device, served.manager.dtype)
    if grid_thw is None or moved or any(kwargs.get(k) for k in _HIDDEN):
        # graphs keep no per-block outputs; a moved tower no longer matches its graphs
        if moved:
            _warn_moved(type(tower).__name__, str(param.device), str(param.dtype))
        return own_forward(tower, hidden_states, grid_thw=grid_thw, return_dict=return_dict,
                           **kwargs)
    out = served(hidden_states, grid_thw)
    fields: dict[str, Any] = {"last_hidden_state": None,
                              **getattr(served.encoder, "hf_output_fields", _pooled)(out)}
    result = _output_class(type(tower).__module__, "deepstack_features" in fields)(**fields)
    return result if return_dict is not False else result.to_tuple()


def _pooled(out: Any) -> dict[str, Any]:
    """HF output fields from an adapter's output, unless the adapter says otherwise with
    ``hf_output_fields(out)``: the merged tokens, then Qwen3-VL's deepstack features."""
    if isinstance(out, torch.Tensor):
        return {"pooler_output": out}
    return {"pooler_output": out[0], "deepstack_features": list(out[1:])}


@functools.cache
def _warn_moved(name: str, device: str, dtype: str) -> None:   # once per tower class and place
    log.warning("vitgraph: %s was moved to %s/%s after serve_vision_; it runs its own forward "
                "(call restore_vision_ and serve_vision_ again to serve it from graphs)", name,
                device, dtype)


@functools.cache
def _output_class(module: str, deepstack: bool) -> type:
    """The output class the HF tower of ``module`` returns (found in the tower's own module)."""
    if deepstack:
        found = getattr(importlib.import_module(module), "BaseModelOutputWithDeepstackFeatures",
                        None)
        if found is not None:
            return found
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling
