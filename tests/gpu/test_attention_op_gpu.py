"""``attention_kernel="timed"`` on CUDA: the op ``vitgraph::attention`` (``attention_op.py``) in
every Triton config it times and through SDPA, against a float32 reference at the batched ViTs'
attention shapes (tokens not a multiple of a block, heads of 72, one image, timm's packed
projection), the per-shape choice (timed outside captures, never inside one), the op inside a
captured CUDA graph replayed on new data, threads meeting new shapes together, and HF CLIP
through ``torch.compile(backend="vitgraph")`` against eager with the rewrite on and off. Hopper or
newer (the kernel loads through the tensor memory accelerator)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from linear_act_operands import _clip, _compiled_matches_eager

from vit_graph_backend import attention_op
from vit_graph_backend.attention_op import CHOICES, TRITON_CONFIGS, _describe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(attention_op.attention_unavailable(
                  torch.device("cuda")) is not None if torch.cuda.is_available() else False,
                  reason="the Triton kernel needs a Hopper or newer GPU with Triton")]

DEV, DT = "cuda", torch.bfloat16
OP = torch.ops.vitgraph.attention.default


def _qkv(batch, heads, tokens, head, seed=0, packed=False):
    """q, k, v as ``[B, heads, tokens, head]`` views of ``[B, tokens, heads, head]`` memory
    (HF's separate projections), or of one ``[B, tokens, 3, heads, head]`` buffer (timm's)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if packed:
        qkv = torch.randn(batch, tokens, 3, heads, head, device=DEV, dtype=DT, generator=gen)
        return tuple(qkv.permute(2, 0, 3, 1, 4).unbind(0))
    return tuple(torch.randn(batch, tokens, heads, head, device=DEV, dtype=DT,
                             generator=gen).transpose(1, 2) for _ in range(3))


def _close(out, q, k, v, scale=None):
    """Within bf16's rounding of the result against float32 SDPA: the kernel rounds the
    attention weights to bf16 before their product with v, as flash attention does."""
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
    err = (out.float() - ref).abs()
    bound = 2.0 ** -7 * ref.abs() + 1e-2
    assert (err <= bound).all(), f"max error {err.max().item():.3e}"
    assert out.shape == ref.shape and out.transpose(1, 2).is_contiguous()


def _replays_right(graph, captured, static, seeds):
    """``graph`` replayed on new q, k and v written into its ``static`` ones gives ``captured``
    right each time."""
    for seed in seeds:
        batch, heads, tokens, head = static[0].shape
        for into, fresh in zip(static, _qkv(batch, heads, tokens, head, seed=seed), strict=True):
            into.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        _close(captured, *static)


SHAPES = {"clip-l14-336": (3, 16, 577, 64), "siglip-so400m-384": (2, 16, 729, 72),
          "vit-b16": (5, 12, 197, 64), "one image of 50 tokens": (1, 4, 50, 64),
          "timm packed projection": (4, 6, 197, 64)}


@pytest.mark.parametrize("config", [*TRITON_CONFIGS, "sdpa"])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_kernel_matches_fp32_reference(shape, config):
    batch, heads, tokens, head = SHAPES[shape]
    q, k, v = _qkv(batch, heads, tokens, head, seed=len(shape), packed="timm" in shape)
    assert CHOICES._servable(q, k, v)
    CHOICES._segments(q)   # as the timing makes them, outside captures
    _close(CHOICES._launch(config, q, k, v, None), q, k, v)
    _close(CHOICES._launch(config, q, k, v, 0.25), q, k, v, scale=0.25)


def test_a_shape_is_timed_once_outside_a_capture_and_replays_right():
    q, k, v = _qkv(2, 16, 577, 64, seed=1)
    key = f"cuda:{q.device.index} bfloat16 2 x 16 heads x 577 tokens x 64"
    out = OP(q, k, v, None)                                # timed here
    chosen = CHOICES.state["chosen"]
    assert key in chosen and chosen[key].split()[0] in ("sdpa", "triton")
    _close(out, q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OP(q, k, v, None)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = OP(q, k, v, None)
    _replays_right(g, captured, (q, k, v), seeds=(2, 3))
    assert CHOICES.state["chosen"][key] == chosen[key]


def test_a_shape_s_triton_configs_are_built_side_by_side_before_they_are_timed(monkeypatch):
    from vit_graph_backend.adapters import _segment_attention_kernel as K

    def compiles():
        return sum(len(cache[0]) for cache in K._segment_attention.device_caches.values())

    built, precompile = [], K.precompile

    def recorded(*args):
        precompile(*args)
        built.append((args[-1], compiles()))

    monkeypatch.setattr(K, "precompile", recorded)
    q, k, v = _qkv(5, 4, 300, 48, seed=31)  # heads of 48: a kernel no other test compiles
    before = compiles()
    choice = attention_op.AttentionChoices()._time(q, k, v, None)
    assert [list(configs) for configs, _ in built] == [list(TRITON_CONFIGS)]
    assert built[0][1] - before == len(TRITON_CONFIGS)
    assert compiles() == built[0][1]  # the timing's launches compiled nothing more
    _close(attention_op.AttentionChoices()._launch(choice, q, k, v, None), q, k, v)


@pytest.mark.parametrize("forced", TRITON_CONFIGS)
def test_the_triton_kernel_replays_right_in_a_graph(forced, monkeypatch):
    q, k, v = _qkv(3, 8, 333, 64, seed=4)
    monkeypatch.setattr(CHOICES, "_time", lambda q, k, v, scale: forced)
    OP(q, k, v, None)
    assert CHOICES.state["chosen"][f"cuda:{q.device.index} bfloat16 3 x 8 heads x 333 tokens "
                                   "x 64"] == "triton " + "x".join(map(str, forced))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        captured = OP(q, k, v, None)
    torch.cuda.current_stream().wait_stream(s)
    _replays_right(g, captured, (q, k, v), seeds=(5, 6))
    CHOICES.chosen.pop((q.device.index, DT, 3, 8, 333, 64))


def test_a_shape_first_met_inside_a_capture_is_not_timed_there():
    q, k, v = _qkv(2, 4, 211, 64, seed=7)
    key = f"cuda:{q.device.index} bfloat16 2 x 4 heads x 211 tokens x 64"
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        F.scaled_dot_product_attention(q, k, v)   # SDPA's own first run outside the capture
        with torch.cuda.graph(g, stream=s):
            out = OP(q, k, v, None)
    assert key not in CHOICES.state["chosen"]             # no timing inside the capture
    g.replay()
    torch.cuda.synchronize()
    _close(out, q, k, v)
    OP(q, k, v, None)                                     # the next run outside times it
    assert key in CHOICES.state["chosen"]


def test_layouts_the_kernel_cannot_read_run_sdpa_with_the_ops_layout():
    q, k, v = (x.contiguous() for x in _qkv(2, 4, 64, 64, seed=8))   # [B, H, T, D] memory
    assert not CHOICES._servable(q, k, v)
    before = dict(CHOICES.chosen)
    _close(OP(q, k, v, None), q, k, v)
    assert CHOICES.chosen == before                        # not timed: SDPA always


def test_threads_meeting_new_shapes_together_get_right_answers():
    def work(i):
        q, k, v = _qkv(2 + i, 8, 150 + 17 * i, 64, seed=10 + i)
        for _ in range(3):
            out = OP(q, k, v, None)
        torch.cuda.synchronize()
        return out, (q, k, v)

    with ThreadPoolExecutor(4) as pool:   # a worker's exception is raised here
        results = list(pool.map(work, range(4)))
    for out, qkv in results:
        _close(out, *qkv)


def test_past_the_shape_cap_new_shapes_run_untimed_and_right(monkeypatch):
    monkeypatch.setattr(attention_op, "MAX_TIMED_SHAPES", len(CHOICES.state["chosen"]))
    q, k, v = _qkv(3, 4, 123, 64, seed=20)
    _close(OP(q, k, v, None), q, k, v)
    assert not any(" 123 tokens " in key for key in CHOICES.state["chosen"])


@pytest.mark.parametrize("attention_kernel", ["timed", "sdpa"])
def test_hf_clip_through_vitgraph_matches_eager(attention_kernel):
    model = _clip()
    torch.compiler.reset()
    shape = " x 4 heads x 257 tokens x 64"   # the model's attention, whatever the batch
    for key in [k for k in list(CHOICES.chosen) if _describe(k).endswith(shape)]:
        del CHOICES.chosen[key]                # timed by another test: forget it
    _compiled_matches_eager(model, attention_kernel=attention_kernel)
    timed = {key.split()[2] for key in CHOICES.state["chosen"] if key.endswith(shape)}
    if attention_kernel == "timed":  # both budgets' shapes were timed in their warm-up runs
        assert timed >= {"2", "6"}, CHOICES.state["chosen"]
    else:                            # no graph ran the op
        assert not timed, CHOICES.state["chosen"]
    torch.compiler.reset()
