"""Kernel choices kept across processes in the folder ``use_cache_dir`` sets: written readable by
the owner only, read back by a later process, refused from a file others can write, and never
answering for a choice that is no longer a candidate. A "later process" is the module's state
reset (``_choices = None``), as a new process starts with nothing read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat

import pytest
import torch

from vit_graph_backend import cache_dir
from vit_graph_backend.cache_dir import CHOICES_FILE, keep_choice, kept_choice, use_cache_dir
from vit_graph_backend.kernels import attention_choice as _attention_choice
from vit_graph_backend.kernels import fused_linear
from vit_graph_backend.kernels.attention_choice import AttentionChoice
from vit_graph_backend.runtime.timing import choice_key

CPU = torch.device("cpu")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var))
    used = use_cache_dir(tmp_path / "cache")
    assert used is not None
    return used


def _later_process():
    cache_dir._choices = None


def test_nothing_is_kept_in_a_process_that_set_no_folder(folder):
    cache_dir._folder, cache_dir._choices = None, None   # a process that never called it
    assert choice_key("linear_act", CPU, 64) is None
    keep_choice("k", "v")
    assert kept_choice("k") is None and kept_choice(None) is None
    assert not (folder / CHOICES_FILE).exists()


def test_a_choice_is_kept_for_the_owner_alone_and_read_by_a_later_process(folder):
    keep_choice("linear|a", [128, 256, 64, 3, 8, 0])
    keep_choice("attention|b", "triton")
    path = folder / CHOICES_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == {"linear|a": [128, 256, 64, 3, 8, 0],
                                            "attention|b": "triton"}
    _later_process()
    assert kept_choice("linear|a") == [128, 256, 64, 3, 8, 0]
    assert kept_choice("attention|b") == "triton" and kept_choice("other") is None


def test_choices_other_processes_kept_meanwhile_are_merged_not_lost(folder):
    keep_choice("mine", 1)
    (folder / CHOICES_FILE).write_text(json.dumps({"mine": 1, "theirs": 2}))
    keep_choice("mine too", 3)
    _later_process()
    assert [kept_choice(k) for k in ("mine", "theirs", "mine too")] == [1, 2, 3]


def test_a_file_others_can_write_is_not_read_and_is_replaced(folder, caplog):
    path = folder / CHOICES_FILE
    path.write_text(json.dumps({"k": "planted"}))
    path.chmod(0o666)
    _later_process()
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert kept_choice("k") is None
    assert any("not reading kernel choices" in r.message and str(path) in r.message
               for r in caplog.records)
    keep_choice("k", "mine")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == {"k": "mine"}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_unreadable_file_means_timing_again(folder, text, caplog):
    (folder / CHOICES_FILE).write_text(text)
    _later_process()
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert kept_choice("k") is None
    assert any("unreadable" in r.message for r in caplog.records) == (text == "{not json")


def test_a_link_in_place_of_the_file_is_not_followed(folder, tmp_path, caplog):
    planted = tmp_path / "elsewhere.json"
    planted.write_text(json.dumps({"k": "planted"}))
    planted.chmod(0o600)
    (folder / CHOICES_FILE).symlink_to(planted)
    _later_process()
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        assert kept_choice("k") is None
    assert any("not reading kernel choices" in r.message for r in caplog.records)


def test_the_key_names_the_shape_device_releases_and_code(folder):
    key = choice_key("linear_act", CPU, torch.bfloat16, 64, 768, 3072, "gelu", True)
    parts = key.split("|")
    assert parts[:8] == ["linear_act", "torch.bfloat16", "64", "768", "3072", "gelu", "True",
                         "cpu"]
    assert f"torch {torch.__version__}" in parts
    for release in ("triton ", "cudnn ", "cudnn-frontend "):
        assert sum(p.startswith(release) for p in parts) == 1, (release, parts)
    code = [p for p in parts if p.startswith("code ")]
    assert len(code) == 1 and len(code[0]) == len("code ") + 16
    assert choice_key("linear_act", CPU, torch.float16, 64) != choice_key(
        "linear_act", CPU, torch.bfloat16, 64)


def _timer_with_winner(monkeypatch, winner):
    """``graph_ms`` that makes ``winner`` fastest; launches are not run on CPU."""
    current = {}

    def launch(choice, rows, weight, bias, activation):
        current["choice"] = choice
        return rows

    def graph_ms(fn, calls, reps):
        fn()
        return 1.0 if current["choice"] == winner else 2.0

    monkeypatch.setattr(fused_linear.LinearActChoices, "_launch", staticmethod(launch))
    monkeypatch.setattr(fused_linear, "graph_ms", graph_ms)


def test_a_timed_linear_choice_answers_a_later_process_without_timing(folder, monkeypatch):
    config = fused_linear.FUSED_CONFIGS[1]
    _timer_with_winner(monkeypatch, config)
    x, w = torch.ones(4, 8), torch.ones(8, 8)
    assert fused_linear.LinearActChoices()._time(x, w, None, "gelu") == config
    _later_process()
    later = fused_linear.LinearActChoices()
    assert later._kept(x, w, None, "gelu") == config
    assert later._kept(torch.ones(5, 8), w, None, "gelu") is None   # another shape
    assert later._kept(x, w, None, "quick_gelu") is None
    later.refused[(False, config)] = "failed to build here"   # no longer a candidate
    assert later._kept(x, w, None, "gelu") is None


def test_a_timing_short_of_memory_is_not_kept(folder, monkeypatch):
    def launch(choice, rows, weight, bias, activation):
        if choice != "cublas+activation":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return rows

    monkeypatch.setattr(fused_linear.LinearActChoices, "_launch", staticmethod(launch))
    monkeypatch.setattr(fused_linear, "graph_ms", lambda fn, calls, reps: fn() is not None)
    x, w = torch.ones(4, 8), torch.ones(8, 8)
    assert fused_linear.LinearActChoices()._time(x, w, None, "gelu") == "cublas+activation"
    _later_process()
    assert fused_linear.LinearActChoices()._kept(x, w, None, "gelu") is None


class _Kernel:
    state: dict = {}

    def __call__(self, *args):
        return None


@pytest.mark.parametrize("triton_ms, expected", [(0.5, "triton"), (2.0, "varlen")])
def test_an_attention_choice_answers_a_later_process_without_a_race(folder, monkeypatch,
                                                                     triton_ms, expected):
    raced = []

    def race(rows, what, kernels, compared, timings):
        raced.append(rows)
        return {"varlen": 1.0, "triton": triton_ms}

    monkeypatch.setattr(_attention_choice, "_race", race)
    monkeypatch.setattr(_attention_choice, "_timed_on", lambda device: True)

    def choose(rows=300, heads=2):
        choice = AttentionChoice(None)
        choice.segment = _Kernel()
        return choice._choose_segment_kernel(rows, heads, 80, 80 ** -0.5, 1, CPU,
                                             torch.bfloat16, varlen=lambda *a: None)

    assert choose() == expected and raced == [300, 300]   # two layouts timed
    _later_process()
    later = AttentionChoice(None)
    later.segment = _Kernel()
    assert later._choose_segment_kernel(300, 2, 80, 80 ** -0.5, 1, CPU, torch.bfloat16,
                                        varlen=lambda *a: None) == expected
    assert raced == [300, 300]   # read, not raced
    assert later.state["kept"] == {"full": [300]} and later.full_timings == {}
    assert choose(heads=4) == expected and raced == [300] * 4   # another shape: raced


def test_a_kept_value_that_is_not_a_choice_is_ignored(folder, monkeypatch):
    monkeypatch.setattr(_attention_choice, "_timed_on", lambda device: True)
    monkeypatch.setattr(_attention_choice, "_race",
                        lambda rows, what, kernels, compared, timings: {"varlen": 1.0,
                                                                        "triton": 2.0})
    choice = AttentionChoice(None)
    choice.segment = _Kernel()
    key = choice_key("full attention", CPU, 300, 2, 80, 1, torch.bfloat16,
                     choice.ragged is not None)
    keep_choice(key, "something else")
    assert choice._choose_segment_kernel(300, 2, 80, 80 ** -0.5, 1, CPU, torch.bfloat16,
                                         varlen=lambda *a: None) == "varlen"
    assert kept_choice(key) == "varlen"


def test_a_kept_choice_that_fails_at_its_first_launch_is_refused_and_cublas_serves(
        folder, monkeypatch, caplog):
    """``run``'s kept path on CPU tensors standing for CUDA ones: the fused kernel a later
    process reads back raises when launched (it does not build on this host)."""
    config = fused_linear.FUSED_CONFIGS[0]
    launched = []

    def launch(choice, rows, weight, bias, activation):
        launched.append(choice)
        if choice != "cublas+activation":
            raise RuntimeError("out of resources")
        return rows @ weight.t()

    monkeypatch.setattr(fused_linear.LinearActChoices, "_launch", staticmethod(launch))
    monkeypatch.setattr(fused_linear.LinearActChoices, "_fusable",
                        staticmethod(lambda rows, weight, bias: True))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x, w = torch.ones(4, 8), torch.ones(8, 8)
    keep_choice(fused_linear._kept_key(x, w, None, "gelu"), list(config))
    _later_process()
    choices = fused_linear.LinearActChoices()
    with caplog.at_level(logging.WARNING, logger="vit_graph_backend"):
        out = choices.run(x, w, None, "gelu")
    assert launched == [config, "cublas+activation"]
    torch.testing.assert_close(out, x @ w.t())
    assert choices.chosen == {} and choices.refused == {(False, config):
                                                        "RuntimeError: out of resources"}
    assert any("the kept fused" in r.message for r in caplog.records)
