"""``use_cache_dir``: compiled kernels kept in a folder of the user's own, never one that others
can write (they are code a later process runs)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import vit_graph_backend as vg
from vit_graph_backend.cache_dir import CACHE_DIR_ENV, default_cache_dir, use_cache_dir

VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture(autouse=True)
def _keep_env(monkeypatch, tmp_path):
    """Each test starts from caches of its own and leaves the process's as they were."""
    for var in VARS:
        monkeypatch.setenv(var, str(tmp_path / "before" / var))
    with torch.compiler.config.patch(job_id=None):
        yield


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_folder_is_the_owners_alone_and_both_caches_point_into_it(tmp_path):
    root = tmp_path / "new" / "cache"
    used = use_cache_dir(root)
    assert used is not None and used.parent == root and used.name.startswith("torch-")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(used / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(used / "triton")
    for folder in (root, used, used / "inductor", used / "triton"):
        assert _mode(folder) == 0o700, (folder, oct(_mode(folder)))
    assert vg.use_cache_dir is use_cache_dir


def test_no_compile_job_id_is_set(tmp_path):
    """A job id would make a later process trace the dynamic graph, and so compile and capture
    every budget, in its first call (docs/performance.md, first pass): the user's choice."""
    assert use_cache_dir(tmp_path / "cache") is not None
    assert torch.compiler.config.job_id is None


_TRACES = textwrap.dedent("""
    import sys, torch
    from vit_graph_backend.cache_dir import use_cache_dir
    use_cache_dir(sys.argv[1])
    traces = []
    def backend(gm, example_inputs):
        traces.append(1)
        return gm.forward
    f = torch.compile(lambda x: torch.tanh(x) * 2, backend=backend)
    for rows in (2, 3, 5):
        f(torch.ones(rows, 4))
    print(len(traces))
""")


@pytest.mark.slow
def test_under_a_job_id_a_second_process_traces_a_model_once_and_twice_without(tmp_path):
    """Under the user's compile job id Dynamo keeps its record of the batch size that turned
    dynamic in the folder, and the next process traces dynamic at once; without one, static
    first, then dynamic."""
    script = tmp_path / "model.py"   # one file: Dynamo keys its record by the code's location
    script.write_text(_TRACES)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_JOB_ID"}

    def traces(job_id):
        extra = {"TORCH_COMPILE_JOB_ID": job_id} if job_id else {}
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")],
                              capture_output=True, text=True, env={**env, **extra}, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert traces("test-job") == 2   # a first process: static, then a dynamic batch
    assert traces(None) == 2         # no job id: no record read
    assert traces("test-job") == 1
    assert list((tmp_path / "cache").rglob("code_state_*")), "no record in the folder"


def test_a_folder_holding_the_cache_that_others_can_write_is_refused(tmp_path, caplog):
    """Another user could swap the cache folder for theirs: a parent is checked too (a sticky
    one, as /tmp, is not swappable and passes)."""
    holder = tmp_path / "holder"
    holder.mkdir()
    holder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert use_cache_dir(holder / "cache") is None
    assert str(holder) in caplog.text and not (holder / "cache").exists()
    holder.chmod(0o777 | stat.S_ISVTX)
    assert use_cache_dir(holder / "cache") is not None


def test_two_processes_starting_together_share_the_folder(tmp_path):
    first = use_cache_dir(tmp_path / "cache")
    assert use_cache_dir(tmp_path / "cache") == first   # every folder exists now: no error


def test_a_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    used = use_cache_dir("rel")
    assert used is not None and used.is_absolute() and used.parent == tmp_path / "rel"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_can_write_is_refused_with_one_warning(tmp_path, caplog, mode):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    before = {var: os.environ[var] for var in VARS}
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert use_cache_dir(root) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(root) in warnings[0] and "others can write" in warnings[0]
    assert {var: os.environ[var] for var in VARS} == before
    assert not any(root.iterdir())   # nothing made inside it


def test_a_writable_folder_inside_a_safe_one_is_refused(tmp_path):
    root = tmp_path / "cache"
    used = use_cache_dir(root)
    (used / "inductor").chmod(0o777)
    assert use_cache_dir(root) is None


def test_a_symbolic_link_is_refused(tmp_path, caplog):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert use_cache_dir(link) is None
    assert "symbolic link" in caplog.text


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path, caplog):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, -1)
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert use_cache_dir(root) is None
    assert "user id 12345" in caplog.text


def test_the_default_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "named"))
    assert default_cache_dir() == tmp_path / "named"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vit_graph_backend"


def test_inductor_writes_its_compiled_kernels_into_the_folder(tmp_path):
    torch = pytest.importorskip("torch")
    from vit_graph_backend import _compat

    used = use_cache_dir(tmp_path / "cache")
    torch._dynamo.reset()

    def backend(gm, example_inputs):
        return _compat.compile_fx_without_cudagraphs(gm, example_inputs)

    torch.compile(lambda x: torch.tanh(x) * 7, backend=backend)(torch.randn(9))
    assert any((used / "inductor").rglob("*")), list((used / "inductor").rglob("*"))


def test_warm_fills_the_folder_through_the_model_and_waits_for_preparations(tmp_path):
    """``warm``: the folder made and named, every call run without grad through the model (a
    tuple is spread over its arguments), and ``report()`` returned with the folder."""
    torch = pytest.importorskip("torch")
    seen = []

    def model(*args):
        seen.append((args, torch.is_grad_enabled()))
        return args[0] * 2

    x, y = torch.ones(2, requires_grad=True), torch.zeros(3)
    result = vg.warm(model, [(x, y), x], cache_dir=tmp_path / "deploy")
    assert [(len(args), grad) for args, grad in seen] == [(2, False), (1, False)]
    assert result["cache_dir"] == os.environ["TRITON_CACHE_DIR"].rpartition("/")[0]
    assert result["cache_dir"].startswith(str(tmp_path / "deploy"))
    assert "graphs_captured" in result and "compiles" in result


def test_warm_says_when_preparations_outlast_its_timeout(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from vit_graph_backend.compile import backend

    monkeypatch.setattr(backend, "wait_prepared", lambda timeout: False)
    with pytest.raises(TimeoutError, match="timeout=0.5"):
        vg.warm(lambda x: x, [1], cache_dir=tmp_path / "deploy", timeout=0.5)


def test_warm_with_a_refused_folder_runs_the_calls_and_says_none(tmp_path, caplog):
    pytest.importorskip("torch")
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    calls = []
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        result = vg.warm(calls.append, ["a", "b"], cache_dir=unsafe)
    assert calls == ["a", "b"] and result["cache_dir"] is None
    assert "not keeping compiled kernels" in caplog.text
