"""``benchmarks/results/`` holds only files the docs cite: each one is named in the README or a
page of ``docs/``, and each name follows ``<workload>_<metric>_<gpu>_torch<version>``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NAME = re.compile(r"^[a-z0-9_]+_(?:[0-9]x)?[A-Za-z0-9]+_torch\d+\.\d+\.\d+\.(?:txt|json)$")


def _docs_text() -> str:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


def test_every_results_file_is_cited_and_named_by_the_rule():
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert files, "no results files found"
    text = _docs_text()
    assert [f for f in files if f not in text] == []
    assert [f for f in files if not NAME.match(f)] == []
