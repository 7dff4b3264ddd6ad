"""One folder, owned by the user, for what a process keeps for the next: Inductor's and Triton's
compiled kernels, which make a second process's first pass fast (``docs/performance.md``, first
pass). Under a compile job id of the user's (``TORCH_COMPILE_JOB_ID``) Dynamo keeps its record of
which sizes turned dynamic there too; none is set here: a later process would then trace the
dynamic graph, and so compile and capture every budget, in its first call
(``docs/performance.md``, first pass).

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


def unsafe_reason(path: Path, *, parent: bool = False) -> str | None:
    """Why kernels must not be loaded from folder ``path``, or ``None`` if it is safe: a symbolic
    link, not a folder, owned by another user, or writable by the group or others. ``parent``:
    ``path`` holds the cache folder; it may also belong to root, and be writable by others if
    sticky (``/tmp``: none can rename or remove what another made there)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    getuid = getattr(os, "getuid", None)   # None on Windows: no owners to compare
    if getuid is not None and info.st_uid not in {getuid(), *((0,) if parent else ())}:
        return f"it belongs to user id {info.st_uid}, not to this process's ({getuid()})"
    sticky = parent and info.st_mode & stat.S_ISVTX
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        return (f"others can write it (mode {stat.S_IMODE(info.st_mode):o}); remove it and let "
                "it be made again, readable by its owner only")
    return None


def use_cache_dir(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Keep Inductor's and Triton's compiled kernels (and, under a compile job id, Dynamo's record
    of dynamic sizes) in ``path`` (default: :func:`default_cache_dir`), under a folder per torch
    version, for this process and the next.

    Call it before the first compile: it sets ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TRITON_CACHE_DIR``, which they read when they compile. Creates missing folders readable by
    their owner only. Every folder from the root down to the caches is checked: a link, another
    user's folder or one others can write (a sticky ``/tmp`` aside) is refused. Returns the
    folder used; ``None`` (after one warning naming the folder and why) where a folder is unsafe
    or cannot be made, leaving the environment as it was.
    """
    try:
        root = Path(os.path.abspath(Path(path).expanduser() if path is not None
                                    else default_cache_dir()))
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            version = "unknown"
        keyed = root / f"torch-{version}"
        folders = {"TORCHINDUCTOR_CACHE_DIR": keyed / "inductor",
                   "TRITON_CACHE_DIR": keyed / "triton"}
        holders = list(reversed(root.parents))   # what holds the root: none may be swapped
        for folder in (*holders, root, keyed, *folders.values()):
            try:
                folder.mkdir(mode=0o700)
                folder.chmod(0o700)   # mkdir's mode passes through the umask
            except FileExistsError:   # made before, or by another process starting alongside
                pass
            reason = unsafe_reason(folder, parent=folder in holders)
            if reason is not None:
                return _refused(folder, reason)
    except (OSError, RuntimeError) as exc:   # no home folder, no permission, a full disk
        return _refused(path if path is not None else CACHE_DIR_ENV, f"{type(exc).__name__}: {exc}")
    os.environ.update({name: str(folder) for name, folder in folders.items()})
    return keyed


def _refused(folder: object, reason: str) -> None:
    log.warning("vitgraph: not keeping compiled kernels in %s: %s; compiling without that cache",
                folder, reason)
    return None
