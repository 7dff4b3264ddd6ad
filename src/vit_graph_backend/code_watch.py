"""`CodeWatch`: whether the code of a module tree's classes is still its libraries' own.

The Qwen-VL adapters (``adapters/qwen_vl.py``) run their own code for a Hugging Face tower: they
read the blocks' weights and call their parts, never a block's or an attention's ``forward``,
and a graph replays no Python at all. So a method patched on a class of the tower (an
attention's ``forward`` replaced to record its maps or to change its math, a block's
``forward``, the tower's ``rot_pos_emb``), or a function of its modeling module replaced (its
rotary helper, say), changes what Hugging Face's forward returns and not what the adapter
returns: a wrong number without an error (each case of ``tests/unit/test_packed.py``'s
``test_code_patched_into_the_towers_classes_*`` fails without this watch).

The watch keeps, for a module tree, its module classes, the classes they derive from in the
same modules, and the namespaces of those modules that belong to the libraries (the modeling
modules), and tells whether any function there (or a module class's ``forward``, wherever it is
defined) comes from outside the libraries the tower is built from: PyTorch, transformers, this
package, their kernels and the standard library. It goes by the file a function's code is
written in, for the function and every function it wraps (``functools.wraps`` copies a
module's name, not the code). That is a property of the code, not of when it was set: a patch
made before the tower was served counts as one made after, and a watch made again later sees it
too. The adapter then runs the tower's own forward, eagerly, where the patched code runs
(``weight_watch.WeightWatch.hooked``).

The same goes for the attention function a transformers config names
(``config._attn_implementation``, looked up in transformers' registry): one a user registered
and set (``AttentionInterface.register``, ``set_attn_implementation``) is code the adapter,
which runs its own attention kernels, does not run.

The same goes for the functions of ``torch.nn.functional`` and ``torch`` that the watched code
calls by name (``F.scaled_dot_product_attention``, ``nn.functional.gelu``, ``F.linear`` from
``nn.Linear.forward``): a patch there changes every caller in the process
(SageAttention's documented ``F.scaled_dot_product_attention = sageattn``), Hugging Face's
forward among them, and not the adapter's kernels. The names are read from the watched
functions' code (``co_names``) when the watch is made.

Cost: at every call (after its graph launched: ``call_checks.py``), one lookup of each module
class's ``forward``, of every function of the watched classes and modeling modules, of each
config's attention function and of the functions of ``torch.nn.functional`` and ``torch`` they
name, compared by identity with the last look (116 for the Qwen2.5-VL-3B tower with
transformers 5.24, 4.8 to 5.0 us on a CPU, 2.7 to 2.8 for the 54 without the torch functions:
``benchmarks/results/code_watch_torch_functional_lookups_*``); the functions are examined again
only after one of them changed. A function added under a new name is not looked up: the code
that would call it is what changes, and that is looked up.

A module's class swapped on its instance (``module.__class__ = Other``) is the weight watch's
to see (``weight_watch.py``). Not covered: functions the tower reaches through other modules
than those named here, and methods patched on ``torch.Tensor``.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache, partial, partialmethod
from itertools import repeat
from types import CodeType, ModuleType
from typing import Any

from . import native_checks

__all__ = ["CodeWatch", "foreign_code", "vouch"]

#: Top-level packages whose code is the tower's own libraries: a function whose code lives
#: elsewhere (``__main__``, a user's package, a patching library) on a watched class or module is
#: code the adapter does not run. The standard library counts too (by module name: its folder
#: may hold ``site-packages``). This package by its own name, as a copy imported under another
#: name (benchmarks/host_time_two_trees_probe.py's baseline tree) vouches for its own code.
_PACKAGE = __name__.split(".")[0]
LIBRARIES = frozenset({"torch", "transformers", _PACKAGE, "triton", "numpy",
                       "flash_attn", "flash_attn_interface", "kernels", "einops", "accelerate",
                       "safetensors", "huggingface_hub"})
_STDLIB = frozenset(sys.stdlib_module_names)

#: Class attributes that do not take part in a forward pass.
_NOT_RUN = frozenset({"__init__", "__repr__", "__str__", "extra_repr", "__init_subclass__",
                      "_init_weights", "__getstate__", "__setstate__"})

_FORWARD = "forward"

#: Modules whose functions a tower's code calls by attribute, by any alias (``F.gelu``,
#: ``torch.nn.functional.gelu``), and which a process-wide patch changes for every caller.
_CALLED = ("torch.nn.functional", "torch")

_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _callable_of(value: Any) -> Any:
    """What a class attribute or module global calls (a static or class method's function, a
    property's getter), or ``None`` for data, classes and modules."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    elif isinstance(value, partialmethod):
        value = value.func
    if value is None or isinstance(value, (type, ModuleType)) or not callable(value):
        return None
    return value


#: Functions taken for the libraries' own (:func:`vouch`), and the classes they came from.
_vouched: weakref.WeakSet[Any] = weakref.WeakSet()
_vouched_classes: weakref.WeakSet[type] = weakref.WeakSet()
_vouch_lock = threading.Lock()


def vouch(cls: type) -> None:
    """Take the functions ``cls`` defines itself, as they are now, for its libraries' own: a
    tower class outside them that its user registered for an adapter
    (``adapters.register_adapter``), saying the adapter's code is the class's. Once per class,
    so a function set on it later is still found; never for a class of the libraries, whose
    own functions need no word and a patch set on one before must not get it."""
    if cls.__module__.split(".")[0] in LIBRARIES:
        return
    with _vouch_lock:
        if cls in _vouched_classes:
            return
        _vouched_classes.add(cls)
        for value in vars(cls).values():
            fn = _callable_of(value)
            try:
                if fn is not None:
                    _vouched.add(fn)
            except TypeError:  # no weak reference to it (a builtin): not Python code anyway
                pass


def _levels(fn: Any) -> Iterator[Any]:
    """``fn``, then what it wraps (``functools.wraps``' ``__wrapped__``, a partial's ``func``):
    a wrapper from a library around a user's function is the user's code, and a user's
    wrapper around a library's function too (``wraps`` copies ``__module__``, not the code)."""
    for _ in range(16):
        yield fn
        try:
            inner = fn.func if isinstance(fn, partial) else getattr(fn, "__wrapped__", None)
        except Exception:  # an object whose attribute lookup itself fails: nothing wrapped
            return
        if inner is None or inner is fn or not callable(inner):
            return
        fn = inner


def _library_folders() -> tuple[str, ...]:
    folders = []
    for name in LIBRARIES:
        module = sys.modules.get(name)
        for path in getattr(module, "__path__", ()) or ():
            folders.append(os.path.join(os.path.realpath(path), ""))
    return tuple(folders)


_real_path = lru_cache(maxsize=4096)(os.path.realpath)  # a file system lookup per part


def _outside(fn: Any, folders: tuple[str, ...]) -> bool:
    code = getattr(fn, "__code__", None)
    path = getattr(code, "co_filename", None)
    module = getattr(fn, "__module__", None)
    root = module.split(".")[0] if isinstance(module, str) else None
    if isinstance(path, str) and not path.startswith("<"):  # Python code: where it lives
        path = _real_path(path)
        if path.startswith(folders):
            return False
        return not (root in _STDLIB and not any(p in path for p in _INSTALLED))
    return root is not None and root not in LIBRARIES and root not in _STDLIB


def _registry() -> Any:
    """transformers' registry of attention functions, if transformers is loaded."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS",
                   None)


def _lookup(registry: Any, name: Any) -> Any:
    """The attention function ``name`` (a config's ``_attn_implementation``) is in
    transformers' ``registry`` (``None`` for ``"eager"``, the modeling module's own, or none)."""
    if registry is None or not isinstance(name, str):
        return None
    try:
        return registry.get(name)
    except Exception:  # a name the registry cannot give: transformers' own call says why
        return None


#: Where transformers keeps a config's ``_attn_implementation`` (a property over it): read
#: from the instance dict, 0.04 us on a CPU against 1.8 to 3.5 through the config's
#: ``__getattribute__`` (``benchmarks/results/code_watch_check_and_attention_name_read_*``).
_ATTENTION_KEY = "_attn_implementation_internal"


def _name_reader(config: Any) -> Callable[[], Any]:
    """A call that reads ``config._attn_implementation``: from the instance dict where this
    transformers keeps it there, else through the attribute."""
    try:
        own = object.__getattribute__(config, "__dict__")
        if _ATTENTION_KEY in own and own[_ATTENTION_KEY] == getattr(config,
                                                                    "_attn_implementation"):
            return partial(own.get, _ATTENTION_KEY, None)
    except Exception:  # no instance dict, or an attribute that cannot be read
        pass
    return partial(getattr, config, "_attn_implementation", None)


def _names(fn: Any) -> set[str]:
    """Every global and attribute name the code of ``fn`` looks up, with the functions it wraps
    and the code nested in it (comprehensions, local functions)."""
    names: set[str] = set()
    stack = [getattr(level, "__code__", None) for level in _levels(fn)]
    while stack:
        code = stack.pop()
        if isinstance(code, CodeType):
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return names


def _own_functions(cls: type) -> Iterator[Any]:
    """The functions a module class and its bases up to ``nn.Module`` define (``_conv_forward``
    under ``Conv3d.forward``); ``nn.Module``'s own do none of a tower's math."""
    for c in cls.__mro__:
        if c is object or c.__module__ == "torch.nn.modules.module":
            continue
        for name, value in vars(c).items():
            fn = None if name in _NOT_RUN else _callable_of(value)
            if fn is not None:
                yield fn


def _short(qualname: str) -> str:
    """A qualified name without the function it was made in (``f.<locals>.g`` -> ``g``)."""
    return qualname.rsplit("<locals>.", 1)[-1]


def foreign_code(value: Any, folders: tuple[str, ...] | None = None) -> str | None:
    """``"qualname (file:line)"`` (``"module.qualname"`` for code not written in Python) of the
    first function ``value`` runs, itself or one it wraps, whose code comes from outside
    :data:`LIBRARIES` and the standard library; ``None`` for data and a library's own code."""
    try:
        return _foreign(value, folders)
    except Exception:  # an object whose attributes cannot be read: nothing this can place
        return None


def _foreign(value: Any, folders: tuple[str, ...] | None) -> str | None:
    fn = _callable_of(value)
    try:
        if fn is None or fn in _vouched:
            return None
    except TypeError:  # unhashable: not a function of a class or module
        pass
    folders = _library_folders() if folders is None else folders
    outside = [level for level in _levels(fn) if _outside(level, folders)]
    if not outside:
        return None
    # where it is written, if in Python (``wraps`` may have copied a module's name)
    level = next((f for f in outside if hasattr(f, "__code__")), outside[0])
    name = _short(getattr(level, "__qualname__", None) or getattr(level, "__name__", "?"))
    code = getattr(level, "__code__", None)
    if code is not None:
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return f"{getattr(level, '__module__', '?')}.{name}"


class CodeWatch:
    """The code of a module tree's classes (see the module docstring).

    Args:
        types: the classes of the tree's modules.
        configs: the tree's model configs: a transformers attention module runs the function
            its config's ``_attn_implementation`` names in transformers' registry of them, one
            a user may have registered (``AttentionInterface.register``).
    """

    def __init__(self, types: Iterable[type], configs: Iterable[Any] = ()) -> None:
        self._types = tuple(dict.fromkeys(types))
        self._configs = tuple({id(c): c for c in configs if c is not None}.values())
        self._readers = tuple(map(_name_reader, self._configs))
        self._registry = _registry()
        # the modeling modules: those of the module classes outside torch and this package
        modules = {t.__module__ for t in self._types
                   if t.__module__.split(".")[0] not in ("torch", _PACKAGE)}
        self._classes = tuple(dict.fromkeys(c for t in self._types for c in t.__mro__
                                            if c.__module__ in modules))
        # the namespaces of the library modules among them (a user's module holds the user's
        # own functions, which its classes, checked themselves, may not call)
        self._modules = tuple((name, vars(sys.modules[name])) for name in sorted(modules)
                              if name in sys.modules and name.split(".")[0] in LIBRARIES)
        # looked up at every call: each module class's forward, and every function (not
        # a class method: a new bound method at each lookup) of the watched classes and the
        # modeling modules; through the module classes, where a function set on one shadows
        # its base's
        pairs = [(t, _FORWARD) for t in self._types]
        pairs += [(t, name) for t in self._types for c in t.__mro__ if c.__module__ in modules
                  for name, value in vars(c).items()
                  if name not in _NOT_RUN and not isinstance(value, classmethod)
                  and _callable_of(value) is not None]
        pairs = list(dict.fromkeys(pairs))
        self._owners = tuple(owner for owner, _ in pairs)
        self._names = tuple(name for _, name in pairs)
        globals_ = [(namespace, name) for _, namespace in self._modules
                    for name, value in namespace.items() if _callable_of(value) is not None]
        # the functions of torch.nn.functional and torch that any of it names
        named: set[str] = set()
        for fn in (*(v for t in self._types for v in _own_functions(t)),
                   *(_callable_of(v) for _, ns in self._modules for v in ns.values()),
                   *(_lookup(self._registry, read()) for read in self._readers)):
            try:
                named |= _names(fn)
            except Exception:  # an object whose attributes cannot be read: it names nothing
                pass
        self._called = tuple((module, vars(sys.modules[module]), name) for module in _CALLED
                             if module in sys.modules for name in sorted(named)
                             if _callable_of(vars(sys.modules[module]).get(name)) is not None)
        globals_ += [(namespace, name) for _, namespace, name in self._called]
        self._namespaces = tuple(namespace for namespace, _ in globals_)
        self._globals = tuple(name for _, name in globals_)
        self._seen: tuple[Any, ...] | None = ()
        self._reason: str | None = None
        self.replaced()

    def _state(self) -> tuple[Any, ...]:
        return (*map(getattr, self._owners, self._names, repeat(None)),
                *map(dict.get, self._namespaces, self._globals), *self._registered())

    def _registered(self) -> tuple[Any, ...]:
        return tuple(map(_lookup, repeat(self._registry), (read() for read in self._readers)))

    def _unchanged(self) -> bool:
        """The native loops' "every object is the one last seen" (``native_checks.py``), with
        the attention registry's entries compared here; False where they are not sure."""
        seen = self._seen
        if not seen:
            return False
        a, b = len(self._owners), len(self._owners) + len(self._globals)
        try:
            return (native_checks.same_attributes(self._owners, self._names, seen[:a])
                    and native_checks.same_entries(self._namespaces, self._globals, seen[a:b])
                    and self._registered() == seen[b:])
        except Exception:  # a reader that failed: the check below meets it again
            return False

    def replaced(self) -> str | None:
        """``"CLASS.NAME set to FUNCTION (file:line)"`` (or ``"MODULE.NAME set to ..."``) for
        the first function found from outside :data:`LIBRARIES`, else ``None``."""
        if self._unchanged():
            return self._reason
        try:
            state: tuple[Any, ...] | None = self._state()
            same = state == self._seen  # equal objects are identical ones unless one was set
        except Exception:  # a lookup that failed, or something without a truth value for ==
            state, same = None, False
        if not same:
            self._reason = self._look()
            self._seen = state
        return self._reason

    def _look(self) -> str | None:
        folders = _library_folders()
        for t in self._types:
            where = foreign_code(getattr(t, _FORWARD, None), folders)
            if where is not None:
                return f"{_short(t.__qualname__)}.forward set to {where}"
        for c in self._classes:
            for name, value in list(vars(c).items()):
                where = None if name in _NOT_RUN else foreign_code(value, folders)
                if where is not None:
                    return f"{_short(c.__qualname__)}.{name} set to {where}"
        for module, namespace in self._modules:
            for name, value in list(namespace.items()):
                where = foreign_code(value, folders)
                if where is not None:
                    return f"{module}.{name} set to {where}"
        for module, namespace, name in self._called:
            where = foreign_code(namespace.get(name), folders)
            if where is not None:
                return f"{module}.{name} set to {where}"
        for read in self._readers:
            name = read()
            where = foreign_code(_lookup(self._registry, name), folders)
            if where is not None:
                return f"attention implementation {name!r} set to {where}"
        return None
