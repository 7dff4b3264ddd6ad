"""Shared test set-up: markers, Hypothesis profiles, per-test Dynamo reset.

- ``@pytest.mark.gpu`` tests are skipped with "CUDA not available" where there is no CUDA device.
- ``@pytest.mark.trt`` tests are skipped with "torch_tensorrt not installed" where it is missing.
- Hypothesis profiles: ``dev`` (default, 200 examples), ``ci`` (derandomized, 300 examples, chosen
  when ``CI`` is set), ``gpu`` (few examples, no deadline). Pick one with
  ``--hypothesis-profile=NAME``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("gpu", max_examples=20, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    has_trt = importlib.util.find_spec("torch_tensorrt") is not None
    skip_gpu = pytest.mark.skip(reason="CUDA not available")
    skip_trt = pytest.mark.skip(reason="torch_tensorrt not installed")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "trt" in item.keywords and not has_trt:
            item.add_marker(skip_trt)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts and ends with no compiled frames or captured graphs left over, and with
    PyTorch's ``backed_size_oblivious`` (the backend turns it on: backend.py) and compile job id
    (tests set one) as it found them."""
    import sys

    fx_config = None
    if "torch" in sys.modules:
        import torch
        from torch.fx.experimental import _config as fx_config

        oblivious, job_id = fx_config.backed_size_oblivious, torch.compiler.config.job_id
    yield
    if "torch" in sys.modules:
        import torch

        torch.compiler.reset()
        if fx_config is not None:
            fx_config.backed_size_oblivious = oblivious
            torch.compiler.config.job_id = job_id


@pytest.fixture(autouse=True)
def _no_kept_choices(monkeypatch):
    """Kernel choices are kept only where a test sets a folder (``use_cache_dir``), and only for
    that test: a choice kept by one would answer the next one's timing."""
    from vit_graph_backend import cache_dir

    monkeypatch.setattr(cache_dir, "_folder", None)
    monkeypatch.setattr(cache_dir, "_choices", None)


@pytest.fixture
def padded_cpu(monkeypatch):
    """Managers made during the test pad batches to their budgets without CUDA, as graphs
    would, so routing and padding are tested on CPU (``EncoderCudaGraphManager``)."""
    from vit_graph_backend.runtime.manager import EncoderCudaGraphManager

    monkeypatch.setattr(EncoderCudaGraphManager, "pad_without_graphs", True)

