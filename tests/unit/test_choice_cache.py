"""``choice_cache.py``: fused_linear's per-shape winners kept in one JSON file across processes.

Two ``ChoiceCache`` objects stand for two processes. What ``fused_linear`` does with a stored
winner (takes it untimed if it is still a candidate) runs on a GPU in
``tests/gpu/test_fused_linear_gpu.py``.
"""

from __future__ import annotations

import json
import os

from vit_graph_backend import _compat
from vit_graph_backend.choice_cache import ENV, FILE, ChoiceCache, cache_path


def test_where_the_file_lives(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert cache_path() == tmp_path / FILE
    monkeypatch.setenv(ENV, "")
    assert cache_path() is None  # off
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cache_path() == tmp_path / "inductor" / "vitgraph" / FILE
    assert _compat.inductor_cache_dir() == str(tmp_path / "inductor")


def test_a_second_process_reads_what_the_first_stored(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    first = ChoiceCache()
    assert first.get("shape a") is None
    first.put("shape a", (128, 256, 64, 3, 8, 0))
    first.put("shape b", "cublas+activation")
    second = ChoiceCache()
    assert second.get("shape a") == (128, 256, 64, 3, 8, 0)  # a tuple again, not a list
    assert second.get("shape b") == "cublas+activation"
    assert second.get("shape c") is None


def test_writers_merge_instead_of_overwriting(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    one, two = ChoiceCache(), ChoiceCache()
    one.get("x"), two.get("x")  # both read the (empty) file first
    one.put("from one", "pytorch")
    two.put("from two", (128, 128, 64, 4, 8, 0))
    on_disk = json.loads((tmp_path / FILE).read_text())
    assert on_disk == {"from one": "pytorch", "from two": [128, 128, 64, 4, 8, 0]}
    assert not [p for p in os.listdir(tmp_path) if p != FILE]  # no temporary file left


def test_a_torn_file_is_ignored_and_replaced(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    (tmp_path / FILE).write_text('{"half a wri')
    cache = ChoiceCache()
    assert cache.get("anything") is None
    cache.put("shape", "pytorch")
    assert json.loads((tmp_path / FILE).read_text()) == {"shape": "pytorch"}


def test_an_unwritable_folder_never_fails_the_caller(monkeypatch, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(ENV, str(blocker / "below a file"))
    cache = ChoiceCache()
    cache.put("shape", "pytorch")  # logged at DEBUG, not raised
    assert cache.get("shape") == "pytorch"  # still known to this process


def test_turned_off_stores_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "")
    monkeypatch.chdir(tmp_path)
    cache = ChoiceCache()
    cache.put("shape", "pytorch")
    assert cache.get("shape") is None and not os.listdir(tmp_path)
