"""What ``vitgraph bench`` shows a person: the table's speed-up column on CPU, readable latency
plots, and log records that never land inside a progress bar. CPU only, a few seconds."""

from __future__ import annotations

import copy
import logging
import sys

import pytest

from vit_graph_backend.bench import BenchConfig, format_text, run_benchmark
from vit_graph_backend.bench.timing import progress


@pytest.fixture(scope="module")
def cpu_doc():
    return run_benchmark(BenchConfig(model="clip-tiny", modes=("eager",), calls=3, max_batch=3,
                                     device="cpu", progress=False))


def _table_rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    header = lines[start]
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line
    return {"header": header, **rows}


def test_cpu_table_shows_no_speed_up_and_says_why_once(cpu_doc):
    (eager,) = cpu_doc["modes"]
    assert eager["speedup_vs_eager"] is not None  # the JSON keeps the measured ratio
    text = format_text(cpu_doc)
    rows = _table_rows(text)
    assert rows["eager"].rstrip().endswith("n/a (cpu)")
    assert f"{eager['speedup_vs_eager']:.2f}x" not in rows["eager"]
    why = [line for line in text.splitlines() if "n/a (cpu)" in line and "noise" in line]
    assert len(why) == 1, text
    # the same result measured on a CUDA device shows the ratio, and no note
    doc = copy.deepcopy(cpu_doc)
    doc["environment"]["device"] = "cuda:0"
    text = format_text(doc)
    assert _table_rows(text)["eager"].rstrip().endswith(f"{eager['speedup_vs_eager']:.2f}x")
    assert "n/a (cpu)" not in text


def _labels_in_view(ax) -> list[str]:
    low, high = ax.get_ylim()
    labels = []
    for tick in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks():
        text = tick.label1.get_text()
        if tick.label1.get_visible() and text and low <= tick.get_loc() <= high:
            labels.append(text)
    return labels


@pytest.mark.parametrize("per_call_ms", [[2.0, 2.6, 3.3, 4.1, 5.5], [1.04, 1.1, 1.21, 1.35]],
                         ids=["between powers of ten", "a sliver above 1 ms"])
def test_latency_plot_labels_an_axis_spanning_less_than_a_decade(cpu_doc, per_call_ms):
    pytest.importorskip("matplotlib")
    from vit_graph_backend.bench.report import latency_figure

    doc = copy.deepcopy(cpu_doc)
    doc["modes"][0]["per_call_ms"] = per_call_ms
    fig = latency_figure(doc)
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        labels = _labels_in_view(ax)
        assert len(labels) >= 2, labels
        values = [float(label) for label in labels]  # plain numbers, readable as they are
        low, high = ax.get_ylim()
        assert all(low <= v <= high for v in values)


def _render(line: str) -> str:
    """What a terminal shows for one line: each carriage return starts overwriting at column 0."""
    screen = ""
    for part in line.split("\r"):
        screen = part + screen[len(part):]
    return screen


def test_log_records_do_not_land_inside_a_progress_bar(capsys):
    pytest.importorskip("tqdm")
    # the CLI's case: records reach stderr through a console handler (or logging's last resort)
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    message = "vitgraph: CUDA graphs need a CUDA device; running without graphs"
    try:
        for i in progress(range(3), desc="vitgraph: first pass", total=3):
            if i == 1:
                logging.getLogger("vit_graph_backend.runtime.manager").warning(message)
    finally:
        logging.getLogger().removeHandler(handler)
    err = capsys.readouterr().err
    assert "first pass" in err  # the bar was drawn
    shown = [_render(line).strip() for line in err.split("\n")]
    assert message in shown, shown
