"""`WeightWatch`: whether a module's weights and submodules are still those its graphs were
captured from.

A captured graph reads every weight by address. ``.to()``, ``.half()`` or ``load_state_dict(...,
assign=True)`` give a whole module new storage and free the old one; so does, for one tensor,
``p.data = t`` or a write to its module's table (``module._parameters[name] = p``, which is how
accelerate's ``set_module_tensor_to_device`` places a weight). A graph replayed after any of them
reads freed memory and returns wrong numbers without an error (an H100 run:
``benchmarks/results/packed_served_tower_new_storage_recapture_*``).

So the watch keeps, for every parameter and buffer of the module, the table it lives in and its
address, and before every call looks each one up again and compares: a ``dict.get`` and a
``data_ptr()`` per tensor, in one call of the native loops where they are built
(``native_checks.py``), else through C-level ``map`` (40 to 80 us for the 392 tensors of the
Qwen2.5-VL-3B tower on an H100's host:
``benchmarks/results/weight_watch_check_every_tensor_vs_first_parameter_*``). No hook fires for
``p.data = t`` or a table write, hence a look at every call (PEFT's ``merge(safe_merge=True)``
of a LoRA adapter writes ``base_layer.weight.data``). Weights the graphs read only through
copies that the encoder follows itself after each launch are left out (:meth:`WeightWatch.skip`:
160 of the 3B tower's 392:
``benchmarks/results/weight_watch_mlp_weights_left_to_their_copies_*``); put back, each is
compared with its address when the watch was made. Modules attached after the watch was made
register their parameters, buffers or themselves, which a process-wide count of those
registrations notices; the module tree is walked again only then. A weight that is a wrapper
tensor subclass (a quantized weight, a ``DTensor``) has no address of its own (its
``data_ptr()`` reads 0 in torch 2.13, whatever it holds); the graph reads the tensors it holds
(``__tensor_flatten__``), so those are watched in its place, looked up through the subclass at
every call.

A graph also replays the code of the modules it was captured from, so the watch keeps, for every
submodule, the table it lives in (``module._modules``) and the module there, and checks those
tables too: a submodule replaced is a move, with weights of its own or without (an activation
swapped). Assignment registers the new module, but torch.ao's ``convert`` and quantizers that
swap linear layers write the table directly, and the old module's tables stay where the watch
looks, its weights kept alive and stale. The tables are compared whole with copies of them (one
C-level comparison, the modules by identity first; a table that gained an entry differs too:
``benchmarks/results/submodule_tables_compared_whole_check_time_before_after_*``).

Nor does a graph run forward hooks, or a ``forward`` replaced on a module instance (how
accelerate's hooks, offloading among them, and hand-patched attention that records its maps
work). :meth:`WeightWatch.hooked` says which module inside the watched one has either (or that
a global forward hook is registered), so the call can run eagerly where they run. The watched
module and the modules it wraps alone (an adapter around its tower) are not counted: their hooks
run around the whole call, graphs or not (``benchmarks/results/forward_hooks_inside_*``). The
hook tables are tested only after a hook was registered in the process (PyTorch numbers every hook
handle it makes) or the tree was read again; the ``forward`` keys, which nothing announces, at
every call. A class set on a module inside (``module.__class__ = Other``: its tables and weights
stay, its code changes) is named too, against the class the watch first saw it with (a type per
module at every call). A watch made with ``code=True`` (those of the Qwen adapters, which run
their own code for the tower's modules) also reports a module class, or its modeling module,
that runs code from outside the tower's libraries, a patched ``forward`` say
(``code_watch.py``).

:class:`~vit_graph_backend.runtime.EncoderCudaGraphManager` watches its encoder (or the module
given as ``watch``) at every call, :meth:`WeightWatch.moved` before its graphs launch and
:meth:`WeightWatch.hooked` after (``call_checks.py``): it captures again when the weights moved
on the same device and dtype, and turns its graphs off with the reason otherwise. Batched
graphs check every tensor they read themselves (``batched.py``); the Qwen adapters' padded MLP
copies follow their own parameters, in-place writes included (``adapters/_aligned_mlp.py``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from ._compat import (
    buffer_table,
    forward_hook_tables,
    global_forward_hook_tables,
    hook_handles_made,
    module_table,
    parameter_table,
)
from . import native_checks
from .code_watch import CodeWatch

__all__ = ["WeightWatch", "registrations"]

_data_ptr = torch.Tensor.data_ptr
_lookup = dict.get
_has = dict.__contains__
#: what :meth:`WeightWatch.moved` compares to once a tensor watched at first is gone
_GONE = (-1,)

#: Parameters, buffers and submodules registered anywhere in this process: a module tree walked
#: at one count is still the same tree while the count has not moved (table writes that bypass
#: registration are caught by reading the tables themselves).
_registrations = [0]
_hook_lock = threading.Lock()
_hooks_installed = False


def _count_registration(*_: Any) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """How many parameters, buffers and submodules have been registered in this process since
    the first watch (or :class:`~vit_graph_backend.adapters._aligned_mlp.AlignedMLPs`) was made."""
    global _hooks_installed
    if not _hooks_installed:
        with _hook_lock:
            if not _hooks_installed:
                hooks = torch.nn.modules.module
                hooks.register_module_parameter_registration_hook(_count_registration)
                hooks.register_module_buffer_registration_hook(_count_registration)
                hooks.register_module_module_registration_hook(_count_registration)
                _hooks_installed = True
    return _registrations[0]


def _readable(tensor: torch.Tensor) -> bool:
    try:  # a tensor subclass without storage of its own has no address to watch
        tensor.data_ptr()
    except RuntimeError:
        return False
    return True


def _held(tensor: Any) -> list[torch.Tensor] | None:
    """The tensors with storage that a wrapper subclass holds (its ``__tensor_flatten__``
    attributes, and theirs in turn), or ``None`` for a tensor that is not one."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return None
    held: list[torch.Tensor] = []
    for name in flatten()[0]:
        inner = getattr(tensor, name)
        nested = _held(inner)
        held.extend(nested if nested is not None else [inner] if _readable(inner) else [])
    return held


def _inside(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Of a module's ``named_modules()``, those under it, less the chain of modules that each
    wrap a single child from it down (their hooks run around the whole call)."""
    skip = 1
    while skip < len(named) and len(module_table(named[skip - 1][1])) == 1:
        skip += 1
    return named[skip:]


def _held_addresses(tensor: Any) -> tuple[int, ...]:
    held = _held(tensor)
    if held is None:  # removed, or replaced by a tensor that is not a wrapper subclass
        raise TypeError("not a wrapper subclass")
    return tuple(map(_data_ptr, held))


class WeightWatch:
    """Every parameter and buffer of a module and the address each had when the watch was made,
    every submodule and the module it was, and the forward hook tables and instance dicts of
    the modules inside."""

    def __init__(self, module: nn.Module, code: bool = False) -> None:
        self._module = module
        #: with ``code``: whether the module classes run their libraries' code (``code_watch``)
        self._code: CodeWatch | None = None
        self._watch_code = code
        self._slots: tuple[list[dict[str, Any]], list[str]] = ([], [])
        #: the same for weights that are wrapper subclasses (their held tensors are watched)
        self._wrapped: tuple[list[dict[str, Any]], list[str]] = ([], [])
        #: (module tables, names) of every submodule, and the modules there when last read
        self._kids: tuple[list[dict[str, Any]], list[str]] = ([], [])
        self._tree: tuple[Any, ...] = ()
        #: the module tables that hold submodules, and a copy of each as last read: one
        #: C-level comparison of the two tuples checks every submodule (:meth:`_refresh`)
        self._tables: tuple[dict[str, Any], ...] = ()
        self._table_copies: tuple[dict[str, Any], ...] = ()
        #: the forward hook tables and the instance dicts of the modules inside (:func:`_inside`)
        self._hooks: tuple[dict[int, Any], ...] = ()
        self._dicts: tuple[dict[str, Any], ...] = ()
        self._forward: tuple[str, ...] = ()
        #: every module of the tree (the watched one first), and the class each had when this
        #: watch first saw it (by identity: a tree read again keeps what the graphs ran)
        self._mods: tuple[nn.Module, ...] = ()
        self._types: tuple[type, ...] = ()
        self._first_types: dict[int, tuple[weakref.ref[nn.Module], type]] = {}
        #: the hook handle count at which the hook tables were found empty twice running (so a
        #: registration under way in another thread at the first look had written its table by
        #: the second), and at the last look
        self._clear_at: int | None = None
        self._looked_at = -1
        self._at = -1
        #: the slot of the module's first parameter with storage of its own (``None``: every
        #: parameter is a wrapper subclass)
        self._first: int | None = None
        #: slots (``id`` of the table, name) whose tensors the graphs read through copies that
        #: the encoder follows itself (:meth:`skip`), and the slots checked at every call
        self._skip: frozenset[tuple[int, str]] = frozenset()
        self._checked: tuple[tuple[dict[str, Any], ...], tuple[str, ...]] = ((), ())
        #: every slot's address when the watch was made, by slot, then the wrapper subclasses'
        #: (``None`` until read), with the tables kept alive so their ids stay theirs
        self._then: dict[tuple[int, str], int] | None = None
        self._wrapped_then: tuple[int, ...] | None = None
        self._devices = self._read_slots()
        self._then_tables = self._slots[0]
        addresses = self._addresses(self._slots)
        if addresses is not None:
            self._then = dict(zip(zip(map(id, self._slots[0]), self._slots[1]), addresses))
            self._wrapped_then = addresses[len(self._slots[1]):]
        self._checked_then = self._select()
        self._tree_then = self._tree
        native_checks.loops()  # the build, if any, starts while the graphs are captured

    @staticmethod
    def of(module: Any, code: bool = False) -> WeightWatch | None:
        """A watch on ``module``'s weights (``None`` for no module or no parameter)."""
        if not isinstance(module, nn.Module) or next(module.parameters(), None) is None:
            return None
        watch = WeightWatch(module, code)
        return watch if watch._slots[1] or watch._wrapped[1] else None

    def _read_slots(self) -> set[torch.device]:
        self._at = registrations()
        tables: list[dict[str, Any]] = []
        names: list[str] = []
        wrapped: tuple[list[dict[str, Any]], list[str]] = ([], [])
        kids: tuple[list[dict[str, Any]], list[str]] = ([], [])
        first, devices = None, set()
        named = list(self._module.named_modules())
        for _, module in named:
            table = module_table(module)
            kids[0].extend([table] * len(table))
            kids[1].extend(table)
            for table in (parameter_table(module), buffer_table(module)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    held = _held(tensor)  # a wrapper's own data_ptr() reads 0, whatever it holds
                    if held is not None or not _readable(tensor):
                        if not held:
                            continue
                        wrapped[0].append(table)
                        wrapped[1].append(name)
                    else:
                        if first is None and isinstance(tensor, nn.Parameter):
                            first = len(names)
                        tables.append(table)
                        names.append(name)
                    devices.add(tensor.device)
        self._slots, self._wrapped, self._first = (tables, names), wrapped, first
        keep = [(id(t), n) not in self._skip for t, n in zip(tables, names)]
        self._checked = (tuple(t for t, k in zip(tables, keep) if k),
                         tuple(n for n, k in zip(names, keep) if k))
        self._kids, self._tree = kids, tuple(map(_lookup, *kids))
        self._tables = tuple({id(t): t for t in kids[0]}.values())
        self._table_copies = tuple(map(dict, self._tables))
        inside = [m for _, m in _inside(named)]
        self._hooks = tuple(t for m in inside for t in forward_hook_tables(m))
        self._dicts = tuple(m.__dict__ for m in inside)
        self._forward = ("forward",) * len(inside)
        self._mods = tuple(m for _, m in named)
        for m in self._mods:  # by a weak reference: an id is the same module while it lives
            seen = self._first_types.get(id(m))
            if seen is None or seen[0]() is not m:
                self._first_types[id(m)] = (weakref.ref(m), type(m))
        self._types = tuple(self._first_types[id(m)][1] for m in self._mods)
        self._clear_at = None
        if self._watch_code:  # a model config is an instance attribute (transformers')
            self._code = CodeWatch((type(m) for _, m in named),
                                   (m.__dict__.get("config") for _, m in named))
        return devices

    def _refresh(self) -> None:
        # the tables read are the module tree's while nothing registered and no module table
        # holds another module than it did
        if self._at != _registrations[0] or self._tables_changed():
            self._read_slots()
            self._checked_then = self._select()

    def _tables_changed(self) -> bool:
        # the loops' identity walk, else dict equality (identity first; an entry gained differs)
        if native_checks.same_dicts(self._tables, self._table_copies):
            return False
        try:
            return self._tables != self._table_copies
        except Exception:  # a module class whose == raises: read the tree again
            return True

    def _select(self) -> tuple[int, ...] | None:
        """The addresses the checked slots had when the watch was made (-1 for a slot that did
        not exist then), then the wrapper subclasses'; ``_GONE``, equal to no addresses read,
        if a slot of then is gone."""
        if self._then is None or self._wrapped_then is None:
            return None
        if not self._then.keys() <= set(zip(map(id, self._slots[0]), self._slots[1])):
            return _GONE
        get = self._then.get
        return (*(get((id(t), n), -1) for t, n in zip(*self._checked)), *self._wrapped_then)

    def skip(self, slots: Any) -> None:
        """Leave out of :meth:`moved` the parameters named by ``slots`` (``(module, name)``
        pairs): no graph reads them, only copies that the encoder brings up to date after each
        launch and never frees under a graph (``call_checks.py``). An empty ``slots`` checks
        every tensor again, each against its address when the watch was made."""
        skip = frozenset((id(parameter_table(m)), name) for m, name in slots)
        if skip != self._skip:
            self._skip = skip
            self._read_slots()
            self._checked_then = self._select()

    def tensors(self) -> list[torch.Tensor | None]:
        """Each watched tensor now, ``None`` where one was removed (wrapper subclasses last)."""
        self._refresh()
        return list(map(_lookup, *self._slots)) + list(map(_lookup, *self._wrapped))

    def _addresses(self, slots: tuple[list[dict[str, Any]], list[str]] | None = None,
                   refresh: bool = True) -> tuple[int, ...] | None:
        """The addresses of ``slots`` (default: the checked ones), then the wrapper
        subclasses'; ``None`` if one was removed or has no storage."""
        if refresh:
            self._refresh()
        try:
            addresses = tuple(map(_data_ptr, map(_lookup, *(slots or self._checked))))
            if self._wrapped[1]:
                addresses += tuple(map(_held_addresses, map(_lookup, *self._wrapped)))
            return addresses
        except (TypeError, RuntimeError):  # a tensor removed, or one without storage put in
            return None

    def modules(self) -> tuple[Any, ...]:
        """Every submodule, as the module tables hold it now: the same tuple object until the
        tables are read again (compare with ``is`` first)."""
        self._refresh()
        return self._tree

    def hooked(self, refresh: bool = True) -> str | None:
        """What inside the watched module a graph would not run: ``"forward hooks on NAME"``,
        ``"NAME's forward, replaced on the instance"``, ``"a global forward hook"``, ``"NAME's
        class set to CLASS"`` (``module.__class__`` assigned: the graphs ran the old class's
        code), with ``code``: ``"CLASS.NAME set to FUNCTION (file:line)"`` (``code_watch``); or
        ``None``.
        ``refresh=False`` right after :meth:`moved`, which read the tables already."""
        if refresh:
            self._refresh()
        made = hook_handles_made()
        if made != self._clear_at:
            if any(global_forward_hook_tables()):
                return "a global forward hook"
            if any(self._hooks):
                return self._name_hooked()
            self._clear_at = made if made == self._looked_at else None
            self._looked_at = made
        forward = native_checks.any_has_key(self._dicts, "forward")
        if forward is None:
            forward = any(map(_has, self._dicts, self._forward))
        found = self._name_hooked() if forward else None
        if found is None:
            same = native_checks.same_types(self._mods, self._types)
            if same is None:
                same = tuple(map(type, self._mods)) == self._types
            found = None if same else self._name_swapped()
        return found if found is not None or self._code is None else self._code.replaced()

    def _name_swapped(self) -> str | None:
        names = [name for name, _ in self._module.named_modules()]
        for name, module, then in zip(names, self._mods, self._types):
            if type(module) is not then:
                cls = type(module)
                return (f"{name or 'the module'}'s class set to {cls.__module__}."
                        f"{cls.__qualname__}")
        return None  # set back by another thread since

    def _name_hooked(self) -> str | None:
        for name, module in _inside(list(self._module.named_modules())):
            if any(forward_hook_tables(module)):
                return f"forward hooks on {name}"
            if "forward" in module.__dict__:
                return f"{name}'s forward, replaced on the instance"
        return None  # removed by another thread since

    def param(self) -> torch.Tensor | None:
        """The module's first parameter now (``None`` if it was removed): the first with storage
        of its own, else the first wrapper subclass."""
        if self._first is None:
            return next((t for t in map(_lookup, *self._wrapped)
                         if isinstance(t, nn.Parameter)), None)
        tables, names = self._slots
        return tables[self._first].get(names[self._first])

    def devices_added(self) -> set[torch.device]:
        """Devices the watched tensors are on now and were not on when the watch was made."""
        return {t.device for t in self.tensors() if t is not None} - self._devices

    def moved(self) -> bool:
        """Whether any watched tensor is gone or has other storage than when watched, or any
        submodule is another module."""
        self._refresh()
        then = self._checked_then
        # the native loops' "yes" stands; anything else is the Python check's to decide
        same = (not self._wrapped[1] and then is not None and then is not _GONE
                and native_checks.same_tensors(*self._checked, then, None))
        return (not same and self._addresses(refresh=False) != then
                or self._tree is not self._tree_then and self._tree != self._tree_then)
