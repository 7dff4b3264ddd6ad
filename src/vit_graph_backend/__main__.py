"""``python -m vit_graph_backend``: the ``vitgraph`` command (see :mod:`vit_graph_backend.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
