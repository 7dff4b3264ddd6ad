"""One folder, owned by the user, for what a process keeps for the next: Inductor's and Triton's
compiled kernels, which make a second process's first pass fast (``docs/performance.md``, first
pass).

Compiled kernels are code that a later process loads and runs, so the folder must be one that
no other user can write: :func:`use_cache_dir` creates it readable by its owner only and refuses
(one warning, then compiling without it) a folder that is not the user's own or that others
can write. Inductor and Triton key what they keep by the graph, the torch and Triton versions and
the device; the folder adds the torch version, so two torch releases never share one.
"""

from __future__ import annotations

import logging
import os
import stat
from importlib import metadata
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "default_cache_dir", "unsafe_reason", "use_cache_dir"]

log = logging.getLogger("vit_graph_backend")

#: The environment variable that names the folder (else :func:`default_cache_dir`).
CACHE_DIR_ENV = "VITGRAPH_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$VITGRAPH_CACHE_DIR``, else ``vit_graph_backend`` in the user's cache folder
    (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    named = os.environ.get(CACHE_DIR_ENV)
    if named:
        return Path(named).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vit_graph_backend"


def unsafe_reason(path: Path) -> str | None:
    """Why kernels must not be loaded from folder ``path``, or ``None`` if it is safe: a symbolic
    link, not a folder, owned by another user, or writable by the group or others."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    uid = getattr(os, "getuid", None)
    if uid is not None and info.st_uid != uid():
        return f"it belongs to user id {info.st_uid}, not to this process's ({uid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"others can write it (mode {stat.S_IMODE(info.st_mode):o}; "
                "chmod 700 makes it the owner's alone)")
    return None


def use_cache_dir(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Keep Inductor's and Triton's compiled kernels in ``path`` (default:
    :func:`default_cache_dir`), under a folder per torch version, for this process and the next.

    Call it before the first compile: it sets ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TRITON_CACHE_DIR``, which they read when they compile. Creates missing folders readable by
    their owner only. Returns the folder used; ``None`` (after one warning naming the folder and
    why) if ``path`` or a folder inside it is unsafe, leaving the environment as it was.
    """
    root = Path(path).expanduser() if path is not None else default_cache_dir()
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = "unknown"
    keyed = root / f"torch-{version}"
    folders = {"TORCHINDUCTOR_CACHE_DIR": keyed / "inductor", "TRITON_CACHE_DIR": keyed / "triton"}
    for folder in (root, keyed, *folders.values()):
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True)
            folder.chmod(0o700)   # mkdir's mode passes through the umask
        reason = unsafe_reason(folder)
        if reason is not None:
            log.warning("vitgraph: not keeping compiled kernels in %s: %s; compiling without "
                        "that cache", folder, reason)
            return None
    os.environ.update({name: str(folder) for name, folder in folders.items()})
    return keyed
