"""Random sequences of good and bad calls, each checked against eager: the rule that a bad
request costs a compiled or served encoder nothing (``tests/unit/compile/test_bad_requests.py`` on CPU,
``tests/gpu/test_bad_requests_gpu.py`` on CUDA).

A call is drawn as a *kind*: a good one (a batch of 1 to 4 images of an allowed size, some with
NaN pixels) or a bad one (a size the model refuses, the wrong channel count, a 3-D input, a
float64 input, an empty batch). Whatever the kind, the call's outcome must be eager's: where
eager raises, the encoder raises too; where eager answers, the encoder's answer equals it (NaN
where eager's is NaN). Nothing is learnt from the encoder under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from hypothesis import strategies as st

#: good calls of batched encoders: most kinds draw them
BATCHED_KINDS = ("good", "good", "good", "nan", "size", "channels", "rank", "dtype", "empty")
PACKED_KINDS = ("good", "good", "good", "nan", "rows", "patch_dim", "grid_zero", "grid_shape",
                "empty")


@dataclass
class Batched:
    """A batched encoder: how to build it and the image sizes it accepts."""

    build: Callable[[], torch.nn.Module]
    sizes: tuple[int, ...]           # allowed square sizes
    bad_size: int                    # a size it refuses
    kwargs: dict[str, Any]           # call keywords besides the pixels
    hf: bool = True                  # HF models take the pixels as pixel_values=

    def call(self, fn: Callable[..., Any], pixels: torch.Tensor) -> Any:
        return fn(pixel_values=pixels, **self.kwargs) if self.hf else fn(pixels)


def hf_vit(interpolate: bool) -> Batched:
    def build():
        from transformers import ViTConfig, ViTModel

        torch.manual_seed(0)
        return ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=32, patch_size=8)).eval()
    kwargs = {"interpolate_pos_encoding": True} if interpolate else {}
    return Batched(build, (32, 48) if interpolate else (32,), 20 if interpolate else 48, kwargs)


def hf_clip() -> Batched:
    def build():
        from transformers import CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(0)
        return CLIPVisionModel(CLIPVisionConfig(hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                image_size=32, patch_size=8)).eval()
    return Batched(build, (32,), 48, {})


def hf_siglip() -> Batched:
    def build():
        from transformers import SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        return SiglipVisionModel(SiglipVisionConfig(hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    image_size=32, patch_size=8)).eval()
    return Batched(build, (32,), 48, {})


def timm_vit() -> Batched:
    def build():
        import timm

        torch.manual_seed(0)
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                 patch_size=8, embed_dim=32, depth=2, num_heads=2).eval()
    return Batched(build, (32,), 48, {}, hf=False)


def batched_call(data: st.DataObject, spec: Batched, device: str, dtype: torch.dtype
                 ) -> tuple[str, torch.Tensor]:
    """One drawn call: its kind and its pixels."""
    kind = data.draw(st.sampled_from(BATCHED_KINDS), label="kind")
    batch = data.draw(st.integers(1, 4), label="batch")
    size = data.draw(st.sampled_from(spec.sizes), label="size")
    shape = {"size": (batch, 3, spec.bad_size, spec.bad_size), "channels": (batch, 1, size, size),
             "rank": (3, size, size), "empty": (0, 3, size, size)}.get(kind,
                                                                       (batch, 3, size, size))
    pixels = torch.randn(shape, device=device,
                         dtype=torch.float64 if kind == "dtype" else dtype)
    if kind == "nan":
        pixels[0, 0, 0, 0] = float("nan")
    return kind, pixels


def packed_call(data: st.DataObject, patch_dim: int, device: str, dtype: torch.dtype
                ) -> tuple[str, torch.Tensor, Any]:
    """One drawn call of a packed tower (merge 2): its kind, pixels and grid."""
    kind = data.draw(st.sampled_from(PACKED_KINDS), label="kind")
    sides = st.integers(1, 4).map(lambda n: 2 * n)
    grids = data.draw(st.lists(st.tuples(st.just(1), sides, sides), min_size=1, max_size=3),
                      label="grids")
    grids = [list(g) for g in grids]
    if kind == "empty":
        grids = []
    if kind == "grid_zero":
        grids[0][1] = 0
    rows = sum(t * h * w for t, h, w in grids)
    if kind == "rows":
        rows += 4
    dim = patch_dim + 1 if kind == "patch_dim" else patch_dim
    pixels = torch.randn(rows, dim, device=device, dtype=dtype)
    if kind == "nan" and rows:
        pixels[0, 0] = float("nan")
    grid: Any = torch.tensor(grids, dtype=torch.long, device=device).reshape(-1, 3)
    if kind == "grid_shape":
        grid = grid[:, :2]
    return kind, pixels, grid


def packed_items(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor
                 ) -> torch.Tensor:
    """A packed tower's merged output (``pooler_output``), each item run alone, concatenated."""
    outs, row = [], 0
    for item in grid:
        rows = int(item.prod())
        outs.append(tower(pixels[row:row + rows], item[None]).pooler_output)
        row += rows
    return torch.cat(outs)


def outcome(fn: Callable[[], Any]) -> tuple[BaseException | None, Any]:
    """``fn()``'s exception or its output."""
    try:
        return None, fn()
    except Exception as exc:  # noqa: BLE001 - any error of the model's is an outcome to match
        return exc, None


def assert_same_outcome(kind: str, expected: tuple[BaseException | None, Any],
                        got: tuple[BaseException | None, Any], atol: float, rtol: float) -> None:
    """The encoder did what eager did: raised where eager raised, else gave eager's tensors."""
    (eager_error, eager_out), (error, out) = expected, got
    if eager_error is not None:
        assert error is not None, f"{kind} call: eager raised {eager_error!r}, the encoder did not"
        return
    assert error is None, f"{kind} call: eager answered, the encoder raised {error!r}"
    expected_tensors, tensors = tensors_of(eager_out), tensors_of(out)
    assert len(tensors) == len(expected_tensors), kind
    for a, e in zip(tensors, expected_tensors):
        assert a.shape == e.shape, f"{kind} call: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a.float(), e.float(), atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m: f"{kind} call differs from eager: {m}")


def tensors_of(out: Any) -> list[torch.Tensor]:
    """The tensors of an encoder output: a tensor, a tuple, or an HF output's tensor fields."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    found: list[torch.Tensor] = []
    for item in out:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(tensors_of(item))
    return found
