"""The project's import-layer table, enforced over ``src/vit_graph_backend`` by reading the AST.

The table is data (:data:`LAYERS`): a new module gets one row, naming what it may import. A module
without a row fails :func:`test_import_layers` with a message asking for one; a row without a
module is simply not checked. Every import counts, including those inside functions and under
``TYPE_CHECKING``: the table is about which concepts a module depends on, not only about what is
loaded at import time. Third-party rules sit beside it:

- ``torch._*`` (private attributes and ``from torch._x import``) appears only in ``_compat``;
- the pure core (:data:`NO_TORCH`) never imports torch; ``protocol`` only under ``TYPE_CHECKING``;
- ``hypothesis`` only in ``testing``; ``torch_tensorrt`` only inside a function of ``inner``;
- nothing imports ``benchmarks`` (the repository's scripts folder, not part of the package).

No test here imports the modules it checks, so it also covers modules whose optional dependencies
are missing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import vit_graph_backend

SRC = Path(vit_graph_backend.__file__).resolve().parent
PACKAGE = "vit_graph_backend"

#: The pure core: value types, budgets, the planner, options, the protocol; ``_compat`` is the
#: one door to private PyTorch, which every layer above may use.
_CORE = {"errors", "_version", "specs", "budgets", "stats", "planner", "plan_preview", "options",
         "protocol", "_compat", "cache_dir"}

#: Layer of a module (its file stem at the top, or its sub-package) -> layers it may import. The
#: direction: core -> runtime -> kernels -> adapters -> compile -> integrations -> bench and cli.
#: ``__init__`` is the package itself (``from vit_graph_backend import x``, ``from .. import x``).
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "specs": {"errors"},
    "budgets": {"specs", "errors"},
    "stats": set(),
    "planner": {"budgets", "specs", "errors"},
    # What the planner does with a call or a stream, for `vitgraph plan` and the bench: pure.
    "plan_preview": {"budgets", "planner", "specs", "stats"},
    "options": {"budgets", "specs", "planner", "errors"},
    "protocol": {"specs", "budgets"},
    "_compat": set(),
    # Where compiled kernels are kept between processes: pure, no torch.
    "cache_dir": set(),
    # The graph runtime: the manager and its parts, the weights contract, inner compilers.
    "runtime": _CORE,
    # The package's kernels and their choice per shape, timed with the runtime's timing.
    "kernels": _CORE | {"runtime"},
    # Packed towers: the registry, the Qwen body and families, serve().
    "adapters": _CORE | {"runtime", "kernels"},
    # torch.compile: the backend, batched graphs, graph rewrites; report() counts served towers.
    "compile": _CORE | {"runtime", "kernels", "adapters"},
    # Hugging Face models in place, and torch.distributed.
    "integrations": _CORE | {"runtime", "kernels", "adapters", "compile"},
    "__init__": _CORE | {"adapters", "compile", "integrations"},
    # Hypothesis strategies and checks for users' suites.
    "testing": _CORE | {"runtime", "adapters"},
    "bench": _CORE | {"runtime", "kernels", "adapters", "compile", "integrations", "__init__"},
    "cli": _CORE | {"runtime", "kernels", "adapters", "compile", "integrations", "__init__",
                    "bench"},
    "__main__": {"cli"},
}

#: Third-party top-level modules -> the layers allowed to import them (absent: anyone may).
THIRD_PARTY: dict[str, set[str]] = {
    "hypothesis": {"testing"},
    "benchmarks": set(),
}
#: Layers that never import torch; ``protocol`` may, under ``TYPE_CHECKING`` only.
NO_TORCH = {"errors", "_version", "specs", "budgets", "stats", "planner", "plan_preview",
            "options", "protocol"}
TORCH_UNDER_TYPE_CHECKING = {"protocol"}
#: Optional dependencies imported only lazily, inside a function, and only by these layers.
LAZY_ONLY: dict[str, set[str]] = {"torch_tensorrt": {"runtime"}}
PRIVATE_TORCH = {"_compat"}


@dataclass(frozen=True)
class Import:
    """One imported module, resolved to an absolute dotted name."""

    module: str
    line: int
    in_function: bool
    type_checking: bool


def layer_of(path: Path, root: Path) -> str:
    """``budgets.py`` -> ``budgets``; ``adapters/qwen.py`` -> ``adapters``; ``__init__.py`` -> ``__init__``."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else path.stem


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def collect_imports(tree: ast.Module, name: str, is_package: bool) -> list[Import]:
    """Every import in ``tree``, with relative ones resolved against module ``name``."""
    found: list[Import] = []
    base = name.split(".") if is_package else name.split(".")[:-1]

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, in_function, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one, else a
            # name defined in ``pkg``: record ``pkg.sub`` and let :func:`target_layer` decide.
            for alias in node.names:
                found.append(Import(f"{target}.{alias.name}", node.lineno, in_function, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_checking)

    visit(tree, False, False)
    return found


def target_layer(module: str, root: Path, package: str) -> str | None:
    """The package layer ``module`` belongs to, or ``None`` outside the package."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    if len(parts) == 1:
        return "__init__"
    head = parts[1]
    if (root / f"{head}.py").exists() or (root / head / "__init__.py").exists():
        return head
    return "__init__"  # a name defined in the package's __init__: ``from .. import __version__``


def private_torch_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """``torch._x`` attribute chains (any private segment) and imports of ``torch._x``."""
    aliases = {"torch"}
    uses: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases.add((alias.asname or alias.name).split(".")[0])
                if any(_private(p) for p in alias.name.split(".")[1:]) and alias.name.startswith("torch."):
                    uses.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] == "torch":
                names = parts[1:] + [a.name for a in node.names]
                if any(_private(p) for p in names):
                    uses.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases and any(_private(a) for a in chain):
                uses.append((node.lineno, ".".join([cur.id, *reversed(chain)])))
    return sorted(set(uses))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def check_package(root: Path, package: str = PACKAGE) -> list[str]:
    """Every violation of the rules above in the package at ``root``, one line each."""
    problems: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        layer = layer_of(path, root)
        if layer not in LAYERS:
            problems.append(
                f"{rel}: layer {layer!r} has no row in LAYERS (tests/unit/test_architecture.py); "
                "add one naming the layers it may import"
            )
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        name = module_name(path, root, package)
        allowed = LAYERS[layer] | {layer}  # a subpackage may import its own modules
        for imp in collect_imports(tree, name, path.name == "__init__.py"):
            top = imp.module.split(".")[0]
            target = target_layer(imp.module, root, package)
            where = f"{rel}:{imp.line}"
            if target is not None and target not in allowed:
                problems.append(f"{where}: {layer} imports {imp.module} (layer {target}), not allowed")
            if top in THIRD_PARTY and layer not in THIRD_PARTY[top]:
                problems.append(f"{where}: {layer} imports {imp.module}; only {sorted(THIRD_PARTY[top])} may")
            if top == "torch" and layer in NO_TORCH:
                if not (layer in TORCH_UNDER_TYPE_CHECKING and imp.type_checking):
                    problems.append(f"{where}: {layer} imports torch; it must stay pure Python")
            if top in LAZY_ONLY and (layer not in LAZY_ONLY[top] or not imp.in_function):
                problems.append(
                    f"{where}: {layer} imports {top} {'in a function' if imp.in_function else 'at module level'}; "
                    f"only inside a function of {sorted(LAZY_ONLY[top])}"
                )
        if layer not in PRIVATE_TORCH:
            for line, use in private_torch_uses(tree):
                problems.append(f"{rel}:{line}: {use}: private torch API outside _compat")
    return sorted(set(problems))


def test_import_layers():
    problems = check_package(SRC)
    assert not problems, "\n".join(problems)


def test_the_check_sees_the_package():
    """Guard against checking nothing: the core modules are found and have rows."""
    layers = {layer_of(p, SRC) for p in SRC.rglob("*.py")}
    assert {"errors", "specs", "budgets", "planner", "stats", "protocol", "testing"} <= layers



# --- the checker catches what it should ---------------------------------------------------------

VIOLATIONS = {
    "budgets.py": ("from .planner import plan_batches\n", "budgets imports vit_graph_backend.planner"),
    "specs.py": ("import torch\n", "specs imports torch"),
    "planner.py": ("def f():\n    from vit_graph_backend import runtime\n",
                   "planner imports vit_graph_backend.runtime"),
    "stats.py": ("import hypothesis\n", "stats imports hypothesis"),
    "runtime/manager.py": ("import torch\nx = torch._dynamo.reset\n",
                           "torch._dynamo.reset: private torch API"),
    "runtime/inner.py": ("import torch_tensorrt\n", "runtime imports torch_tensorrt at module level"),
    "runtime/capture.py": ("from ..kernels import fused_linear\n",
                           "runtime imports vit_graph_backend.kernels.fused_linear"),
    "kernels/fused_linear.py": ("from ..adapters import qwen\n",
                                "kernels imports vit_graph_backend.adapters.qwen"),
    "compile/backend.py": ("from torch._inductor import config\n",
                           "from torch._inductor import ...: private"),
    "compile/batched.py": ("from ..integrations import hf\n",
                           "compile imports vit_graph_backend.integrations.hf"),
    "cli.py": ("from .testing import strategies\n", "cli imports vit_graph_backend.testing"),
    "options.py": ("import benchmarks.vit_stream\n", "options imports benchmarks.vit_stream"),
    "adapters/timm_vit.py": ("from ..compile import backend\n",
                             "adapters imports vit_graph_backend.compile.backend"),
    "testing/models.py": ("from ..compile import backend\n",
                          "testing imports vit_graph_backend.compile.backend"),
    "protocol.py": ("import torch\n", "protocol imports torch"),
    "compile/layout.py": ("import torch as t\nt.cuda._lazy_init()\n",
                          "t.cuda._lazy_init: private torch API"),
    "newthing.py": ("x = 1\n", "layer 'newthing' has no row"),
}

ALLOWED = {
    "protocol.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    "runtime/inner.py": "def trt():\n    import torch_tensorrt\n    return torch_tensorrt\n",
    "_compat.py": "import torch\nfrom torch._dynamo import reset\nx = torch._C\n",
    "testing/strategies.py": "from hypothesis import strategies\nfrom ..budgets import x\n"
                             "from . import models\n",
    "runtime/manager.py": "import torch\nx = torch.__version__\nfrom .. import _compat\n"
                          "from .capture import x\n",
    "kernels/fused_linear.py": "from ..runtime import timing\n",
    "adapters/__init__.py": "from .qwen import adapt\nfrom .. import budgets\n"
                            "from ..kernels import fused_linear\n",
    "__init__.py": "from ._version import __version__\nfrom .compile import vitgraph\n",
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != root and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text("")
        path.write_text(source)
    # Every layer exists, so imports of it resolve.
    for stem in LAYERS:
        if stem in ("runtime", "kernels", "adapters", "compile", "integrations", "testing",
                    "bench"):
            (root / stem).mkdir(exist_ok=True)
            (root / stem / "__init__.py").touch()
        elif not stem.startswith("__"):
            (root / f"{stem}.py").touch()


@pytest.mark.parametrize("rel", sorted(VIOLATIONS))
def test_checker_reports_violation(tmp_path, rel):
    source, expected = VIOLATIONS[rel]
    _write(tmp_path, {rel: source})
    problems = check_package(tmp_path)
    assert any(expected in p for p in problems), problems


def test_checker_accepts_allowed_imports(tmp_path):
    _write(tmp_path, ALLOWED)
    assert check_package(tmp_path) == []
