"""The stress suite: a test tool, run by ``tests/unit/test_stress.py`` on CPU and by
``scripts/gpu_check.sh`` on the device (``PYTHONPATH=tests python -m stress``)."""

from .suite import PartResult, StressConfig, format_stress, run_stress

__all__ = ["PartResult", "StressConfig", "format_stress", "run_stress"]
