"""The model registry of ``vitgraph bench``: vision encoders built from a config, random weights.

Nothing is downloaded: every entry builds its model from a config, seeded, so runs are
reproducible offline; an entry whose library or class is missing is listed as unavailable with
the reason. Heavy imports happen inside the builders.

- ``batched``: ``forward(pixel_values [B, C, H, W])`` (timm ViTs; HF CLIP/SigLIP/DINOv2, wrapped
  to return ``last_hidden_state``).
- ``packed``: HF Qwen-VL vision towers, ``forward(pixel_values, grid_thw)``; the vitgraph modes
  serve them through ``serve(tower, ...)`` (:mod:`.modes`).

``*-tiny`` entries and ``vit-micro`` run in milliseconds on a CPU (CI, the CPU default);
full-size entries carry the shapes of real checkpoints.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..budgets import ceil_div
from ..specs import EncoderItemSpec
from .workloads import Call, SizeSpace

__all__ = ["MODELS", "BuiltModel", "ModelEntry", "availability", "build_model", "call_specs",
           "primary_output", "torchvision_problem"]


@dataclass(frozen=True)
class ModelEntry:
    """One registry entry.

    Attributes:
        name: the ``--model`` name.
        family: library and architecture, e.g. ``"timm ViT"``.
        layout: ``"batched"`` or ``"packed"``.
        description: one line for ``vitgraph bench --list``.
        builder: ``builder(dynamic_size) -> nn.Module`` on CPU in fp32, random weights.
        space: sizes the model takes (see :class:`~.workloads.SizeSpace`).
        patch: patch side in pixels.
        merge: spatial merge factor (packed models), 1 otherwise.
        temporal_patch: frames per temporal patch (packed models), 1 otherwise.
        requires: importable names the entry needs, plus ``"module:Class"`` checks.
    """

    name: str
    family: str
    layout: str
    description: str
    builder: Callable[[bool], Any]
    space: SizeSpace
    patch: int
    merge: int = 1
    temporal_patch: int = 1
    in_channels: int = 3
    requires: tuple[str, ...] = field(default=())

    @property
    def packed(self) -> bool:
        """True for a packed (Qwen-VL style) model."""
        return self.layout == "packed"


def availability(entry: ModelEntry) -> str | None:
    """``None`` if ``entry`` can be built here, else the reason it cannot."""
    for need in entry.requires:
        module, _, attr = need.partition(":")
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            if top == "timm":  # torchvision, which timm needs, pins torch: the README's Set-up
                return ("timm is not installed (it needs torchvision, which pins one torch: "
                        "install it holding yours, as the README's Set-up shows)")
            return f"{top} is not installed (pip install 'vit-graph-backend[bench]')"
        broken = torchvision_problem()
        if top == "timm" and broken is not None:
            return f"timm cannot run here: {broken}"
        if attr:
            try:
                found = hasattr(importlib.import_module(module), attr)
            except ImportError as exc:
                return f"cannot import {module}: {exc}"
            if not found:
                return f"{module}.{attr} is missing in this version"
    return None


@functools.cache
def torchvision_problem() -> str | None:
    """Why the installed torchvision cannot be imported beside this torch, or ``None``.

    A torchvision built for another torch fails at import, and transformers, taking it for
    importable, then fails to import its models. A broken one is set aside for this process
    (``sys.modules["torchvision"] = None``) so the transformers models still run; only the
    ``vitgraph bench`` process does this, never the library.
    """
    import sys

    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # noqa: BLE001 - any failure: an ImportError, a missing operator
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        import torch

        first = str(exc).splitlines()[0] if str(exc) else ""
        return (f"torchvision does not import beside torch {torch.__version__} "
                f"({type(exc).__name__}: {first}); install the torchvision built for your torch "
                "(README, Set-up)")
    return None


def _timm(name: str, **overrides: Any) -> Callable[[bool], Any]:
    def build(dynamic_size: bool) -> Any:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=0,
                                 dynamic_img_size=dynamic_size, **overrides)
    return build


@functools.cache
def _last_hidden_state_class() -> type:
    """An ``nn.Module`` returning an HF model's ``last_hidden_state`` (built lazily: no torch)."""
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, call_kwargs: dict[str, Any]) -> None:
            super().__init__()
            self.model = model
            self.call_kwargs = call_kwargs

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=pixel_values, **self.call_kwargs).last_hidden_state

    return LastHiddenState


def _hf(module: str, model_cls: str, config_cls: str, *, interpolate: bool,
        **config: Any) -> Callable[[bool], Any]:
    def build(dynamic_size: bool) -> Any:
        mod = importlib.import_module(module)
        cfg = getattr(mod, config_cls)(**config)
        model = getattr(mod, model_cls)._from_config(cfg)
        kwargs = {"interpolate_pos_encoding": True} if interpolate and dynamic_size else {}
        return _last_hidden_state_class()(model, kwargs)
    return build


def _qwen(module: str, model_cls: str, config_cls: str, **config: Any) -> Callable[[bool], Any]:
    def build(dynamic_size: bool) -> Any:
        mod = importlib.import_module(module)
        return getattr(mod, model_cls)._from_config(getattr(mod, config_cls)(**config))
    return build


def _space(base: int, sizes: tuple[int, ...], packed: bool = False,
           frames: tuple[int, ...] = ()) -> SizeSpace:
    return SizeSpace(base, sizes, one_size_per_call=not packed, video_frames=frames)


_TIMM = ("timm",)
_SMALL = (64, 96, 128)
_P16 = (224, 256, 288, 320)
_P14 = (224, 252, 280, 336)
_Q2 = "transformers.models.qwen2_vl.modeling_qwen2_vl"
_Q25 = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
_Q3 = "transformers.models.qwen3_vl.modeling_qwen3_vl"
_CLIP = ("transformers.models.clip.modeling_clip", "CLIPVisionModel", "CLIPVisionConfig")
_SIGLIP = ("transformers.models.siglip.modeling_siglip", "SiglipVisionModel", "SiglipVisionConfig")
_DINO = ("transformers.models.dinov2.modeling_dinov2", "Dinov2Model", "Dinov2Config")
_TINY_W = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 2}


def _entries() -> list[ModelEntry]:
    hf = "transformers"
    return [
        ModelEntry("vit-micro", "timm ViT", "batched",
                   "timm VisionTransformer, 2 blocks of width 64, 64 px (the CPU default)",
                   _timm("vit_tiny_patch16_224", img_size=64, embed_dim=64, depth=2,
                         num_heads=2, mlp_ratio=2.0),
                   _space(64, _SMALL), 16, requires=_TIMM),
        ModelEntry("vit-tiny", "timm ViT", "batched", "timm vit_tiny_patch16_224 (5.7 M)",
                   _timm("vit_tiny_patch16_224"), _space(224, _P16), 16, requires=_TIMM),
        ModelEntry("vit-s16", "timm ViT", "batched", "timm vit_small_patch16_224 (22 M)",
                   _timm("vit_small_patch16_224"), _space(224, _P16), 16, requires=_TIMM),
        ModelEntry("vit-b16", "timm ViT", "batched",
                   "timm vit_base_patch16_224 (86 M; the CUDA default)",
                   _timm("vit_base_patch16_224"), _space(224, _P16), 16, requires=_TIMM),
        ModelEntry("vit-l16", "timm ViT", "batched", "timm vit_large_patch16_224 (304 M)",
                   _timm("vit_large_patch16_224"), _space(224, _P16), 16, requires=_TIMM),
        ModelEntry("clip-tiny", "HF CLIP vision", "batched", "CLIPVisionModel, 2 layers, width 64",
                   _hf(*_CLIP, interpolate=True, image_size=64, patch_size=16, **_TINY_W),
                   _space(64, _SMALL), 16, requires=(f"{hf}:CLIPVisionModel",)),
        ModelEntry("clip-b16", "HF CLIP vision", "batched", "CLIPVisionModel ViT-B/16 shape",
                   _hf(*_CLIP, interpolate=True, image_size=224, patch_size=16),
                   _space(224, _P16), 16, requires=(f"{hf}:CLIPVisionModel",)),
        ModelEntry("clip-l14-336", "HF CLIP vision", "batched",
                   "CLIPVisionModel ViT-L/14 at 336 px (304 M; GPU-bound from batch 8)",
                   _hf(*_CLIP, interpolate=True, image_size=336, patch_size=14, hidden_size=1024,
                       intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                   _space(336, (224, 280, 336)), 14, requires=(f"{hf}:CLIPVisionModel",)),
        ModelEntry("siglip-tiny", "HF SigLIP vision", "batched",
                   "SiglipVisionModel, 2 layers, width 64",
                   _hf(*_SIGLIP, interpolate=True, image_size=64, patch_size=16, **_TINY_W),
                   _space(64, _SMALL), 16, requires=(f"{hf}:SiglipVisionModel",)),
        ModelEntry("siglip-b16", "HF SigLIP vision", "batched", "SiglipVisionModel B/16 shape",
                   _hf(*_SIGLIP, interpolate=True, image_size=224, patch_size=16),
                   _space(224, _P16), 16, requires=(f"{hf}:SiglipVisionModel",)),
        ModelEntry("dinov2-tiny", "HF DINOv2", "batched", "Dinov2Model, 2 layers, width 64",
                   _hf(*_DINO, interpolate=False, image_size=56, patch_size=14, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=2),
                   _space(56, (56, 84, 112)), 14, requires=(f"{hf}:Dinov2Model",)),
        ModelEntry("dinov2-s14", "HF DINOv2", "batched", "Dinov2Model ViT-S/14 shape (22 M)",
                   _hf(*_DINO, interpolate=False, image_size=224, patch_size=14, hidden_size=384,
                       num_hidden_layers=12, num_attention_heads=6),
                   _space(224, _P14), 14, requires=(f"{hf}:Dinov2Model",)),
        ModelEntry("dinov2-b14", "HF DINOv2", "batched", "Dinov2Model ViT-B/14 shape (86 M)",
                   _hf(*_DINO, interpolate=False, image_size=224, patch_size=14),
                   _space(224, _P14), 14, requires=(f"{hf}:Dinov2Model",)),
        # Packed towers. Full-size shapes: Qwen2-VL-2B, Qwen2.5-VL-3B, Qwen3-VL-4B vision configs.
        ModelEntry("qwen2-vl-tiny", "HF Qwen2-VL vision", "packed", "2 blocks, width 64",
                   _qwen(_Q2, "Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig",
                         depth=2, embed_dim=64, hidden_size=96, num_heads=2),
                   _space(112, tuple(range(56, 169, 28)), True, (2, 4)), 14, 2, 2,
                   requires=(f"{_Q2}:Qwen2VisionTransformerPretrainedModel",)),
        ModelEntry("qwen2-vl", "HF Qwen2-VL vision", "packed", "Qwen2-VL-2B vision tower shape",
                   _qwen(_Q2, "Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig",
                         depth=32, embed_dim=1280, hidden_size=1536, num_heads=16),
                   _space(448, tuple(range(224, 897, 28)), True, (4, 8, 16)), 14, 2, 2,
                   requires=(f"{_Q2}:Qwen2VisionTransformerPretrainedModel",)),
        ModelEntry("qwen2.5-vl-tiny", "HF Qwen2.5-VL vision", "packed", "2 blocks, width 64",
                   _qwen(_Q25, "Qwen2_5_VisionTransformerPretrainedModel",
                         "Qwen2_5_VLVisionConfig", depth=2, hidden_size=64,
                         intermediate_size=128, num_heads=2, out_hidden_size=96,
                         fullatt_block_indexes=[1]),
                   _space(112, tuple(range(56, 169, 28)), True, (2, 4)), 14, 2, 2,
                   requires=(f"{_Q25}:Qwen2_5_VisionTransformerPretrainedModel",)),
        ModelEntry("qwen2.5-vl", "HF Qwen2.5-VL vision", "packed",
                   "Qwen2.5-VL-3B vision tower shape",
                   _qwen(_Q25, "Qwen2_5_VisionTransformerPretrainedModel",
                         "Qwen2_5_VLVisionConfig", depth=32, hidden_size=1280,
                         intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                         fullatt_block_indexes=[7, 15, 23, 31]),
                   _space(448, tuple(range(224, 897, 28)), True, (4, 8, 16)), 14, 2, 2,
                   requires=(f"{_Q25}:Qwen2_5_VisionTransformerPretrainedModel",)),
        ModelEntry("qwen3-vl-tiny", "HF Qwen3-VL vision", "packed", "2 blocks, width 64",
                   _qwen(_Q3, "Qwen3VLVisionModel", "Qwen3VLVisionConfig", depth=2,
                         hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=96,
                         deepstack_visual_indexes=[0], num_position_embeddings=256),
                   _space(128, tuple(range(64, 193, 32)), True, (2, 4)), 16, 2, 2,
                   requires=(f"{_Q3}:Qwen3VLVisionModel",)),
        ModelEntry("qwen3-vl", "HF Qwen3-VL vision", "packed", "Qwen3-VL-4B vision tower shape",
                   _qwen(_Q3, "Qwen3VLVisionModel", "Qwen3VLVisionConfig", depth=24,
                         hidden_size=1024, intermediate_size=4096, num_heads=16,
                         out_hidden_size=2560, deepstack_visual_indexes=[5, 11, 17],
                         num_position_embeddings=2304),
                   _space(448, tuple(range(224, 897, 32)), True, (4, 8, 16)), 16, 2, 2,
                   requires=(f"{_Q3}:Qwen3VLVisionModel",)),
        # the 8B model's tower; sizes up to ~1300 px, where single images are GPU-bound
        ModelEntry("qwen3-vl-8b", "HF Qwen3-VL vision", "packed", "Qwen3-VL-8B vision tower shape",
                   _qwen(_Q3, "Qwen3VLVisionModel", "Qwen3VLVisionConfig", depth=27,
                         hidden_size=1152, intermediate_size=4304, num_heads=16,
                         out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24],
                         num_position_embeddings=2304),
                   _space(448, tuple(range(224, 1313, 32)), True, (4, 8, 16)), 16, 2, 2,
                   requires=(f"{_Q3}:Qwen3VLVisionModel",)),
    ]


MODELS: dict[str, ModelEntry] = {entry.name: entry for entry in _entries()}


def _grids(entry: ModelEntry, call: Call) -> list[tuple[int, int, int]]:
    """The ``(t, h, w)`` patch grid of each item of ``call``."""
    return [(ceil_div(i.frames, entry.temporal_patch) if i.frames > 1 else 1,
             i.height // entry.patch, i.width // entry.patch) for i in call.items]


def call_specs(entry: ModelEntry, call: Call) -> list[EncoderItemSpec]:
    """The items of ``call`` as the vitgraph planner sees them on ``entry``.

    Batched: one row item of ``B`` rows. Packed: one item per image or video (``t*h*w`` patches
    in, ``t*(h/merge)*(w/merge)`` tokens out, ``t`` frames).
    """
    if not entry.packed:
        rows = len(call.items)
        return [EncoderItemSpec(rows, rows)]
    m = entry.merge
    return [EncoderItemSpec(t * h * w, t * (h // m) * (w // m), t)
            for t, h, w in _grids(entry, call)]


@dataclass
class BuiltModel:
    """A registry model built on a device, with its input and spec conversions."""

    entry: ModelEntry
    module: Any  # torch.nn.Module, eval mode, on device and dtype
    device: Any
    dtype: Any

    @property
    def num_params(self) -> int:
        """Parameter count."""
        return sum(p.numel() for p in self.module.parameters())

    def inputs(self, call: Call, generator: Any) -> tuple[Any, ...]:
        """Random input tensors for ``call`` on the model's device (drawn on CPU, seeded)."""
        import torch

        entry = self.entry
        if not entry.packed:
            first = call.items[0]
            x = torch.randn(len(call.items), entry.in_channels, first.height, first.width,
                            generator=generator)
            return (x.to(self.device, self.dtype),)
        grids = _grids(entry, call)
        rows = sum(t * h * w for t, h, w in grids)
        dim = entry.in_channels * entry.temporal_patch * entry.patch * entry.patch
        x = torch.randn(rows, dim, generator=generator).to(self.device, self.dtype)
        grid_thw = torch.tensor(grids, dtype=torch.int64, device=self.device)
        return x, grid_thw


def build_model(entry: ModelEntry, *, device: Any, dtype: Any, dynamic_size: bool,
                seed: int = 0) -> BuiltModel:
    """Build ``entry`` with random weights seeded by ``seed``, in eval mode, on ``device`` in
    ``dtype``; ``dynamic_size``: the stream has several image sizes.

    Raises:
        RuntimeError: if the entry is unavailable here (the message gives the reason).
    """
    import torch

    reason = availability(entry)
    if reason is not None:
        raise RuntimeError(f"model {entry.name!r} is unavailable: {reason}")
    torch.manual_seed(seed)
    module = entry.builder(dynamic_size).eval().to(device=device, dtype=dtype)
    module.requires_grad_(False)
    return BuiltModel(entry, module, torch.device(device), dtype)


def primary_output(out: Any) -> Any:
    """The tensor to compare between modes: a tensor itself, an HF output's ``pooler_output``
    (the merged tokens of Qwen-VL towers) or ``last_hidden_state``, or a tuple's first tensor."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    for name in ("pooler_output", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out:
        return primary_output(out[0])
    raise TypeError(f"cannot find an output tensor in {type(out).__name__}")
