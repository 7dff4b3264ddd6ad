"""``data_parallel``: two processes on the ``gloo`` backend give the outputs of one process.

The test spawns two ranks. Each builds the same seeded models, wraps them with
``data_parallel`` and compares every call with the unwrapped encoder run whole in its own process:
a packed tiny Qwen2.5-VL tower served with ``serve`` (calls of 5, 3 and 1 items: the last one has
fewer items than ranks and runs whole on each rank) and a timm ViT compiled with the ``vitgraph``
backend (batches of 5, 8 and 1 rows). Each rank also reports how many items it encoded, which must
be fewer than the call's when the call was split.
"""

from __future__ import annotations

import pytest
import torch

from distributed_ranks import join, leave, run_ranks  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("timm")

WORLD = 2
GRIDS = [[[1, 4, 4], [1, 2, 4], [1, 4, 8], [1, 2, 2], [2, 2, 4]],
         [[1, 8, 8], [1, 2, 4], [1, 4, 4]],
         [[1, 4, 4]]]
BATCHES = [5, 8, 1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import timm
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    import vit_graph_backend as vg

    join(rank, world, port)
    result: dict = {"packed": [], "batched": []}
    try:
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
            depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=24,
            patch_size=2, window_size=8, fullatt_block_indexes=[1])).eval()
        served = vg.serve(tower, min_budget=4, max_budget=48)
        parallel = vg.data_parallel(served)
        for k, grid in enumerate(GRIDS):
            g = torch.Generator().manual_seed(k)
            rows = sum(t * h * w for t, h, w in grid)
            pixels = torch.randn(rows, 24, generator=g)
            with torch.no_grad():
                before = served.report()["stats"]["no_graph_items"]
                got = parallel(pixels, grid)
                mine = served.report()["stats"]["no_graph_items"] - before
                ref = served(pixels, grid)
            result["packed"].append({"items": len(grid), "encoded_here": mine,
                                     "shape": list(got.shape), "ref_shape": list(ref.shape),
                                     "err": (got - ref).abs().max().item()})
        torch.manual_seed(0)
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                  patch_size=8, depth=2, num_classes=10).eval()
        compiled = vg.data_parallel(torch.compile(model, backend="vitgraph"))
        for b in BATCHES:
            x = torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(b))
            with torch.no_grad():
                got, ref = compiled(x), model(x)
            result["batched"].append({"rows": b, "shape": list(got.shape),
                                      "err": (got - ref).abs().max().item()})
    finally:
        leave(rank, out_dir, result)


def test_two_gloo_ranks_give_the_outputs_of_one_process(tmp_path):
    ranks = run_ranks(_worker, WORLD, tmp_path)
    for rank in ranks:
        assert len(rank["packed"]) == len(GRIDS) and len(rank["batched"]) == len(BATCHES)
        for call in rank["packed"]:
            assert call["shape"] == call["ref_shape"] and call["err"] < 1e-5, call
        for call in rank["batched"]:
            assert call["shape"][0] == call["rows"] and call["err"] < 1e-4, call
    for k, grid in enumerate(GRIDS):
        encoded = [rank["packed"][k]["encoded_here"] for rank in ranks]
        if len(grid) >= WORLD:   # split: each rank encoded a share, together every item
            assert all(0 < n < len(grid) for n in encoded) and sum(encoded) == len(grid)
        else:                    # too few items: every rank encoded the whole call
            assert encoded == [len(grid)] * WORLD
