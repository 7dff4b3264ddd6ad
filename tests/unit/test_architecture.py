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

_CORE = {"errors", "specs", "budgets", "stats", "planner", "plan_preview", "assignment", "options",
         "protocol"}
#: The graph runtime's own parts, below the manager (``runtime``): stream ordering, capture with
#: its memory book, the book of served budgets and their plans, and the tensor helpers of a replay.
_GRAPH_PARTS = {"stream_order", "graph_capture", "graph_launch", "replay_io", "graph_report",
                "served_budgets", "weight_watch", "code_watch", "call_checks", "native_checks"}
_RUNTIME_DEPS = ({"planner", "budgets", "specs", "options", "protocol", "errors", "stats",
                  "_compat"} | _GRAPH_PARTS)
#: What ``backend`` may import: every layer below it.
_BELOW_BACKEND = _CORE | _GRAPH_PARTS | {"_compat", "_version", "adapters", "runtime", "batched",
                                         "batched_layout", "packed", "inner", "fp8_linear",
                                         "fused_linear", "linear_rewrite", "gpu_timing",
                                         "attention_op", "patch_rewrite"}

#: Layer of a module (its file stem, or its top folder for subpackages) -> layers it may import.
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
    # Which rank encodes which item (data parallelism): pure, like the planner.
    "assignment": {"specs", "errors"},
    "options": {"budgets", "specs", "planner", "errors"},
    "protocol": {"specs", "budgets"},
    "_compat": set(),
    # fused_linear's op: the Qwen-VL adapters run fc1 + GELU through it (it imports nothing above)
    "adapters": {"protocol", "budgets", "specs", "errors", "options", "_compat", "fused_linear",
                 "gpu_timing", "weight_watch", "code_watch", "_threaded_builds", "native_checks"},
    "stream_order": {"_compat"},
    "graph_capture": {"_compat", "graph_launch", "errors"},
    # How a captured graph is instantiated and launched (the CUDA driver through ctypes).
    "graph_launch": {"_compat"},
    "replay_io": {"planner", "protocol"},
    "graph_report": {"stats", "native_checks", "gpu_timing"},
    # Whether a module's weights still live where its graphs were captured.
    "weight_watch": {"_compat", "code_watch", "native_checks"},
    # The per-call checks' loops in C++, built on the user's machine (Python fallback).
    "native_checks": set(),
    # Whether a module tree's classes run their libraries' code (no patched forward).
    "code_watch": {"native_checks"},
    "served_budgets": {"budgets", "planner", "specs"},
    # What a manager checks for each call, before and after its graphs launch.
    "call_checks": {"replay_io", "weight_watch", "errors"},
    "runtime": _RUNTIME_DEPS,
    # The batched [B, C, H, W] layout: pads the batch axis and drives the runtime's graphs.
    "batched": _RUNTIME_DEPS | {"runtime", "batched_layout"},
    "batched_layout": {"_compat"},
    # Packed (Qwen-VL style) serving: adapters + inner compiler + runtime, one level below backend.
    "packed": _RUNTIME_DEPS | {"runtime", "adapters", "inner"},
    "inner": {"options", "errors", "_compat"},
    # quantization="fp8": a rewrite of the traced graph, applied by the backend before `inner`.
    "fp8_linear": {"errors", "_compat", "linear_rewrite"},
    # epilogue_fusion="auto": linear + GELU (or a SiLU gate) as one op, called by the adapters
    # and by the graphs the rewrite below makes; its Triton kernels (imported only when a CUDA
    # graph uses them) are the private module below it.
    "fused_linear": {"_linear_act_kernels", "gpu_timing", "_compat"},
    # attention_kernel="timed": SDPA -> the op that times SDPA against the packed towers' Triton
    # segment kernel per shape (imported only when a CUDA graph runs it).
    "attention_op": {"adapters", "fused_linear", "gpu_timing"},
    # The GPU time of a candidate kernel from a small CUDA graph's replays (the choices above).
    "gpu_timing": {"_compat", "errors"},
    # The backend's graph rewrites' walk over linear layers, and linear + GELU -> the op.
    "linear_rewrite": {"fused_linear"},
    # patch_embedding="gemm": a ViT's patch convolution -> one GEMM, PyTorch's own ops only.
    "patch_rewrite": {"_compat"},
    # Kernel configurations built side by side in threads (the Triton kernels' cold compiles).
    "_threaded_builds": set(),
    "_linear_act_kernels": {"_threaded_builds"},
    "backend": _BELOW_BACKEND,
    "__init__": _BELOW_BACKEND | {"backend", "hf", "parallel", "assignment"},
    # Integrations: one call on a whole Hugging Face model (packed serving + the backend).
    "hf": _BELOW_BACKEND | {"backend"},
    # Data parallelism over torch.distributed: packed serving + the pure assignment.
    "parallel": _BELOW_BACKEND | {"assignment"},
    "cli": _BELOW_BACKEND | {"backend", "hf", "parallel", "__init__", "benchmarking"},
    "benchmarking": _BELOW_BACKEND | {"backend", "hf", "parallel", "__init__", "cli"},
    "__main__": {"cli"},
    "testing": {"budgets", "planner", "specs", "stats", "options", "protocol", "errors"},
}

#: Third-party top-level modules -> the layers allowed to import them (absent: anyone may).
THIRD_PARTY: dict[str, set[str]] = {
    "hypothesis": {"testing"},
    "benchmarks": set(),
}
#: Layers that never import torch; ``protocol`` may, under ``TYPE_CHECKING`` only.
NO_TORCH = {"errors", "_version", "specs", "budgets", "stats", "planner", "plan_preview", "assignment",
            "options",
            "protocol"}
TORCH_UNDER_TYPE_CHECKING = {"protocol"}
#: Optional dependencies imported only lazily, inside a function, and only by these layers.
LAZY_ONLY: dict[str, set[str]] = {"torch_tensorrt": {"inner"}}
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
    "planner.py": (
        "def f():\n    from vit_graph_backend import runtime\n", "planner imports vit_graph_backend.runtime"
    ),
    "stats.py": ("import hypothesis\n", "stats imports hypothesis"),
    "runtime.py": ("import torch\nx = torch._dynamo.reset\n", "torch._dynamo.reset: private torch API"),
    "inner.py": ("import torch_tensorrt\n", "inner imports torch_tensorrt at module level"),
    "backend.py": ("from torch._inductor import config\n", "from torch._inductor import ...: private"),
    "cli.py": ("from .testing import strategies\n", "cli imports vit_graph_backend.testing"),
    "options.py": ("import benchmarks.vit_stream\n", "options imports benchmarks.vit_stream"),
    "adapters/timm_vit.py": ("from ..runtime import x\n", "adapters imports vit_graph_backend.runtime"),
    "testing/models.py": ("from .. import backend\n", "testing imports vit_graph_backend.backend"),
    "protocol.py": ("import torch\n", "protocol imports torch"),
    "batched.py": ("import torch as t\nt.cuda._lazy_init()\n", "t.cuda._lazy_init: private torch API"),
    "newthing.py": ("x = 1\n", "layer 'newthing' has no row"),
}

ALLOWED = {
    "protocol.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    "inner.py": "def trt():\n    import torch_tensorrt\n    return torch_tensorrt\n",
    "_compat.py": "import torch\nfrom torch._dynamo import reset\nx = torch._C\n",
    "testing/strategies.py": "from hypothesis import strategies\nfrom ..budgets import x\nfrom . import models\n",
    "runtime.py": "import torch\nx = torch.__version__\nfrom . import _compat\n",
    "adapters/__init__.py": "from .qwen import adapt\nfrom .. import budgets\n",
    "__init__.py": "from ._version import __version__\nfrom .backend import vitgraph\n",
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
        if stem in ("adapters", "testing", "benchmarking"):
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
