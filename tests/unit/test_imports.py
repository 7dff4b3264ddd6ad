"""Every module imports; the public surface is explicit; importing the package is lean.

- Each module found by walking ``src/vit_graph_backend`` with :mod:`pkgutil` is imported, so a
  moved or broken module fails here, not in a user's process. Nothing is skipped silently: a
  module that needs an optional dependency is listed in :data:`OPTIONAL_DEPENDENCIES`, and is
  skipped with that reason only when the dependency is missing. ``__main__`` is imported too, so
  it must guard its command line with ``if __name__ == "__main__"``.
- ``from vit_graph_backend import *`` works, ``__all__`` is sorted, and every public class and
  function has its own docstring.
- In a fresh interpreter, ``import vit_graph_backend`` imports none of the optional or heavy
  dependencies and does not initialize CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import vit_graph_backend

PACKAGE = vit_graph_backend.__name__

#: Modules that import an optional dependency at import time -> that dependency's module name.
#: Listed here, they are skipped (with the reason in the report) only where it is not installed.
OPTIONAL_DEPENDENCIES: dict[str, str] = {
    f"{PACKAGE}.testing": "hypothesis",
    f"{PACKAGE}.testing.strategies": "hypothesis",
    f"{PACKAGE}.kernels._linear_act_triton": "triton",
    f"{PACKAGE}.kernels._segment_attention_triton": "triton",
    f"{PACKAGE}.kernels._short_attention_triton": "triton",
}

#: Never imported by ``import vit_graph_backend``: optional, test-only or heavy dependencies.
LAZY_DEPENDENCIES = ("hypothesis", "torch_tensorrt", "timm", "transformers", "triton")


def _walk() -> list[str]:
    names = [PACKAGE]
    for info in pkgutil.walk_packages(vit_graph_backend.__path__, prefix=f"{PACKAGE}."):
        names.append(info.name)
    # walk_packages skips a subpackage that fails to import without a word; list every
    # subpackage folder's modules by hand too, so a broken __init__ cannot hide its modules.
    for path in vit_graph_backend.__path__:
        for info in pkgutil.iter_modules([path]):
            if info.ispkg:
                sub = f"{PACKAGE}.{info.name}"
                folder = f"{path}/{info.name}"
                names.extend(f"{sub}.{m.name}" for m in pkgutil.iter_modules([folder]))
    return sorted(set(names))


MODULES = _walk()
def _import(name: str):
    return importlib.import_module(name)


def test_the_walk_finds_the_core_modules():
    for name in ("budgets", "errors", "planner", "protocol", "specs", "stats", "testing"):
        assert f"{PACKAGE}.{name}" in MODULES


def test_every_source_file_is_a_walked_module():
    """A folder without ``__init__.py`` is not a package: setuptools would not ship it."""
    root = Path(vit_graph_backend.__file__).parent
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join([PACKAGE, *parts])
        assert name in MODULES, f"{path} is not importable as {name} (missing __init__.py?)"


def test_listed_modules_exist():
    """The lists above stay true: an entry for a module that is gone is an error."""
    for name in OPTIONAL_DEPENDENCIES:
        assert name in MODULES, f"{name} is listed but not in the package"


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name, monkeypatch):
    dependency = OPTIONAL_DEPENDENCIES.get(name)
    if dependency is not None and importlib.util.find_spec(dependency) is None:
        pytest.skip(f"{name} needs the optional dependency {dependency!r}, which is not installed")
    # ``__main__`` must run the CLI only under ``if __name__ == "__main__"``; if it does not,
    # importing it here runs ``--help`` and exits, which fails this test with a clear message.
    monkeypatch.setattr(sys, "argv", ["vitgraph", "--help"])
    try:
        module = _import(name)
    except SystemExit:
        pytest.fail(f"importing {name} ran a command line; guard it with if __name__ == '__main__'")
    if _is_public(name):
        assert module.__doc__, f"{name} has no module docstring"


def _is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split(".")[1:])


def _is_sorted(names: list[str]) -> bool:
    """Plain ``sorted()`` order, or ruff's RUF022 "isort-style" order (CONSTANTS, Classes, rest)."""

    def isort_key(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)

    return names == sorted(names) or names == sorted(names, key=isort_key)


def test_sorted_accepts_both_conventions_and_nothing_else():
    assert _is_sorted(["Batch", "POLICIES", "Plan", "plan_batches"])
    assert _is_sorted(["POLICIES", "Batch", "Plan", "plan_batches"])
    assert not _is_sorted(["Plan", "Batch"])
    assert not _is_sorted(["plan_batches", "Batch"])


def _own_docstring(obj: object) -> str | None:
    doc = obj.__doc__
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        # A dataclass without a docstring gets its signature as one: "Name(field: type, ...)".
        if doc and doc.startswith(f"{obj.__name__}("):
            return None
    return doc


@pytest.mark.parametrize("name", MODULES)
def test_module_all_is_sorted_public_and_documented(name):
    dependency = OPTIONAL_DEPENDENCIES.get(name)
    if dependency is not None and importlib.util.find_spec(dependency) is None:
        pytest.skip(f"{name} needs the optional dependency {dependency!r}, which is not installed")
    module = _import(name)
    if not _is_public(name):
        return  # private modules need no __all__
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} is public and has no __all__"
    assert _is_sorted(list(exported)), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    for attr in exported:
        assert not (attr.startswith("_") and not attr.startswith("__")), f"{name}.__all__ has {attr}"
        obj = getattr(module, attr)  # raises if __all__ names something missing
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert _own_docstring(obj), f"{name}.{attr} has no docstring"


def test_star_import_gives_exactly_all():
    namespace: dict[str, object] = {}
    exec(f"from {PACKAGE} import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(vit_graph_backend.__all__)
    assert vit_graph_backend.__all__ == sorted(vit_graph_backend.__all__)


@pytest.mark.parametrize("attr", vit_graph_backend.__all__)
def test_every_top_level_name_has_a_docstring(attr):
    obj = getattr(vit_graph_backend, attr)
    if attr.startswith("__"):
        assert isinstance(obj, str)  # __version__
        return
    assert not isinstance(obj, types.ModuleType), f"{attr} is a module, export its names instead"
    assert _own_docstring(obj), f"vit_graph_backend.{attr} has no docstring"


def test_import_is_lean_and_does_not_initialize_cuda():
    """In a fresh interpreter, ``import vit_graph_backend`` loads no optional dependency and
    never asks torch to initialize CUDA.

    ``torch.cuda.is_initialized()`` alone cannot fail on a machine without CUDA (like CI), so
    the import also runs under a spy on ``torch.cuda._lazy_init``: every Python path that
    initializes CUDA (``torch.cuda.init()``, a tensor on a CUDA device, ``current_device()``) goes
    through it, on any machine. torch is imported first for the spy; torch itself imports none of
    the dependencies checked here.
    """
    script = textwrap.dedent(
        f"""
        import sys
        import torch, torch.cuda
        calls = []
        original = torch.cuda._lazy_init
        def spy():
            calls.append(1)
            return original()
        torch.cuda._lazy_init = spy
        import {PACKAGE}
        loaded = [m for m in {LAZY_DEPENDENCIES!r} + ("{PACKAGE}.testing",) if m in sys.modules]
        print(repr((loaded, len(calls), torch.cuda.is_initialized())))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    loaded, lazy_init_calls, cuda_initialized = eval(result.stdout.strip().splitlines()[-1])
    assert loaded == [], f"import {PACKAGE} imported {loaded}"
    assert lazy_init_calls == 0, f"import {PACKAGE} asked torch to initialize CUDA"
    assert cuda_initialized is False, f"import {PACKAGE} initialized CUDA"


def test_package_import_leaves_torch_for_the_names_that_need_it():
    """``import vit_graph_backend`` imports no torch; ``serve`` and ``PackedGraphEncoder`` load
    it on first access (PEP 562), and an unknown name still raises ``AttributeError``."""
    code = textwrap.dedent(f"""
        import sys
        import {PACKAGE} as pkg
        before = "torch" in sys.modules
        serve = pkg.serve
        from {PACKAGE}.adapters.serve import serve as real
        try:
            pkg.no_such_name
            missing = "no error"
        except AttributeError as exc:
            missing = str(exc)
        print(repr((before, serve is real, "torch" in sys.modules, "PackedGraphEncoder" in dir(pkg),
                    missing)))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    before, same, after, listed, missing = eval(result.stdout.strip().splitlines()[-1])
    assert before is False, "import vit_graph_backend imported torch"
    assert same and after and listed
    assert missing == f"module {PACKAGE!r} has no attribute 'no_such_name'"