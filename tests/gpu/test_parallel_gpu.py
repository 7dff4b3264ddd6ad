"""``data_parallel`` on CUDA, two ways: two ranks sharing one GPU over ``gloo`` (NCCL refuses two
ranks on one device), and two GPUs over ``nccl``, one per rank (skipped with fewer than two
GPUs). Each rank replays its own CUDA graphs for its share, the padded ``all_gather`` moves CUDA
tensors, and every rank gets the one-process output back.

A packed Qwen2.5-VL tower in bf16 (calls of 6, 4 and 1 images) and a timm ViT compiled with the
``vitgraph`` backend (batches of 9, 16 and 1). The reference is the same served encoder run whole
in the same process; a rank's share replays other budgets than the whole call, so the comparison
is within bf16 tolerance, measured and printed.
"""

from __future__ import annotations

import random

import pytest
import torch

from distributed_ranks import join, leave, run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
pytest.importorskip("timm")

WORLD = 2
CALLS = [6, 4, 1]
BATCHES = [9, 16, 1]


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The packed tower and the batched ViT, seeded alike on every rank, bf16 on the GPU."""
    import timm
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=64, intermediate_size=122, num_heads=2, out_hidden_size=96,
        window_size=112, fullatt_block_indexes=[1, 3]))
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=2,
                            num_classes=10)
    return (tower.to("cuda", torch.bfloat16).eval(), vit.to("cuda", torch.bfloat16).eval())


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _run_rank(rank, world, port, out_dir, "gloo")


def _worker_nccl(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)  # "cuda" below is this rank's own GPU
    _run_rank(rank, world, port, out_dir, "nccl")


def _run_rank(rank: int, world: int, port: int, out_dir: str, backend: str) -> None:
    import vit_graph_backend as vg

    join(rank, world, port, backend)
    result: dict = {"packed": [], "batched": []}
    try:
        tower, model = _models()
        served = vg.serve(tower, max_items_per_graph=4, max_budget=1024)
        parallel = vg.data_parallel(served, record_busy=True)
        rng = random.Random(0)
        for n in CALLS:
            grid = [[1, 2 * rng.randint(4, 16), 2 * rng.randint(4, 16)] for _ in range(n)]
            rows = sum(t * h * w for t, h, w in grid)
            g = torch.Generator().manual_seed(n)
            pixels = torch.randn(rows, 3 * 2 * 14 * 14, generator=g).to("cuda", torch.bfloat16)
            grid_t = torch.tensor(grid, device="cuda")
            with torch.no_grad():
                got = parallel(pixels, grid_t)
                ref = served(pixels, grid_t)
            scale = max(ref.float().abs().max().item(), 1.0)
            result["device_index"] = torch.cuda.current_device()
            result["packed"].append({"items": n, "shape": list(got.shape),
                                     "ref_shape": list(ref.shape), "device": str(got.device),
                                     "rel_err": (got.float() - ref.float()).abs().max().item()
                                     / scale})
        stats = served.report()["stats"]
        result["replays"], result["eager_items"] = stats["graph_replays"], stats["eager_items"]
        result["busy_s"] = parallel.busy_seconds()
        compiled = vg.data_parallel(torch.compile(model, backend="vitgraph"))
        for b in BATCHES:
            g = torch.Generator().manual_seed(b)
            x = torch.randn(b, 3, 64, 64, generator=g).to("cuda", torch.bfloat16)
            with torch.no_grad():
                got, ref = compiled(x), model(x)
            scale = max(ref.float().abs().max().item(), 1.0)
            result["batched"].append({"rows": b, "shape": list(got.shape),
                                      "rel_err": (got.float() - ref.float()).abs().max().item()
                                      / scale})
    finally:
        leave(rank, out_dir, result)


def test_two_ranks_on_cuda_give_the_one_process_outputs(tmp_path):
    _check(run_ranks(_worker, WORLD, tmp_path), "2 gloo ranks, one GPU")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
def test_two_gpus_on_nccl_give_the_one_process_outputs(tmp_path):
    ranks = run_ranks(_worker_nccl, WORLD, tmp_path)
    assert [rank["device_index"] for rank in ranks] == [0, 1]
    _check(ranks, "2 nccl ranks, one GPU each")


def _check(ranks: list[dict], how: str) -> None:
    worst = 0.0
    for r, rank in enumerate(ranks):
        assert len(rank["packed"]) == len(CALLS) and len(rank["batched"]) == len(BATCHES), rank
        for call in rank["packed"]:
            assert call["shape"] == call["ref_shape"] and call["device"].startswith("cuda")
            worst = max(worst, call["rel_err"])
        for call in rank["batched"]:
            assert call["shape"][0] == call["rows"]
            worst = max(worst, call["rel_err"])
        assert rank["replays"] > 0 and rank["eager_items"] == 0, rank
        assert rank["busy_s"] > 0
        print(f"data_parallel on CUDA, rank {r}: {rank['replays']} graph replays, busy "
              f"{rank['busy_s'] * 1e3:.1f} ms")
    print(f"data_parallel on CUDA ({how}, bf16): max relative error vs one process "
          f"{worst:.3g}")
    assert worst < 3e-2
