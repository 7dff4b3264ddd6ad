"""One folder, owned by the user, for what a process keeps for the next: Inductor's and Triton's
compiled kernels, which make a second process's first pass fast (``docs/performance.md``, first
pass), and the package's kernel choices (:func:`kept_choice`), which spare it the timings. Under a
compile job id of the user's (``TORCH_COMPILE_JOB_ID``) Dynamo keeps its record of which sizes
turned dynamic there too; none is set here: a later process would then trace the dynamic graph,
and so compile and capture every budget, in its first call (``docs/performance.md``, first pass).

Compiled kernels are code that a later process loads and runs, so the folder must be one that
no other user can write: :func:`use_cache_dir` creates it readable by its owner only and refuses
(one warning, then compiling without it) a folder that is not the user's own or that others
can write. Inductor and Triton key what they keep by the graph, the torch and Triton versions and
the device; the folder adds the torch version, so two torch releases never share one. A kernel
choice is kept under a key naming the GPU, the torch and Triton versions and the package's code
(``runtime.timing.choice_key``), and its reader checks it is still a candidate.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["CACHE_DIR_ENV", "CHOICES_FILE", "default_cache_dir", "installed_version",
           "keep_choice", "keeping", "kept_choice", "unsafe_reason", "use_cache_dir"]

log = logging.getLogger("vit_graph_backend")

#: The environment variable that names the folder (else :func:`default_cache_dir`).
CACHE_DIR_ENV = "VITGRAPH_CACHE_DIR"
#: The file of kernel choices in the folder :func:`use_cache_dir` keys by torch version.
CHOICES_FILE = "kernel_choices.json"

#: The folder :func:`use_cache_dir` last set in this process (``None``: none; nothing is kept),
#: and the choices read from it (``None``: not read yet), both under :data:`_lock`.
_folder: Path | None = None
_choices: dict[str, Any] | None = None
_lock = threading.Lock()


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None`` if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


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
    """Keep Inductor's and Triton's compiled kernels, the package's kernel choices (and, under a
    compile job id, Dynamo's record of dynamic sizes) in ``path`` (default:
    :func:`default_cache_dir`), under a folder per torch version, for this process and the next.

    Call it before the first compile: it sets ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TRITON_CACHE_DIR``, which they read when they compile. Creates missing folders readable by
    their owner only. Every folder from the root down to the caches is checked: a link, another
    user's folder or one others can write (a sticky ``/tmp`` aside) is refused. Returns the
    folder used; ``None`` (after one warning naming the folder and why) where a folder is unsafe
    or cannot be made, leaving the environment as it was.
    """
    global _folder, _choices
    try:
        root = Path(os.path.abspath(Path(path).expanduser() if path is not None
                                    else default_cache_dir()))
        keyed = root / f"torch-{installed_version('torch') or 'unknown'}"
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
    with _lock:
        _folder, _choices = keyed, None
    return keyed


def keeping() -> bool:
    """Whether kernel choices are kept: :func:`use_cache_dir` set a folder in this process."""
    return _folder is not None


def kept_choice(key: str | None) -> Any:
    """The kernel choice kept under ``key`` (by this process or an earlier one) in the folder
    :func:`use_cache_dir` set, or ``None``: none kept, no folder set (``key`` is then ``None``:
    ``runtime.timing.choice_key``), or a file that is not the user's own (refused with one
    warning). The caller checks the value is still a candidate."""
    if key is None:
        return None
    with _lock:
        return _read().get(key)


def keep_choice(key: str | None, value: Any) -> None:
    """Keep ``value`` (plain JSON) under ``key`` for later processes; nothing where no folder is
    set. The file is read again and merged just before it is replaced, so what other processes
    kept stays, but for a write racing this one (its entries are then timed again). A failed
    write is logged, never raised."""
    global _choices
    if key is None:
        return
    with _lock:
        choices = _read()
        if _folder is None or choices.get(key) == value:
            return
        # a file not the user's own is replaced, unread
        merged = {**_load(_folder / CHOICES_FILE, warn=False), **choices, key: value}
        name = None
        try:   # a new file readable by its owner only (mkstemp), then renamed over the old
            handle, name = tempfile.mkstemp(dir=_folder, prefix=".choices-", suffix=".json")
            with os.fdopen(handle, "w") as out:
                json.dump(merged, out)
            os.replace(name, _folder / CHOICES_FILE)
        except (OSError, TypeError, ValueError) as exc:
            log.warning("vitgraph: could not keep a kernel choice in %s: %s", _folder, exc)
            if name is not None and os.path.exists(name):
                os.unlink(name)
            return
        _choices = merged


def _read() -> dict[str, Any]:
    """The choices of the folder set, read once (under :data:`_lock`)."""
    global _choices
    if _choices is None:
        _choices = _load(_folder / CHOICES_FILE) if _folder is not None else {}
        if _choices:
            log.info("vitgraph: %d kernel choices read from %s", len(_choices), _folder)
    return _choices


def _load(path: Path, warn: bool = True) -> dict[str, Any]:
    """The choices in ``path``: ``{}`` where it is missing, a link, not a plain file of the
    user's own that only they can write (a warning if ``warn``), or not a JSON object. The
    checks read the file opened (no link followed), so it cannot be swapped between them."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return {}
    except OSError as exc:   # a link (ELOOP), or no permission
        return _unread(path, f"{type(exc).__name__}: {exc}", warn)
    with os.fdopen(handle) as kept:
        info = os.fstat(kept.fileno())
        getuid = getattr(os, "getuid", None)   # None on Windows: no owners to compare
        if (not stat.S_ISREG(info.st_mode) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                or (getuid is not None and info.st_uid != getuid())):
            return _unread(path, "not a file of this user's that only they can write", warn)
        try:
            choices = json.load(kept)
        except (OSError, ValueError) as exc:
            return _unread(path, f"unreadable: {exc}", warn)
    return choices if isinstance(choices, dict) else {}


def _unread(path: Path, why: str, warn: bool) -> dict[str, Any]:
    if warn:
        log.warning("vitgraph: not reading kernel choices from %s (%s); timing the kernels "
                    "instead", path, why)
    return {}


def _refused(folder: object, reason: str) -> None:
    log.warning("vitgraph: not keeping compiled kernels in %s: %s; compiling without that cache",
                folder, reason)
    return None
