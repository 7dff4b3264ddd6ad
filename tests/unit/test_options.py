"""`VitGraphOptions`: validation table, mode presets, round trip, budget resolution."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vit_graph_backend.errors import InvalidOptionError, MissingDependencyError
from vit_graph_backend.options import MODES, VitGraphOptions

BAD = [
    ({"budgets": []}, r"budgets=\[\] is invalid"),
    ({"budgets": [8, 0]}, r"budgets\[1\]=0 is invalid"),
    ({"budgets": "8"}, r"budgets='8' is invalid"),
    ({"min_budget": -1}, r"min_budget=-1 is invalid"),
    ({"max_budget": 2.5}, r"max_budget=2.5 is invalid"),
    ({"max_items_per_graph": True}, r"max_items_per_graph=True is invalid"),
    ({"max_frames_per_batch": 0}, r"max_frames_per_batch=0 is invalid"),
    ({"max_graph_sets": 0}, r"max_graph_sets=0 is invalid"),
    ({"ladder_steps": 0}, r"ladder_steps=0 is invalid"),
    ({"ladder_steps": 17}, r"ladder_steps=17 is invalid: must be an integer in 1\.\.16"),
    ({"ladder_steps": 2.0}, r"ladder_steps=2.0 is invalid"),
    ({"warmup_iters": -1}, r"warmup_iters=-1 is invalid"),
    ({"policy": "ffd"}, r"policy='ffd' is invalid: must be one of \('baseline', 'exact'\)"),
    ({"inner_compiler": "tvm"}, r"inner_compiler='tvm' is invalid"),
    ({"capture": "never"}, r"capture='never' is invalid"),
    ({"graph_launch": "device"},
     r"graph_launch='device' is invalid: must be one of \('auto', 'torch'\)"),
    ({"patch_embedding": "unfold"},
     r"patch_embedding='unfold' is invalid: must be one of \('gemm', 'conv'\)"),
    ({"verify": 1}, r"verify=1 is invalid: must be True or False"),
    ({"verify_tolerance": 0}, r"verify_tolerance=0 is invalid"),
    ({"min_budget": 64, "max_budget": 8}, r"min_budget=64 is larger than max_budget=8"),
    ({"budgets": [8, 16], "max_items_per_graph": 9},
     r"max_items_per_graph=9 is larger than the smallest budget min\(budgets\)=8"),
    ({"max_budgte": 8}, r"unknown vitgraph option 'max_budgte' \(did you mean 'max_budget'\?\)"),
    ({"max_graph_memory": 0}, r"max_graph_memory=0 is invalid: bytes must be a positive int"),
    ({"max_graph_memory": 1.5}, r"max_graph_memory=1.5 is invalid: .* must be in \(0, 1\]"),
    ({"max_graph_memory": 0.0}, r"max_graph_memory=0.0 is invalid"),
    ({"max_graph_memory": True}, r"max_graph_memory=True is invalid: must be an int \(bytes\)"),
    ({"max_graph_memory": "2GB"}, r"max_graph_memory='2GB' is invalid"),
]


@pytest.mark.parametrize("options,match", BAD)
def test_bad_options_name_the_value(options, match):
    with pytest.raises(InvalidOptionError, match=match) as info:
        VitGraphOptions.from_compile_kwargs(options)
    assert isinstance(info.value, ValueError)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(InvalidOptionError, match="valid options: budgets, min_budget"):
        VitGraphOptions.from_dict({"zzz": 1})


def test_mode_and_options_together_are_refused():
    with pytest.raises(InvalidOptionError, match="were both given"):
        VitGraphOptions.from_compile_kwargs({"verify": True}, "max-autotune")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_presets(mode):
    opts = VitGraphOptions.from_compile_kwargs(None, mode)
    assert opts.inner_compiler == ("inductor" if mode.startswith("max-autotune") else "auto")


# (inner_compiler, backed_size_oblivious, cuda, packed) -> what the graph gets
@pytest.mark.parametrize("inner, oblivious, cuda, packed, expected", [
    ("auto", False, True, False, "inductor"),    # a Dynamo graph on a GPU: fused kernels
    ("auto", False, False, False, "eager"),      # no graphs off CUDA: no compile either
    ("auto", False, True, True, "eager"),        # packed towers: the adapter's fused kernels
    ("auto", True, True, False, "eager"),        # backed_size_oblivious needs eager
    ("eager", False, True, False, "eager"),
    ("inductor", False, False, False, "inductor"),
    ("inductor", False, True, True, "inductor"),
])
def test_inner_compiler_for_resolves_auto_only(inner, oblivious, cuda, packed, expected):
    opts = VitGraphOptions(inner_compiler=inner, backed_size_oblivious=oblivious)
    assert opts.inner_compiler_for(cuda=cuda, packed=packed) == expected


def test_auto_is_the_default():
    assert VitGraphOptions().inner_compiler == "auto"


def test_unknown_mode():
    with pytest.raises(InvalidOptionError, match=r"mode='fast' is invalid: must be one of"):
        VitGraphOptions.from_compile_kwargs(None, "fast")


def test_tensorrt_missing_is_a_clear_import_error():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("torch_tensorrt") is not None:
        pytest.skip("torch_tensorrt is installed here")
    with pytest.raises(MissingDependencyError, match=r"pip install 'vit-graph-backend\[tensorrt\]'"
                       ) as info:
        VitGraphOptions(inner_compiler="tensorrt")
    assert isinstance(info.value, ImportError)


@given(budgets=st.none() | st.lists(st.integers(1, 512), min_size=1, max_size=6),
       verify=st.booleans(), policy=st.sampled_from(["baseline", "exact"]),
       inner=st.sampled_from(["auto", "eager", "inductor"]), sets=st.integers(1, 16))
def test_round_trip_through_dict(budgets, verify, policy, inner, sets):
    opts = VitGraphOptions(budgets=budgets, verify=verify, policy=policy, inner_compiler=inner,
                           max_graph_sets=sets)
    again = VitGraphOptions.from_dict(opts.to_dict())
    assert again == opts and hash(again) == hash(opts)
    if budgets is not None:
        assert opts.budgets == tuple(sorted(set(budgets)))


def test_resolve_uses_model_range_unless_overridden():
    # default: each doubling split in two
    assert VitGraphOptions().resolve((64, 1024)).budgets == (
        64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert VitGraphOptions(ladder_steps=1).resolve((64, 1024)).budgets == (
        64, 128, 256, 512, 1024)
    assert VitGraphOptions(ladder_steps=1, max_budget=256).resolve(
        (64, 1024)).budgets == (64, 128, 256)
    cfg = VitGraphOptions(max_items_per_graph=8).resolve((64, 1024))
    assert cfg.max_batch_size == 8 and cfg.budgets[0] == 64
    with pytest.raises(InvalidOptionError, match=r"resolve against its model_range"):
        VitGraphOptions().resolve()


def test_resolve_batched_counts_rows_one_call_per_graph():
    # rows 1..32, each doubling split in four, one slot: written out, not derived
    cfg = VitGraphOptions().resolve(batched=True)
    assert cfg.budgets == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)
    assert (cfg.max_batch_size, cfg.max_frames_per_batch) == (1, None)
    assert VitGraphOptions(max_budget=8, ladder_steps=1).resolve(batched=True).budgets == (
        1, 2, 4, 8)
    assert VitGraphOptions(budgets=(4, 16)).resolve(batched=True).budgets == (4, 16)
    for name in ("max_items_per_graph", "max_frames_per_batch"):
        with pytest.raises(InvalidOptionError, match=rf"^{name}=2 does not apply to torch\.compile"):
            VitGraphOptions(**{name: 2}).resolve(batched=True)


@pytest.mark.parametrize("value", [1, 2**30, 0.5, 1.0, None])
def test_max_graph_memory_takes_bytes_or_a_fraction(value):
    assert VitGraphOptions(max_graph_memory=value).max_graph_memory == value


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"bogus": 1}, r"unknown vitgraph option 'bogus'; valid options: budgets, min_budget"),
    ({"max_budgt": 64}, r"unknown vitgraph option 'max_budgt' \(did you mean 'max_budget'\?\)"),
])
def test_the_constructor_names_an_unknown_option_like_from_dict(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        VitGraphOptions(**kwargs)
    with pytest.raises(InvalidOptionError, match=match):
        VitGraphOptions.from_dict(kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"inner_compiler": "inductor"}, r"batch_invariant=True is invalid with inner_compiler="),
    ({"inner_compiler": "tensorrt"}, r"with inner_compiler='tensorrt'"),
])
def test_batch_invariance_refuses_what_chooses_kernels_by_shape(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        VitGraphOptions(batch_invariant=True, **kwargs)


def test_batch_invariance_runs_the_traced_kernels_on_any_device():
    options = VitGraphOptions(batch_invariant=True)
    assert options.inner_compiler_for(cuda=True) == "eager"
    assert VitGraphOptions().inner_compiler_for(cuda=True) == "inductor"
