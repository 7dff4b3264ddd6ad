"""`WeightWatch` sees every way a weight can get new storage, and every submodule replaced
(``weight_watch.py``).

A captured graph reads each weight by address, so each case below is one that would otherwise
replay over freed memory: the watch must say "moved" for it, and must not for an in-place write
(the graph reads the new values where they are) or for modules made elsewhere in the process. A
graph also replays the code of the modules it was captured from, so a submodule replaced, with or
without weights of its own, is a move too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from toy_encoders import Nested, Wrapper

from vit_graph_backend.weight_watch import WeightWatch, registrations


@pytest.fixture(autouse=True)
def _both_check_paths(check_paths):
    """Every test here, with the native checks' loops and with the Python checks alone."""


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.act = nn.ReLU()  # no weights: a graph replays its code all the same
        self.register_buffer("scale", torch.ones(8))


def _watched() -> tuple[_Tower, WeightWatch]:
    torch.manual_seed(0)
    tower = _Tower()
    watch = WeightWatch.of(tower)
    assert watch is not None and not watch.moved()
    return tower, watch


@torch.no_grad()
def test_in_place_writes_and_modules_made_elsewhere_are_not_moves():
    tower, watch = _watched()
    tower.blocks[1].weight.mul_(2.0)
    tower.scale.add_(1.0)
    tower.load_state_dict({k: v * 3 for k, v in tower.state_dict().items()})  # copies in place
    before = registrations()
    nn.Linear(8, 8)  # registers two parameters somewhere else
    assert registrations() > before
    assert not watch.moved()


@torch.no_grad()
def test_one_parameter_given_new_storage_by_hand_is_a_move():
    tower, watch = _watched()
    tower.blocks[2].bias.data = torch.zeros(8)  # not the first parameter, not a registration
    assert watch.moved()


@torch.no_grad()
def test_a_write_to_a_parameter_table_is_a_move():
    """accelerate's ``set_module_tensor_to_device`` puts a weight in place this way."""
    tower, watch = _watched()
    tower.blocks[1]._parameters["weight"] = nn.Parameter(torch.zeros(8, 8))
    assert watch.moved()


@torch.no_grad()
def test_a_replaced_buffer_is_a_move():
    tower, watch = _watched()
    tower.scale = torch.full((8,), 2.0)
    assert watch.moved()


@torch.no_grad()
def test_a_replaced_submodule_is_a_move():
    tower, watch = _watched()
    made = nn.Linear(8, 8)      # made before the watch sees it: its registration is earlier
    assert not watch.moved()
    tower.blocks[0] = made       # attaching it is a registration: the tree is walked again
    assert watch.moved()


@torch.no_grad()
def test_a_write_to_a_module_table_is_a_move():
    """``module._modules[name] = m`` fires no registration hook (torch.ao's ``convert`` and
    quantizers that swap linear layers write the table this way)."""
    made = nn.Linear(8, 8)  # made before the watch: its registrations are counted already
    tower, watch = _watched()
    tower.blocks._modules["1"] = made
    assert watch.moved()
    assert any(t is made.weight for t in watch.tensors())  # the new tree is what it reads


class _RaisingEq(nn.Linear):
    def __eq__(self, other):  # as a module comparing its weights elementwise might
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")

    __hash__ = nn.Linear.__hash__


@torch.no_grad()
def test_a_module_put_in_by_table_is_seen_whatever_its_equality_does():
    """The module tables are compared whole (``WeightWatch._tables_changed``): a module whose
    ``==`` raises is a move, not an error in the user's call; the watch then reads the tree
    again and checks quietly from there."""
    made = _RaisingEq(8, 8)
    tower, watch = _watched()
    tower.blocks._modules["1"] = made
    assert watch.moved()
    assert any(t is made.weight for t in watch.tensors())
    assert WeightWatch.of(tower).moved() is False


@torch.no_grad()
def test_a_submodule_added_to_a_table_without_registration_is_seen():
    """A table that gained an entry is another tree: the watch reads it again (and so its
    weights), where a lookup of the names it knew would miss it."""
    made = nn.Linear(8, 8)
    tower, watch = _watched()
    tower.blocks._modules["3"] = made
    assert watch.moved()
    assert any(t is made.weight for t in watch.tensors())


@torch.no_grad()
@pytest.mark.parametrize("how", ["attribute", "table"])
def test_a_submodule_without_weights_replaced_is_a_move(how):
    tower, watch = _watched()
    if how == "attribute":  # a registration
        tower.act = nn.Tanh()
    else:
        tower._modules["act"] = nn.Tanh()
    assert watch.moved()


@torch.no_grad()
def test_a_removed_parameter_is_a_move():
    tower, watch = _watched()
    tower.blocks[0].bias = None
    assert watch.moved()


@torch.no_grad()
def test_the_first_parameter_and_devices_added():
    tower, watch = _watched()
    assert watch.param() is tower.embed.weight and watch.devices_added() == set()
    # one weight offloaded, as accelerate's set_module_tensor_to_device does it
    tower.blocks[1]._parameters["weight"] = nn.Parameter(torch.empty(8, 8, device="meta"))
    assert watch.moved() and watch.devices_added() == {torch.device("meta")}
    assert watch.param() is tower.embed.weight  # the first parameter is where it was


def test_no_watch_without_parameters():
    assert WeightWatch.of(nn.ReLU()) is None and WeightWatch.of(object()) is None


def _addresses(module: nn.Module) -> list[tuple[str, object]]:
    """Every parameter and buffer by name and address, and every submodule by name and
    identity, read through ``named_parameters``, ``named_buffers`` and ``named_modules``: an
    oracle that shares nothing with the watch's table lookups."""
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    modules = [(name, id(m)) for name, m in module.named_modules(remove_duplicate=False)]
    return sorted((name, t.data_ptr()) for name, t in tensors) + modules


_OPS = ("in_place", "data", "table", "buffer", "submodule", "module_table", "activation",
        "remove_bias", "elsewhere")


def _apply(tower: _Tower, ops: list[tuple[str, int]], spares: list[nn.Module]) -> list:
    """Apply ``ops`` to ``tower``; returns the old tensors and modules, held alive so a freed
    address cannot be reused by the next op."""
    kept: list = []
    for op, i in ops:
        block = tower.blocks[i]
        if op == "in_place":
            block.weight.mul_(0.5)
        elif op == "data":
            kept.append(block.weight.data)
            block.weight.data = block.weight * 2
        elif op == "table":
            kept.append(block.weight)
            block._parameters["weight"] = nn.Parameter(block.weight * 2)
        elif op == "buffer":
            kept.append(tower.scale)
            tower.scale = tower.scale * 2
        elif op == "submodule":
            kept.append(block)
            tower.blocks[i] = nn.Linear(8, 8)
        elif op == "module_table":
            kept.append(block)
            tower.blocks._modules[str(i)] = spares.pop()
        elif op == "activation":
            kept.append(tower.act)
            tower.act = (nn.Tanh, nn.ReLU, nn.GELU)[i]()
        elif op == "remove_bias":
            kept.append(block.bias)
            block.bias = None
        else:
            kept.append(nn.Linear(8, 8))  # registered elsewhere: no weight of the tower moved
    return kept


_CHANGES = st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 2)), max_size=6)


@given(ops=_CHANGES)
@torch.no_grad()
def test_moved_exactly_when_some_weight_has_another_address(ops):
    """Any sequence of weight and module changes: the watch says "moved" exactly when some
    parameter or buffer now has another address than when it was made, or is gone, or is new,
    or some submodule is another module."""
    # made before the watch, so putting one in a module table is seen by the tables alone
    spares = [nn.Linear(8, 8) for _ in ops]
    tower, watch = _watched()
    before = _addresses(tower)
    kept = _apply(tower, ops, spares)
    assert watch.moved() == (_addresses(tower) != before) and kept is not None


@given(ops=_CHANGES, skipped=st.sets(st.integers(0, 2)))
@torch.no_grad()
def test_moved_exactly_when_some_weight_not_skipped_has_another_address(ops, skipped):
    """The same, with some blocks' weights left to copies that follow them (``skip``): their
    new storage is no move, anything else is, a block replaced included."""
    spares = [nn.Linear(8, 8) for _ in ops]
    tower, watch = _watched()
    watch.skip([(tower.blocks[i], "weight") for i in skipped])
    names = {f"blocks.{i}.weight" for i in skipped}
    before = [a for a in _addresses(tower) if a[0] not in names]
    kept = _apply(tower, ops, spares)
    after = [a for a in _addresses(tower) if a[0] not in names]
    assert watch.moved() == (after != before) and kept is not None


@torch.no_grad()
def test_a_skipped_weight_is_checked_again_against_its_first_address_once_unskipped():
    tower, watch = _watched()
    watch.skip([(tower.blocks[0], "weight"), (tower.blocks[0], "bias")])
    old = tower.blocks[0].weight.data
    tower.blocks[0].weight.data = old * 2
    tower.blocks[0]._parameters["bias"] = nn.Parameter(torch.zeros(8))
    nn.Linear(2, 2)  # a registration elsewhere: the tables are read again, the skip kept
    assert not watch.moved()
    watch.skip([])  # a graph that reads them directly: checked against the watch's start
    assert watch.moved()


@torch.no_grad()
def test_a_skipped_weight_gone_is_a_move_once_the_tables_are_read_again():
    tower, watch = _watched()
    watch.skip([(tower.blocks[1], "bias")])
    bias = tower.blocks[1].bias
    del tower.blocks[1].bias  # no hook: the copies' own check sees it first
    assert not watch.moved()
    nn.Linear(2, 2)
    assert watch.moved() and bias is not None


def _wrapped_tower(nested: bool) -> tuple[_Tower, WeightWatch]:
    tower, _ = _watched()
    make = (lambda t: Nested(Wrapper(t))) if nested else Wrapper
    with torch.no_grad():
        tower.blocks[1].weight = nn.Parameter(make(torch.randn(8, 8)), requires_grad=False)
        tower.register_buffer("codes", make(torch.zeros(8)))
    watch = WeightWatch.of(tower)
    assert watch is not None and not watch.moved()
    return tower, watch


def _innermost(t: torch.Tensor) -> torch.Tensor:
    while isinstance(t, Wrapper):
        t = t.inner
    return t


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("where", ["parameter", "buffer"])
def test_a_wrapper_subclass_weight_whose_held_tensor_moves_is_a_move(where, nested):
    """The graph reads the tensor a wrapper holds: new storage there (a quantized weight
    loaded again, say) must be seen, though no table and no registration changed."""
    tower, watch = _wrapped_tower(nested)
    wrapper = tower.blocks[1].weight if where == "parameter" else tower.codes
    holder = wrapper.inner if nested else wrapper
    old = _innermost(wrapper)
    holder.inner = old * 2 if not nested else Wrapper(old * 2)
    assert _innermost(wrapper).data_ptr() != old.data_ptr()
    assert watch.moved()


def test_a_wrapper_subclass_weight_written_in_place_is_not_a_move():
    tower, watch = _wrapped_tower(nested=False)
    with torch.no_grad():
        tower.blocks[1].weight.inner.mul_(2.0)
        tower.codes.inner.add_(1.0)
    assert not watch.moved()
    assert watch.devices_added() == set()


def test_a_wrapper_subclass_put_in_a_plain_weights_place_is_a_move():
    tower, watch = _watched()
    tower.blocks[2]._parameters["weight"] = nn.Parameter(Wrapper(torch.randn(8, 8)),
                                                         requires_grad=False)
    assert watch.moved()


def test_a_tower_of_wrapper_weights_only_is_watched():
    """Every parameter a wrapper subclass, a plain buffer beside them: the first parameter the
    manager asks for (its device and dtype decide recapture or eager) is a parameter."""
    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(Wrapper(torch.randn(4, 4)), requires_grad=False)
    module.bias = nn.Parameter(Wrapper(torch.randn(4)), requires_grad=False)
    module.register_buffer("steps", torch.zeros(1, dtype=torch.int64))
    watch = WeightWatch.of(module)
    assert watch is not None and watch.param() is module.weight and not watch.moved()
    module.bias.inner = torch.randn(4)
    assert watch.moved()


def test_forward_hooks_inside_the_module_are_named_and_those_around_it_are_not():
    """A graph replays without the hooks of the modules it runs; hooks of the watched module and
    of the module it wraps alone (a served tower in its adapter) run around the whole call."""
    tower = _Tower()
    wrapper = nn.Sequential(tower)
    watch = WeightWatch.of(wrapper)
    assert watch is not None and watch.hooked() is None
    around = [wrapper.register_forward_hook(lambda m, a, o: None),
              tower.register_forward_pre_hook(lambda m, a: None)]
    assert watch.hooked() is None
    inside = tower.blocks[1].register_forward_hook(lambda m, a, o: o * 2)
    assert watch.hooked() == "forward hooks on 0.blocks.1"
    inside.remove()
    pre = tower.act.register_forward_pre_hook(lambda m, a: None)
    assert watch.hooked() == "forward hooks on 0.act"
    pre.remove()
    assert watch.hooked() is None
    for handle in around:
        handle.remove()


def test_a_global_forward_hook_and_a_hooked_module_put_in_by_table_are_seen():
    made = nn.Linear(8, 8)
    made.register_forward_hook(lambda m, a, o: o + 1)
    tower, watch = _watched()
    tower.blocks._modules["2"] = made  # no registration: the watch finds it in the table
    assert watch.hooked() == "forward hooks on blocks.2"
    tower.blocks._modules["2"] = nn.Linear(8, 8)
    assert watch.hooked() is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert watch.hooked() == "a global forward hook"
    finally:
        handle.remove()
    assert watch.hooked() is None


def test_a_forward_replaced_on_an_instance_inside_is_named():
    """accelerate's hooks (``add_hook_to_module``: offloading, device maps) and hand-patched
    attention replace ``forward`` on the instance, which a graph would not call."""
    tower, watch = _watched()
    original = tower.blocks[0].forward
    tower.blocks[0].forward = lambda x: original(x) * 2
    assert watch.hooked() == "blocks.0's forward, replaced on the instance"
    del tower.blocks[0].forward
    assert watch.hooked() is None


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_a_class_set_on_a_module_inside_is_named_until_set_back():
    """``module.__class__ = Other`` keeps the module, its tables and its weights: a graph would
    replay the old class's code. Named (after a tree read again for a module made elsewhere,
    too: the class the watch first saw is what counts), and forgotten once set back."""
    tower, watch = _watched()
    tower.blocks[1].__class__ = _Doubled
    assert watch.hooked() == f"blocks.1's class set to {__name__}._Doubled"
    nn.Linear(2, 2)  # a registration elsewhere: the tree is read again
    assert watch.hooked() == f"blocks.1's class set to {__name__}._Doubled"
    tower.blocks[1].__class__ = nn.Linear
    assert watch.hooked() is None and not watch.moved()
