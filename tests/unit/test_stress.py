"""The stress suite's CPU part (CI): threads, NaN-poisoned static buffers, clear/recapture, every
output checked against eager; and a check that the suite does count a wrong output."""

from __future__ import annotations

import pytest
import torch

from stress.suite import (PartResult, StressConfig, _hammer,
                                                   format_stress, run_stress)

pytest.importorskip("timm")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_cpu_stress_has_no_wrong_outputs():
    rows = run_stress(StressConfig.small(calls=120))
    # "switch" (capture="background") runs here too; without CUDA nothing is prepared
    assert [r["part"] for r in rows] == ["batched", "packed", "clear", "switch"]
    for r in rows:
        assert r["calls"] == 120, r
        assert (r["wrong"], r["nan"], r["exceptions"]) == (0, 0, 0), r
    assert rows[0]["replays"] > 0                     # the batched plan/pad path ran
    assert rows[1]["eager_batches"] > 0               # items past the largest budget
    assert rows[2]["recaptures"] >= 1 and rows[3]["recaptures"] >= 1
    assert "packed" in format_stress(rows)


def test_hammer_counts_wrong_and_nan_outputs_and_exceptions():
    refs = [torch.ones(3) for _ in range(4)]

    def call(i):
        if i == 0:
            return torch.ones(3) * 2          # wrong
        if i == 1:
            return torch.full((3,), float("nan"))
        if i == 2:
            raise RuntimeError("boom")
        return torch.ones(3)

    result = PartResult("x")
    _hammer(result, StressConfig(calls=200, threads=3, device="cpu"), call, refs, None)
    assert result.calls == 200
    assert result.wrong > 0 and result.nan > 0 and len(result.exceptions) > 0
    assert result.wrong + result.nan + len(result.exceptions) < 200


def test_poison_fills_every_kind_of_static_buffer():
    """Floats get NaN, integers -1, and a block of bytes under typed views (the packed
    adapters' metadata, ``adapters/_staging.py``) all-ones bytes, which its int views read as -1
    and its float views as NaN."""
    from vit_graph_backend.adapters.staging import upload
    from vit_graph_backend.testing.poison import _fill_nan

    static = upload({"lengths": torch.tensor([3, 4], dtype=torch.int32),
                     "weights": torch.ones(2)}, torch.device("cpu"), blocks=True)
    _fill_nan(static["block"])
    assert static["lengths"].tolist() == [-1, -1] and static["weights"].isnan().all()
    for t in (torch.ones(2), torch.ones(2, dtype=torch.int64)):
        _fill_nan(t)
    assert torch.equal(t, torch.tensor([-1, -1]))
