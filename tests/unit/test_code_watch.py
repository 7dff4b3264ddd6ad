"""`CodeWatch` finds code from outside a tower's libraries on its module classes and modeling
module (``code_watch.py``), and finds nothing on the towers as transformers builds them.

The Qwen adapters run their own code for a tower's modules, so a patched ``forward`` (or helper)
would change Hugging Face's output and not the served one; the served-tower tests are in
``test_packed.py``.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import hf_models  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl as mq  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402

from vit_graph_backend.code_watch import CodeWatch, foreign_code  # noqa: E402


@pytest.fixture(autouse=True)
def _both_check_paths(check_paths):
    """Every test here, with the native checks' loops and with the Python checks alone."""


def _tower() -> nn.Module:
    return mq.Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2, patch_size=2)).eval()


def _watch(tower: nn.Module) -> CodeWatch:
    return CodeWatch(type(m) for m in tower.modules())


def _visual(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or model.visual


@pytest.mark.parametrize("family", sorted(hf_models.PACKED))
def test_the_towers_as_transformers_builds_them_run_only_their_libraries_code(family):
    tower = _visual(hf_models.PACKED[family]())
    assert _watch(tower).replaced() is None


def test_a_class_forward_patched_after_the_watch_is_named_and_forgotten_once_restored():
    tower = _tower()
    watch = _watch(tower)
    original = mq.VisionAttention.forward

    def patched(self, *args, **kwargs):
        return original(self, *args, **kwargs) * 0.5

    mq.VisionAttention.forward = patched
    try:
        found = watch.replaced()
    finally:
        mq.VisionAttention.forward = original
    assert found is not None
    assert found.startswith("VisionAttention.forward set to ")
    assert "patched" in found and __file__ in found
    assert watch.replaced() is None


@pytest.mark.parametrize("how", ["wraps", "library wrapper", "partial", "staticmethod",
                                 "property"])
def test_wrapped_patches_are_found_before_the_watch_is_made(how):
    """``functools.wraps`` copies the library's module name onto the patch, and a library's
    wrapper (``lru_cache``) or a partial around a user's function still runs the user's code;
    a patch made before the tower was served counts as well."""
    original = mq.VisionAttention.forward
    name, saved = "forward", original

    def user(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    if how == "wraps":
        patch = functools.wraps(original)(user)
    elif how == "library wrapper":
        patch = functools.lru_cache(user)
    elif how == "partial":
        patch = functools.partialmethod(user)
    elif how == "staticmethod":
        name, saved = "rot_pos_emb", vars(mq.Qwen2VisionTransformerPretrainedModel).get(
            "rot_pos_emb")
        patch = staticmethod(lambda grid: None)
    else:
        name, saved = "dtype", None
        patch = property(lambda self: torch.float32)
    owner = (mq.VisionAttention if name == "forward"
             else mq.Qwen2VisionTransformerPretrainedModel)
    setattr(owner, name, patch)
    try:
        found = _watch(_tower()).replaced()
    finally:
        if saved is None:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
    assert found is not None and found.startswith(f"{owner.__qualname__}.{name} set to ")
    assert __file__ in found


def test_a_modeling_module_function_replaced_is_named():
    tower = _tower()
    watch = _watch(tower)
    original = mq.apply_rotary_pos_emb_vision
    mq.apply_rotary_pos_emb_vision = lambda *args, **kwargs: original(*args, **kwargs)
    try:
        found = watch.replaced()
    finally:
        mq.apply_rotary_pos_emb_vision = original
    assert found is not None
    assert found.startswith(f"{mq.__name__}.apply_rotary_pos_emb_vision set to <lambda> (")
    assert watch.replaced() is None


def test_data_set_on_a_module_or_class_is_not_code():
    """A tensor has no truth value for ``==``: the comparison with the last look must not need
    one; and data is not code."""
    tower = _tower()
    watch = _watch(tower)
    mq._test_constant = torch.ones(3)
    mq.VisionAttention._test_flag = torch.zeros(2)
    try:
        assert watch.replaced() is None
        mq._test_constant = torch.zeros(3)
        assert watch.replaced() is None
    finally:
        del mq._test_constant, mq.VisionAttention._test_flag
    assert watch.replaced() is None


def test_a_users_subclass_in_the_tree_is_found():
    class RecordingAttention(mq.VisionAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    tower = _tower()
    tower.blocks[0].attn.__class__ = RecordingAttention  # swapped before the watch is made
    found = _watch(tower).replaced()
    assert found is not None and found.startswith("RecordingAttention.forward set to ")


def test_a_function_set_on_a_subclass_shadowing_its_bases_is_found():
    """A module class's function set where it had none (inheriting its base's) shadows the
    base's: the lookups go through the module classes, not the classes that define them."""
    class Block(mq.Qwen2VLVisionBlock):
        pass

    tower = _tower()
    tower.blocks[0].__class__ = Block
    watch = _watch(tower)
    assert watch.replaced() is None
    Block.forward = lambda self, *args, **kwargs: None
    assert watch.replaced().startswith("Block.forward set to <lambda> (")


def test_library_and_standard_library_code_is_not_foreign():
    assert foreign_code(nn.Linear.forward) is None
    assert foreign_code(torch.nn.functional.linear) is None
    assert foreign_code(functools.reduce) is None
    assert foreign_code(sys.getsizeof) is None
    assert foreign_code(mq.VisionAttention.forward) is None
    assert foreign_code(3) is None and foreign_code(nn.Linear) is None
    assert foreign_code(lambda: None).startswith("<lambda> (")


def test_a_deleted_function_and_a_tensor_set_in_its_place_are_changes_not_errors():
    tower = _tower()
    watch = _watch(tower)
    original = mq.apply_rotary_pos_emb_vision
    del mq.apply_rotary_pos_emb_vision
    try:
        assert watch.replaced() is None  # nothing foreign: the call fails as HF's would
        mq.apply_rotary_pos_emb_vision = torch.ones(2)
        assert watch.replaced() is None
    finally:
        mq.apply_rotary_pos_emb_vision = original
    assert watch.replaced() is None


def test_an_object_whose_attributes_raise_never_breaks_a_call():
    """A callable whose attribute lookups raise (as some lazy namespaces do) set on the modeling
    module: the check says nothing instead of raising inside a user's call."""
    class Lazy:
        def __call__(self, *args):
            return None

        def __getattr__(self, name):
            raise RuntimeError(f"no {name}")

    tower = _tower()
    watch = _watch(tower)
    original = mq.rotate_half
    mq.rotate_half = Lazy()
    try:
        assert foreign_code(Lazy()) is None
        assert watch.replaced() is None
    finally:
        mq.rotate_half = original
    assert watch.replaced() is None


def test_a_users_function_registered_under_the_configs_attention_name_is_found():
    """The config's name is looked up in transformers' registry at every call: a user's
    function registered under the name in use ("sdpa") counts as much as a new name set, and a
    config without transformers' own field for the name is read through its attribute."""
    from types import SimpleNamespace

    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tower = _tower()
    tower.set_attn_implementation("sdpa")
    plain = SimpleNamespace(_attn_implementation="sdpa")
    watches = (CodeWatch((type(m) for m in tower.modules()), [tower.config]),
               CodeWatch([type(tower)], [plain]))
    assert [w.replaced() for w in watches] == [None, None]
    library_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def mine(module, *args, **kwargs):
        return library_sdpa(module, *args, **kwargs)

    AttentionInterface.register("sdpa", mine)
    try:
        found = [w.replaced() for w in watches]
    finally:
        AttentionInterface.register("sdpa", library_sdpa)
    assert all(f is not None and f.startswith("attention implementation 'sdpa' set to mine (")
               for f in found)
    assert [w.replaced() for w in watches] == [None, None]
    plain._attn_implementation = "flex_attention"  # a library's: nothing to say
    assert watches[1].replaced() is None


@pytest.mark.parametrize("name", ["scaled_dot_product_attention", "layer_norm", "linear"])
def test_a_functional_op_the_tower_calls_patched_process_wide_is_named(name):
    """SageAttention's documented ``F.scaled_dot_product_attention = sageattn`` (the function
    the config's attention implementation calls), or a patch of the op ``nn.LayerNorm`` and
    ``nn.Linear`` call, changes Hugging Face's forward for every caller, not the adapter's
    kernels or the graphs it captured: named, and forgotten once restored."""
    import torch.nn.functional as F

    tower = _tower()
    watch = CodeWatch((type(m) for m in tower.modules()), (tower.config,))
    original = getattr(F, name)

    def patched(*args, **kwargs):
        return original(*args, **kwargs)

    setattr(F, name, patched)
    try:
        found = watch.replaced()
    finally:
        setattr(F, name, original)
    line = patched.__code__.co_firstlineno
    assert found == f"torch.nn.functional.{name} set to patched ({__file__}:{line})"
    assert watch.replaced() is None


def test_a_torch_function_the_tower_never_names_is_not_looked_up():
    """Only what the watched code names is watched: a patch of an op no part of the tower calls
    (``F.hardtanh``) changes nothing it runs, and keeps its graphs."""
    import torch.nn.functional as F

    tower = _tower()
    watch = CodeWatch((type(m) for m in tower.modules()), (tower.config,))
    original = F.hardtanh
    F.hardtanh = lambda *args, **kwargs: original(*args, **kwargs)
    try:
        assert watch.replaced() is None
    finally:
        F.hardtanh = original
