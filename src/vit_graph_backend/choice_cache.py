"""``fused_linear``'s per-shape choices kept across processes, so a warm process times nothing.

``fused_linear`` times every candidate kernel of a (shape, activation) the first time the shape
runs: about 40 ms a shape. A CLIP ViT-L/14-336 first pass meets 18 shapes, 0.76 s of its warm first
pass (``benchmarks/results/clip_l14_336_first_pass_warm_cprofile_top_functions_*``), although
Inductor's and Triton's caches made everything else warm. The winners are kept here, in one JSON
file, and a later process takes a shape's winner from it instead of timing again.

- **Where.** ``$VITGRAPH_CACHE_DIR/linear_act_choices.json``; without that variable, a ``vitgraph``
  folder in Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default), so that a
  fresh Inductor cache is a fresh one of these too. ``VITGRAPH_CACHE_DIR=""`` turns the file off:
  every process times its shapes.
- **What a key holds.** The GPU's name and compute capability, the torch, Triton and package
  versions, the candidate set, and the shape, dtype, activation and bias: a winner is reused only
  where it was measured under the same conditions. A value that is no candidate any more is
  ignored (the shape is timed again).
- **Safety.** Every candidate computes the same function, so a stale winner can only cost speed,
  never change a result. The file is read once per process and written whole through a temporary
  file and ``os.replace``, merged with what other processes wrote meanwhile (several ranks of one
  job); a write that loses a race loses entries, which are timed again later. Any I/O or parse
  error leaves the file alone and is logged once at DEBUG: the cache never fails a call.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from . import _compat

__all__ = ["ENV", "FILE", "ChoiceCache", "cache_path"]

log = logging.getLogger(__name__)

#: The environment variable naming the folder ("" turns the file off).
ENV = "VITGRAPH_CACHE_DIR"
#: The file's name in that folder.
FILE = "linear_act_choices.json"


def cache_path() -> Path | None:
    """The file the choices are kept in now, or ``None`` when ``VITGRAPH_CACHE_DIR=""``."""
    folder = os.environ.get(ENV)
    if folder is None:
        folder = os.path.join(_compat.inductor_cache_dir(), "vitgraph")
    return Path(folder) / FILE if folder else None


class ChoiceCache:
    """The choices of one file: read on first use, written through on every new entry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._entries: dict[str, Any] = {}
        self._loaded = False
        self._failed = False

    def get(self, key: str) -> Any:
        """The stored choice for ``key`` (lists become tuples), or ``None``."""
        with self._lock:
            self._load()
            value = self._entries.get(key)
        return tuple(value) if isinstance(value, list) else value

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (a string or a tuple of ints) for ``key`` and write the file."""
        with self._lock:
            self._load()
            stored = list(value) if isinstance(value, tuple) else value
            if self._path is None or self._entries.get(key) == stored:
                return
            self._entries[key] = stored
            try:
                on_disk = self._read(self._path)  # other processes' entries since our read
                on_disk.update(self._entries)
                self._path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".choices-")
                with os.fdopen(fd, "w") as f:
                    json.dump(on_disk, f, indent=0, sort_keys=True)
                os.replace(tmp, self._path)
                self._entries = on_disk
            except OSError as exc:
                self._fail(f"could not write {self._path}: {exc}")

    def _load(self) -> None:
        path = cache_path()
        if self._loaded and path == self._path:
            return
        self._path, self._loaded, self._entries = path, True, {}
        if path is not None and path.exists():
            try:
                self._entries = self._read(path)
            except OSError as exc:
                self._fail(f"could not read {path}: {exc}")

    def _read(self, path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:  # a torn or foreign file: start over, it is only a cache
            self._fail(f"ignored {path}: {exc}")
            return {}
        return data if isinstance(data, dict) else {}

    def _fail(self, message: str) -> None:
        if not self._failed:
            self._failed = True
            log.debug("vitgraph: linear choice cache: %s", message)
