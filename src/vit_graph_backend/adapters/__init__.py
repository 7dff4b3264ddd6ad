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

__all__ = ["adapt", "adapter_for", "register_adapter", "supported_classes"]

# by this package's own name: a copy imported under another name serves with its own code
_QWEN = f"{__name__}.qwen_families:"

#: fully qualified model class name -> adapter factory (``"module:attribute"`` or a callable).
_REGISTRY: dict[str, str | Callable[..., Any]] = {
    "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel":
        _QWEN + "Qwen2VLVisionAdapter",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel":
        _QWEN + "Qwen2_5_VLVisionAdapter",
    "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel":
        _QWEN + "Qwen3VLVisionAdapter",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel":
        _QWEN + "Qwen3VLMoeVisionAdapter",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel":
        _QWEN + "Qwen3_5VisionAdapter",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel":
        _QWEN + "Qwen3_5MoeVisionAdapter",
}


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_adapter(model_class: type | str, factory: str | Callable[..., Any]) -> None:
    """Serve ``model_class`` with ``factory(model, options)``.

    Args:
        model_class: the class, or its fully qualified name (no import of its package).
        factory: ``factory(model, options)`` returning a ``SupportsEncoderCudaGraph``, or
            ``"module:attribute"`` naming one, imported at the first :func:`adapt`.

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
    """Return ``model`` as a ``SupportsEncoderCudaGraph`` (as is if it already is one; else
    wrapped by the adapter registered for its class, reusing its weights).

    Args:
        model: a packed vision encoder, e.g. ``Qwen2_5_VisionTransformerPretrainedModel``.
        options: a :class:`~vit_graph_backend.options.VitGraphOptions`; or give its fields as
            keyword arguments.

    Raises:
        UnsupportedModelError: (a ``TypeError``) if no adapter serves the model's class.
        InvalidOptionError: (a ``ValueError``) for an unknown or bad option.
    """
    from ..options import VitGraphOptions

    if options is None:
        options = VitGraphOptions(**fields)
    elif fields:
        raise InvalidOptionError(
            f"give options or option keywords, not both (got {sorted(fields)})")
    if supports_encoder_cudagraph(model):
        return model
    return _factory(model)(model, options)


def _factory(model: Any) -> Callable[..., Any]:
    factory = adapter_for(model)
    if factory is None:
        supported = "\n  ".join(supported_classes())
        raise UnsupportedModelError(
            f"no adapter for {_class_name(type(model))}. Supported classes:\n  {supported}\n"
            "Implement vit_graph_backend.protocol.SupportsEncoderCudaGraph on the model (its "
            "docstring has the layout contract and an example; see also docs/adapters.md), or "
            "register an adapter with vit_graph_backend.adapters.register_adapter(cls, factory)")
    return factory
