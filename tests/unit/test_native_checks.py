"""The native checks' loops (``native_checks.py``): built where a compiler and ninja are, and
never "yes" where the Python checks they stand in for would say something changed.

The loops' answers are compared with plain Python over random tables of tensors and random
changes (new storage, in-place writes, entries replaced, removed or set to None, inference
tensors, other objects); the watch and the padded MLP copies are checked to take their "yes"
and to fall back on anything else. The build itself is tested where it can run: a PyTorch
release that moves the headers it includes fails here, not in a user's process.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from vit_graph_backend import native_checks
from vit_graph_backend.weight_watch import WeightWatch

_BUILDABLE = shutil.which("ninja") is not None and (
    shutil.which(os.environ.get("CXX", "c++")) is not None)


@pytest.fixture(scope="module")
def loops():
    built = native_checks.loops()
    if built is None:
        pytest.skip(f"native checks not built here ({native_checks.status()})")
    return built


@pytest.mark.skipif(not _BUILDABLE, reason="no C++ compiler or no ninja on PATH")
def test_builds_wherever_a_compiler_and_ninja_are() -> None:
    assert native_checks.build(timeout=600) is not None, native_checks.status()
    assert native_checks.status() == "built"


def _python_same(tables, names, addresses, versions) -> bool:
    """What the Python checks decide: every entry a tensor at its address (and version)."""
    for table, name, address, i in zip(tables, names, addresses, range(len(names))):
        if name not in table:
            return False
        value = table[name]
        if value is None:
            if versions is None or (address, versions[i]) != (-1, -1):
                return False
            continue
        if not isinstance(value, torch.Tensor) or value.data_ptr() != address:
            return False
        if versions is not None and (value.is_inference() or value._version != versions[i]):
            return False
    return True


_CHANGES = st.sampled_from(["none", "new storage", "in place", "replaced", "removed",
                            "set None", "inference", "not a tensor", "same storage view"])


@given(n=st.integers(1, 12), changes=st.lists(st.tuples(st.integers(0, 11), _CHANGES),
                                              max_size=4),
       with_versions=st.booleans(), bias_none=st.booleans())
def test_same_tensors_agrees_with_python(loops, n, changes, with_versions, bias_none) -> None:
    params = [nn.Parameter(torch.randn(3)) for _ in range(n)]
    tables = tuple({"weight": p} for p in params)
    names = ("weight",) * n
    if bias_none:
        tables[0]["weight"] = None
    addresses = tuple(-1 if t["weight"] is None else t["weight"].data_ptr() for t in tables)
    versions = tuple(-1 if t["weight"] is None else t["weight"]._version for t in tables)
    with torch.no_grad():
        for index, change in changes:
            table = tables[index % n]
            value = table.get("weight")
            if not isinstance(value, torch.Tensor) or value.is_inference():
                value = None  # nothing to write through: only the table changes
            if change == "new storage" and value is not None:
                value.data = torch.randn(3)
            elif change == "in place" and value is not None:
                value.add_(1)
            elif change == "replaced":
                table["weight"] = nn.Parameter(torch.randn(3))
            elif change == "removed":
                table.pop("weight", None)
            elif change == "set None":
                table["weight"] = None
            elif change == "inference":
                with torch.inference_mode():
                    table["weight"] = torch.randn(3)
            elif change == "not a tensor":
                table["weight"] = 1.5
            elif change == "same storage view" and value is not None:
                table["weight"] = value.detach()
    saved = versions if with_versions else None
    assert loops.same_tensors(tables, names, addresses, saved) == _python_same(
        tables, names, addresses, saved)


@given(keys=st.lists(st.sets(st.sampled_from(["forward", "weight", "training", "forward_"])),
                     max_size=8))
def test_any_has_key_is_dict_contains(loops, keys) -> None:
    dicts = tuple(dict.fromkeys(k) for k in keys)
    assert loops.any_has_key(dicts, "forward") == any("forward" in d for d in dicts)


@given(kinds=st.lists(st.sampled_from([nn.ReLU, nn.GELU, nn.Identity]), max_size=8),
       swap=st.one_of(st.none(), st.integers(0, 7)))
def test_same_types_is_type_identity(loops, kinds, swap) -> None:
    objects = tuple(k() for k in kinds)
    types = tuple(type(o) for o in objects)
    if swap is not None and objects:
        objects[swap % len(objects)].__class__ = nn.Tanh
    assert loops.same_types(objects, types) == (tuple(map(type, objects)) == types)


_VALUES = st.sampled_from([None, 0, 1, "a", (), "b"])


@given(pairs=st.lists(st.lists(st.tuples(st.sampled_from("abcde"), _VALUES), max_size=5),
                      max_size=5),
       change=st.sampled_from(["none", "set", "add", "remove", "reorder", "equal value"]),
       where=st.integers(0, 4))
def test_same_dicts_says_yes_only_for_identical_entries_in_order(loops, pairs, change,
                                                                 where) -> None:
    dicts = tuple(dict(p) for p in pairs)
    copies = tuple(map(dict, dicts))
    if dicts:
        d = dicts[where % len(dicts)]
        if change == "set" and d:
            d[next(iter(d))] = object()
        elif change == "add":
            d["z"] = 1
        elif change == "remove" and d:
            del d[next(iter(d))]
        elif change == "reorder" and len(d) > 1:
            first = next(iter(d))
            d[first] = d.pop(first)
        elif change == "equal value" and d:
            d[next(iter(d))] = [1]  # equal to another [1], never identical
            copies[where % len(dicts)][next(iter(d))] = [1]
    identical = all(list(a) == list(b) and all(a[k] is b[k] for k in a)
                    for a, b in zip(dicts, copies))
    assert loops.same_dicts(dicts, copies) == identical
    if identical:
        assert dicts == copies  # its yes is the comparison's yes


class _Owner:
    kept = staticmethod(len)

    @property
    def broken(self):
        raise KeyError("not an AttributeError")


@given(names=st.lists(st.sampled_from(["kept", "missing", "__init__"]), max_size=6),
       change=st.sampled_from(["none", "reset", "delete"]))
def test_same_attributes_and_entries_are_getattr_and_get_by_identity(loops, names,
                                                                     change) -> None:
    owners = (_Owner,) * len(names)
    saved = tuple(getattr(o, n, None) for o, n in zip(owners, names))
    namespace = {"kept": len}
    tables = (namespace,) * len(names)
    entries = tuple(namespace.get(n) for n in names)
    if change == "reset":
        _Owner.kept = staticmethod(abs)
        namespace["kept"] = abs
    elif change == "delete":
        del _Owner.kept, namespace["kept"]
    try:
        assert loops.same_attributes(tuple(owners), tuple(names), saved) == (
            tuple(getattr(o, n, None) for o, n in zip(owners, names)) == saved)
        assert loops.same_entries(tables, tuple(names), entries) == (
            tuple(namespace.get(n) for n in names) == entries)
    finally:
        _Owner.kept = staticmethod(len)


def test_an_attribute_read_that_raises_is_raised(loops) -> None:
    with pytest.raises(KeyError):
        loops.same_attributes((_Owner(),), ("broken",), (None,))


def test_bad_arguments_raise_instead_of_answering(loops) -> None:
    with pytest.raises(TypeError):
        loops.same_tensors(([],), ("weight",), (0,), None)  # a table that is no dict
    with pytest.raises(ValueError):
        loops.same_tensors(({},), ("weight",), (), None)
    with pytest.raises(TypeError):
        loops.any_has_key(([],), "forward")
    with pytest.raises(ValueError):
        loops.same_types((1,), ())


class _Counting:
    """The loops, counting calls of each."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.inner, name)(*args)
        return call


def test_the_watch_takes_the_loops_yes_and_checks_a_no_itself(loops, monkeypatch) -> None:
    tower = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    watch = WeightWatch.of(tower)
    counting = _Counting(loops)
    monkeypatch.setattr(native_checks, "loops", lambda: counting)
    python = []
    addresses = watch._addresses
    monkeypatch.setattr(watch, "_addresses",
                        lambda *a, **k: python.append(1) or addresses(*a, **k))
    assert not watch.moved() and watch.hooked() is None
    assert counting.calls == {"same_dicts": 2, "same_tensors": 1, "any_has_key": 1,
                              "same_types": 1}
    assert python == []  # the loops' yes stood
    # a loop that says no (wrongly, here) only sends the watch to its Python check
    monkeypatch.setattr(counting, "inner", type("No", (), {
        "same_tensors": staticmethod(lambda *a: False),
        "any_has_key": staticmethod(lambda *a: True),
        "same_types": staticmethod(lambda *a: False)})())
    assert not watch.moved() and watch.hooked() is None
    assert python == [1]
    tower[0].weight.data = torch.zeros(4, 4)
    monkeypatch.setattr(counting, "inner", loops)
    assert watch.moved()


def test_a_loop_that_raises_leaves_the_python_check_to_decide(loops, monkeypatch) -> None:
    def broken(*_):
        raise RuntimeError("boom")

    tower = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    watch = WeightWatch.of(tower)
    monkeypatch.setattr(native_checks, "loops", lambda: type("Broken", (), {
        "same_tensors": staticmethod(broken), "any_has_key": staticmethod(broken),
        "same_types": staticmethod(broken)})())
    assert not watch.moved() and watch.hooked() is None
    tower[1].forward = lambda x: x
    assert watch.hooked() == "1's forward, replaced on the instance"
    tower[0].weight.data = torch.zeros(4, 4)
    assert watch.moved()


def test_the_name_follows_torch_and_python(monkeypatch) -> None:
    source = native_checks.SOURCE.read_bytes()
    name = native_checks._name(source)
    assert name.startswith("vitgraph_native_checks_")
    assert native_checks._name(source + b" ") != name
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert native_checks._name(source) != name


def _in_fresh_process(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=600, check=True)
    return result.stdout.strip()


def test_off_never_builds_and_a_bad_value_is_named() -> None:
    code = ("from vit_graph_backend import native_checks as n\n"
            "print(n.loops(), n.build(), n.status(), sep='|')")
    assert _in_fresh_process(code, VITGRAPH_NATIVE_CHECKS="off") == (
        "None|None|off: VITGRAPH_NATIVE_CHECKS=off")
    out = _in_fresh_process(code, VITGRAPH_NATIVE_CHECKS="fast")
    assert out == ("None|None|off: VITGRAPH_NATIVE_CHECKS='fast' is not one of auto, off")


def test_a_failed_build_is_logged_and_the_python_checks_serve(monkeypatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("no C++ compiler\nmore")

    for name, value in (("_loops", None), ("_thread", None), ("_failed", None)):
        monkeypatch.setattr(native_checks, name, value)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.INFO, logger="vit_graph_backend.native_checks"):
        assert native_checks.build(timeout=60) is None
    assert native_checks.status() == "off: RuntimeError: no C++ compiler"
    assert "were not built (RuntimeError: no C++ compiler)" in caplog.text
    assert native_checks.loops() is None


def test_threads_asking_at_once_start_one_build(monkeypatch) -> None:
    import threading
    import time
    import types

    from torch.utils import cpp_extension

    calls = []
    fake = types.SimpleNamespace(__name__="fake", **dict.fromkeys(native_checks.LOOPS, len))

    def slow_load(**kwargs):
        calls.append(kwargs["name"])
        time.sleep(0.2)
        return fake

    for name, value in (("_loops", None), ("_thread", None), ("_failed", None)):
        monkeypatch.setattr(native_checks, name, value)
    monkeypatch.setattr(cpp_extension, "load", slow_load)

    class SlowThread(threading.Thread):  # widens the window between the check and the start
        def __init__(self, *args, **kwargs) -> None:
            time.sleep(0.01)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(native_checks, "threading", types.SimpleNamespace(Thread=SlowThread))
    start = threading.Barrier(8)
    got = []

    def ask(i: int) -> None:
        start.wait()
        native_checks.loops() if i % 2 else None
        got.append(native_checks.build(timeout=60))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [fake] * 8 and native_checks.status() == "built"


def test_the_source_ships_with_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = native_checks.SOURCE.parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    assert native_checks.SOURCE.name in data["vit_graph_backend"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "ninja"
               for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"])
