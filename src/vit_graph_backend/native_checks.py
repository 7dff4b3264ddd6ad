"""The per-call checks' loops in C++, built on the user's machine, with the Python ones as
fallback.

Before and after every packed call the graphs' checks look at hundreds of objects: the
addresses of the weights the graphs read (``weight_watch.py``), the addresses and version
counters of the tensors the padded MLP copies are made from (``adapters/_aligned_mlp.py``), and
each module's class and instance ``forward``. In Python each look is one C-level call through
``map``, 50 to 100 ns apiece, and there is no batch API in PyTorch that reads many tensors'
addresses or version counters at once (``torch._C._tensors_data_ptrs_at_indices_equal`` casts
each tensor through pybind and costs as much). The loops of ``native_checks.cpp`` do the same
looks in one call each, in a third to a fifth of the time (on an H200's host
``WeightWatch.moved()`` took 9.2 against 29 to 32 us, the padded copies' check 5.5 against 28.7:
``benchmarks/results/per_call_checks_native_loops_vs_python_checks_in_process_*``).

They answer one question, "is everything as it was?", and only a "yes" is taken from them: a
"no", an error or no build sends the caller to its Python check, which finds what changed and
says so. So a build changes how fast a call is checked, never what the check decides
(``tests/unit/test_native_checks.py`` compares the two on random changes).

The source is compiled once per machine by ``torch.utils.cpp_extension.load`` (it needs a C++
compiler and ``ninja``; 8 s on an H200's host), into PyTorch's extension cache
(``TORCH_EXTENSIONS_DIR``), under a name made of the source's and the running torch's and
Python's versions, so an upgrade builds anew. The build starts in a background thread the first time a check asks for the
loops, and the Python checks serve until it is done. A build that fails is logged once, with
the reason, and the Python checks serve the process.

``VITGRAPH_NATIVE_CHECKS=off`` keeps the build from ever starting (the Python checks only);
the default is ``auto``. :func:`status` says where the build stands (``vit_graph_backend.report()``
shows it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["ENV", "LOOPS", "any_has_key", "build", "loops", "same_attributes", "same_dicts",
           "same_entries", "same_tensors", "same_types", "status"]

log = logging.getLogger(__name__)

#: The environment variable that turns the build off (``off``) or leaves it to need (``auto``).
ENV = "VITGRAPH_NATIVE_CHECKS"
_VALUES = ("auto", "off")
SOURCE = Path(__file__).with_name("native_checks.cpp")
#: The loops the source defines.
LOOPS = ("same_tensors", "same_dicts", "same_entries", "same_attributes", "any_has_key",
         "same_types")

_lock = threading.Lock()
_loops: Any = None
_thread: threading.Thread | None = None
_failed: str | None = None


def _setting() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in _VALUES:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(_VALUES)}")
    return value


def _name(source: bytes) -> str:
    """The extension's name: the source and the runtime it is built for (an upgrade of torch or
    Python gets a build of its own instead of loading one made against another ABI)."""
    digest = hashlib.sha256(source)
    for part in (torch.__version__, torch.version.git_version or "", sys.version):
        digest.update(b"\0" + part.encode())
    return f"vitgraph_native_checks_{digest.hexdigest()[:16]}"


def _build() -> None:
    global _loops, _failed
    try:
        from torch.utils import cpp_extension

        source = SOURCE.read_bytes()
        if shutil.which("ninja") is None:  # the ninja package's, in a venv not activated
            found = getattr(__import__("ninja"), "BIN_DIR", "")
            if found:
                os.environ["PATH"] += os.pathsep + found
        with warnings.catch_warnings():  # its notes about CUDA_HOME and the compiler
            warnings.simplefilter("ignore")
            loops = cpp_extension.load(name=_name(source), sources=[str(SOURCE)],
                                       extra_cflags=["-O2"], is_python_module=True,
                                       verbose=False)
        for name in LOOPS:
            getattr(loops, name)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the Python checks
        _failed = f"{type(exc).__name__}: {exc}".split("\n")[0]
        log.info("vitgraph: the native checks were not built (%s); the Python checks serve "
                 "(%s=off skips the build)", _failed, ENV)
        return
    _loops = loops
    log.info("vitgraph: native checks built (%s)", loops.__name__)


def loops() -> Any:
    """The built loops (:data:`LOOPS`), or ``None`` while they are not built: the first call
    starts the build in a background thread, unless ``VITGRAPH_NATIVE_CHECKS=off``."""
    if _thread is None and _failed is None:
        _start()
    return _loops


def _start() -> threading.Thread | None:
    global _thread, _failed
    with _lock:
        if _thread is None and _loops is None and _failed is None:
            try:
                setting = _setting()
            except ValueError as exc:
                _failed = str(exc)
                log.warning("vitgraph: %s; the Python checks serve", exc)
                return None
            if setting == "off":
                _failed = f"{ENV}=off"
                return None
            _thread = threading.Thread(target=_build, name="vitgraph-native-checks", daemon=True)
            _thread.start()
        return _thread


def build(timeout: float | None = None) -> Any:
    """Build the loops now (or wait for the build under way) and return them; ``None`` if they
    cannot be built here or are turned off (:func:`status` says why). For benchmarks and tests:
    a serving process need not call it."""
    thread = _start()
    if thread is not None:
        thread.join(timeout)
    return _loops


def status() -> str:
    """``"built"``, ``"building"``, ``"not started"``, or ``"off: REASON"``."""
    if _loops is not None:
        return "built"
    if _failed is not None:
        return f"off: {_failed}"
    return "building" if _thread is not None else "not started"



def _ask(name: str, *args: Any) -> bool | None:
    """The loop ``name``'s answer; ``None`` without the loops, or where it raised (bad
    arguments, or an attribute read that failed: the caller's Python check meets it again)."""
    built = loops()
    if built is None:
        return None
    try:
        return bool(getattr(built, name)(*args))
    except Exception:  # noqa: BLE001 - the caller's Python check decides
        return None


def same_tensors(tables: tuple[Any, ...], names: tuple[str, ...], addresses: tuple[int, ...],
                 versions: tuple[int, ...] | None) -> bool:
    """True if the loops are built and find every ``tables[i][names[i]]`` a tensor at
    ``addresses[i]`` (with ``versions``: at version ``versions[i]``, or ``None`` where both are
    -1); False for a change, a doubt or no loops: the caller's Python check then decides."""
    return _ask("same_tensors", tables, names, addresses, versions) is True


def same_dicts(dicts: tuple[dict[Any, Any], ...], copies: tuple[dict[Any, Any], ...]) -> bool:
    """True if the loops find each dict holding its copy's keys and values, by identity and in
    order; False otherwise (the caller compares with ``==``)."""
    return _ask("same_dicts", dicts, copies) is True


def same_entries(tables: tuple[dict[Any, Any], ...], names: tuple[Any, ...],
                 saved: tuple[Any, ...]) -> bool:
    """True if the loops find ``tables[i].get(names[i]) is saved[i]`` for every ``i``."""
    return _ask("same_entries", tables, names, saved) is True


def same_attributes(owners: tuple[Any, ...], names: tuple[str, ...],
                    saved: tuple[Any, ...]) -> bool:
    """True if the loops find ``getattr(owners[i], names[i], None) is saved[i]`` for every
    ``i``."""
    return _ask("same_attributes", owners, names, saved) is True


def any_has_key(dicts: tuple[dict[str, Any], ...], key: str) -> bool | None:
    """Whether ``key`` is in any of ``dicts``; ``None`` without the loops (or on an error)."""
    return _ask("any_has_key", dicts, key)


def same_types(objects: tuple[Any, ...], types: tuple[type, ...]) -> bool | None:
    """Whether ``type(objects[i]) is types[i]`` for every ``i``; ``None`` without the loops
    (or on an error)."""
    return _ask("same_types", objects, types)
