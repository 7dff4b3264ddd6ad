"""The ``vitgraph bench`` harness: models (:mod:`.models`), seeded workloads (:mod:`.workloads`),
modes (:mod:`.modes`), timing (:mod:`.timing`), the protocol (:mod:`.runner`), reports
(:mod:`.report`) and the environment (:mod:`.environment`, shared with ``vitgraph info``).

Importing this package imports no torch and no optional dependency.

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

__all__ = ["MODALITIES", "MODELS", "MODES", "RESULT_SCHEMA", "SCHEMA_VERSION", "WORKLOADS",
           "BenchConfig", "format_text", "resolve", "run_benchmark", "validate", "write_json",
           "write_plot"]
