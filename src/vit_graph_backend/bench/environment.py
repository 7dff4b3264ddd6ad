"""What a result was measured on: versions, device, and whether the ``vitgraph`` backend is found.

Shared by ``vitgraph info`` and the ``environment`` block of ``vitgraph bench --json``. Optional
packages' versions come from their installed metadata, so listing them imports none of them.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

from ..cache_dir import installed_version as package_version

__all__ = ["OPTIONAL_PACKAGES", "backend_status", "collect_environment", "package_version"]

#: Optional packages reported by ``vitgraph info`` and recorded with every result.
OPTIONAL_PACKAGES: tuple[str, ...] = ("timm", "transformers", "matplotlib", "tqdm", "hypothesis",
                                       "pytest", "torch-tensorrt")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def collect_environment(device: str | None = None) -> dict[str, Any]:
    """Versions and the device of a run (``device=None``: CUDA device 0 if there is one)."""
    import torch

    from .. import __version__

    cuda = torch.cuda.is_available()
    dev = torch.device(device if device is not None else ("cuda" if cuda else "cpu"))
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        device_name = torch.cuda.get_device_name(index)
    else:
        device_name = _cpu_name()
    return {
        "vit_graph_backend": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count() or 1,
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "device": str(dev),
        "device_name": device_name,
        "packages": {name: package_version(name) for name in OPTIONAL_PACKAGES},
    }


def backend_status() -> dict[str, Any]:
    """Whether ``torch.compile(backend="vitgraph")`` can work here.

    ``listed``: the name is in ``torch.compiler.list_backends()`` (the entry point is installed);
    ``importable``: ``vit_graph_backend.compile.backend`` imports, with the error otherwise.
    """
    import torch

    list_error = None
    try:
        listed = "vitgraph" in torch.compiler.list_backends(exclude_tags=())
    except Exception as exc:  # a broken third-party entry point must not break `info`
        listed, list_error = False, f"{type(exc).__name__}: {exc}"
    entry_point = None
    for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"):
        if ep.name == "vitgraph":
            entry_point = ep.value
    importable, error = True, None
    try:
        from ..compile.backend import vitgraph  # noqa: F401
    except Exception as exc:
        importable, error = False, f"{type(exc).__name__}: {exc}"
    return {"listed": listed, "list_error": list_error, "entry_point": entry_point,
            "importable": importable, "error": error}
