"""Where the benchmark scripts of this folder put their text: stdout, and ``$OUT/<name>.txt``
when ``$OUT`` is set (the device machine hands that folder back)."""

from __future__ import annotations

import os
from pathlib import Path


def emit(lines: list[str], name: str, *, echo: bool = True) -> str:
    """Print ``lines`` (unless ``echo=False``: the caller printed them as they came) and write
    them to ``$OUT/<name>.txt``; returns the text."""
    text = "\n".join(lines)
    if echo:
        print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.txt").write_text(text + "\n")
    return text
