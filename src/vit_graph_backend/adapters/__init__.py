"""Adapters: make third-party packed encoders implement ``SupportsEncoderCudaGraph``.

:func:`adapt` picks the adapter for a model by its class. The registry maps *fully qualified class
names* to adapter factories given as ``"module:attribute"`` strings, so matching a model never
imports transformers (or any other third-party package) and the adapter module is imported only
when a model of its class is adapted. ``import vit_graph_backend.adapters`` imports neither torch
nor transformers.

Matching is by exact class: a subclass may change ``forward``, so it is served only once
registered (:func:`register_adapter`), which is also how new adapters plug in.

Example::

    from transformers import Qwen2_5_VLForConditionalGeneration
    from vit_graph_backend.adapters import adapt

    vl = Qwen2_5_VLForConditionalGeneration.from_pretrained(...).eval()
    tower = adapt(vl.model.visual, max_budget=2048)   # a SupportsEncoderCudaGraph nn.Module
    merged = tower(pixel_values, grid_thw)            # == vl.model.visual(...).pooler_output
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ..errors import InvalidOptionError, UnsupportedModelError
from ..protocol import supports_encoder_cudagraph

__all__ = ["adapt", "adapter_for", "adapter_keywords", "register_adapter", "supported_classes"]

# by this package's own name: a copy imported under another name (a vendored build, the
# benchmarks' baseline tree in benchmarks/host_time_two_trees_probe.py) serves with its own code
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
    """Serve ``model_class`` with ``factory(model, **kwargs)``.

    Args:
        model_class: the class, or its fully qualified name (``"pkg.module.Class"``), which
            avoids importing the model's package.
        factory: a callable returning a ``SupportsEncoderCudaGraph`` (usually an adapter class),
            or ``"module:attribute"`` naming one, imported at the first :func:`adapt`.

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


def adapt(model: Any, **kwargs: Any) -> Any:
    """Return ``model`` as a ``SupportsEncoderCudaGraph``.

    A model that already implements the protocol is returned as is. Otherwise the adapter
    registered for its class wraps it, reusing its weights.

    Args:
        model: a packed vision encoder, e.g. ``Qwen2_5_VisionTransformerPretrainedModel``.
        **kwargs: adapter options (:func:`adapter_keywords` lists them); the Qwen adapters
            take ``min_budget`` and ``max_budget`` (output tokens of the smallest and largest
            graph), ``align_mlp`` (padded MLP weight copies) and ``fuse`` (fused elementwise
            kernels in the graphs); see ``qwen_vl._QwenVisionAdapter``.

    Raises:
        UnsupportedModelError: (a ``TypeError``) if no adapter serves the model's class; the
            message lists the supported classes.
        InvalidOptionError: (a ``ValueError``) for options the adapter rejects.
    """
    if supports_encoder_cudagraph(model):
        if kwargs:
            raise InvalidOptionError(
                f"{type(model).__name__} implements SupportsEncoderCudaGraph itself; adapter "
                f"options {sorted(kwargs)} do not apply to it")
        return model
    factory = _factory(model)
    _check_options(factory, kwargs)
    return factory(model, **kwargs)


def adapter_keywords(model: Any) -> tuple[str, ...] | None:
    """The keyword arguments ``adapt(model, ...)`` accepts, sorted.

    Returns ``()`` for a model that implements the protocol itself (it takes none), and ``None``
    when the adapter takes ``**kwargs`` or has no signature to read (it accepts any name).
    ``serve()`` uses this to tell adapter arguments from options.

    Raises:
        UnsupportedModelError: (a ``TypeError``) if no adapter serves the model's class.
    """
    if supports_encoder_cudagraph(model):
        return ()
    return _keywords(_factory(model))


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


def _keywords(factory: Callable[..., Any]) -> tuple[str, ...] | None:
    """Names ``factory`` takes after the model; ``None`` if it takes any (``**kwargs``)."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no signature to read: let the factory decide
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple(sorted(p.name for p in params[1:] if p.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)))


def _check_options(factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Reject keyword options ``factory`` does not take, naming the ones it does."""
    known = _keywords(factory)
    if known is None:
        return
    valid = list(known)
    for key in sorted(kwargs):
        if key not in valid:
            hint = difflib.get_close_matches(key, valid, n=1)
            name = getattr(factory, "__name__", repr(factory))
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise InvalidOptionError(
                f"{key}={kwargs[key]!r} is not an option of {name}{suggestion}; valid options: "
                f"{valid}")
