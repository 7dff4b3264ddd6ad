"""The ``vitgraph bench`` harness: models, seeded workloads, modes, timing and reports.

Layout:
    - :mod:`.models`: registry of vision encoders built from configs with random weights;
    - :mod:`.workloads`: named, seeded request streams;
    - :mod:`.modes`: eager, ``torch.compile`` peers and the vitgraph modes;
    - :mod:`.timing`: per-call timing (CUDA events / ``perf_counter``), percentiles, progress bars;
    - :mod:`.runner`: the benchmark protocol; :mod:`.report`: JSON schema, table and plot;
    - :mod:`.environment`: versions and device, shared with ``vitgraph info``.

Importing this package imports no torch and no optional dependency; each is imported where used.

Example::

    >>> from vit_graph_backend.bench import BenchConfig, format_text, run_benchmark
    >>> doc = run_benchmark(BenchConfig(model="vit-micro", calls=8, modes=("eager", "vitgraph")))
    >>> print(format_text(doc))  # doctest: +SKIP
"""

from .models import MODELS
from .modes import MODES
from .report import RESULT_SCHEMA, SCHEMA_VERSION, format_text, validate, write_json, write_plot
from .runner import BenchConfig, resolve, run_benchmark
from .workloads import MODALITIES, WORKLOADS

__all__ = [
    "MODALITIES",
    "MODELS",
    "MODES",
    "RESULT_SCHEMA",
    "SCHEMA_VERSION",
    "WORKLOADS",
    "BenchConfig",
    "format_text",
    "resolve",
    "run_benchmark",
    "validate",
    "write_json",
    "write_plot",
]
