"""Adapters: make third-party packed encoders implement ``SupportsEncoderCudaGraph``.

:func:`adapt` picks the adapter by the model's exact class (a subclass may change ``forward``, so
it is served only once registered with :func:`register_adapter`). The registry maps fully
qualified class names to ``"module:attribute"`` factories, so matching imports neither
transformers nor the adapter module; ``import vit_graph_backend.adapters`` imports no torch.

Example::

    tower = adapt(vl.model.visual, max_budget=2048)   # a SupportsEncoderCudaGraph nn.Module
    merged = tower(pixel_values, grid_thw)            # == vl.model.visual(...).pooler_output
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import InvalidOptionError, UnsupportedModelError
from ..protocol import supports_encoder_cudagraph

__all__ = ["adapt", "adapter_for", "register_adapter", "supported_classes", "unserved_reason"]

# by this package's own name: a copy imported under another name serves with its own code
_QWEN, _GLM = f"{__name__}.qwen_families:", f"{__name__}.glm_families:"
_HF = "transformers.models."

#: fully qualified model class name -> adapter factory (``"module:attribute"`` or a callable).
_REGISTRY: dict[str, str | Callable[..., Any]] = {
    _HF + "qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel":
        _QWEN + "Qwen2VLVisionAdapter",
    _HF + "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel":
        _QWEN + "Qwen2_5_VLVisionAdapter",
    _HF + "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder":
        _QWEN + "Qwen2_5OmniVisionAdapter",
    _HF + "exaone4_5.modeling_exaone4_5.Exaone4_5_VisionModel": _QWEN + "Exaone4_5_VisionAdapter",
    _HF + "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel": _QWEN + "Qwen3VLVisionAdapter",
    _HF + "cohere_compass.modeling_cohere_compass.CohereCompassVisionModel":
        _QWEN + "Qwen3VLVisionAdapter",
    _HF + "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel":
        _QWEN + "Qwen3VLMoeVisionAdapter",
    _HF + "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder":
        _QWEN + "Qwen3VLMoeVisionAdapter",
    _HF + "qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel": _QWEN + "Qwen3_5VisionAdapter",
    _HF + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel":
        _QWEN + "Qwen3_5MoeVisionAdapter",
    _HF + "qwen4_exp.modeling_qwen4_exp.Qwen4ExpVisionModel": _QWEN + "Qwen3_5MoeVisionAdapter",
    _HF + "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeVisionTransformerPretrainedModel":
        _QWEN + "Ernie4_5_VLVisionAdapter",
    _HF + "glm4v.modeling_glm4v.Glm4vVisionModel": _GLM + "Glm4vVisionAdapter",
    _HF + "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionModel": _GLM + "Glm4vVisionAdapter",
    _HF + "glm_ocr.modeling_glm_ocr.GlmOcrVisionModel": _GLM + "GlmOcrVisionAdapter",
    _HF + "glm5_next.modeling_glm5_next.Glm5NextVisionModel": _GLM + "Glm5NextVisionAdapter",
    _HF + "glm_image.modeling_glm_image.GlmImageVisionModel": _GLM + "GlmImageVisionAdapter",
}

#: towers that take ``grid_thw`` but whose math the packed graphs cannot serve as they stand
_UNSERVED = {
    _HF + "cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeVisionModel":
        "a SigLIP2-style tower (linear patch embedding, a learned position table resized per "
        "image, no rotary embedding) whose model reads per-patch last_hidden_state",
    _HF + "paddleocr_vl.modeling_paddleocr_vl.PaddleOCRVisionModel":
        "a SigLIP-style tower over 5-D raster-order patches; the merge runs in the model",
    _HF + "hunyuan_vl.modeling_hunyuan_vl.HunYuanVLVisionTransformer":
        "no rotary embedding, raster-order rows, and newline and begin/end tokens inserted per "
        "image (outputs are not one row per merged patch)",
    _HF + "kimi_k25.modeling_kimi_k25.Kimi_K25VisionModel":
        "attention spans all frames of a clip and the output averages over frames",
    _HF + "minicpmv4_6.modeling_minicpmv4_6.MiniCPMV4_6VisionModel":
        "a NaViT pixel strip with target_sizes instead of grid_thw, and a 4:1 merge inside the "
        "stack",
    _HF + "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLVisionModel":
        "in transformers 5.17 its attention spans every item of a call, so an item's output "
        "depends on its batch mates: no packing can reproduce it",
    _HF + "muse_glimmer.modeling_muse_glimmer.MuseGlimmerVisionModel":
        "raster-order rows, other module names and flipped rotary positions (not yet adapted)",
    _HF + "step3p7.modeling_step3p7.Step3p7VisionModel":
        "dense fixed-size images rather than packed grids (compile it with backend='vitgraph')",
    _HF + "video_llama_3.modeling_video_llama_3.VideoLlama3VisionModel":
        "a merge size per item (1 for images, 2 for videos), where the graphs hold one",
}


def unserved_reason(model: object) -> str | None:
    """Why the packed graphs cannot serve ``model``'s tower class, where this package knows."""
    return _UNSERVED.get(_class_name(type(model)))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_adapter(model_class: type | str, factory: str | Callable[..., Any]) -> None:
    """Serve ``model_class`` (the class, or its fully qualified name: no import of its package)
    with ``factory(model, options)``, which returns a ``SupportsEncoderCudaGraph``; or give
    ``"module:attribute"`` naming the factory, imported at the first :func:`adapt`.

    Raises:
        InvalidOptionError: if ``factory`` is a string without ``":"``.
    """
    name = model_class if isinstance(model_class, str) else _class_name(model_class)
    if isinstance(factory, str) and ":" not in factory:
        raise InvalidOptionError(
            f"factory={factory!r} is invalid: give a callable or 'module:attribute', e.g. "
            f"{_QWEN + 'Qwen2VLVisionAdapter'!r}")
    _REGISTRY[name] = factory


def supported_classes() -> tuple[str, ...]:
    """Fully qualified names of the model classes :func:`adapt` serves, sorted."""
    return tuple(sorted(_REGISTRY))


def adapter_for(model: object) -> Callable[..., Any] | None:
    """The adapter factory registered for ``type(model)``, or ``None``."""
    factory = _REGISTRY.get(_class_name(type(model)))
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory


def adapt(model: Any, options: Any = None, **fields: Any) -> Any:
    """Return ``model`` (a packed vision encoder) as a ``SupportsEncoderCudaGraph``: as is if it
    already is one, else wrapped by the adapter registered for its class, reusing its weights.
    ``options``: a :class:`~vit_graph_backend.options.VitGraphOptions`, or its fields as keywords.

    Raises:
        UnsupportedModelError: (a ``TypeError``) if no adapter serves the model's class.
        InvalidOptionError: (a ``ValueError``) for an unknown or bad option.
    """
    from ..options import VitGraphOptions

    options = VitGraphOptions.given(options, fields)
    if supports_encoder_cudagraph(model):
        return model
    factory = adapter_for(model)
    if factory is None:
        why = unserved_reason(model)
        why = f" ({why})" if why else ""
        supported = "\n  ".join(supported_classes())
        raise UnsupportedModelError(
            f"no adapter for {_class_name(type(model))}{why}. Supported classes:\n"
            f"  {supported}\n"
            "Implement vit_graph_backend.protocol.SupportsEncoderCudaGraph on the model (its "
            "docstring has the layout contract and an example; see also docs/adapters.md), or "
            "register an adapter with vit_graph_backend.adapters.register_adapter(cls, factory)")
    return factory(model, options)
