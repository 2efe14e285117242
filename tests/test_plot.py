from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoloader import TrialRecord

from .test_report import BASELINE, _result, _trial


def _trials() -> list[TrialRecord]:
    return [
        BASELINE,
        _trial(1, "search", {"num_workers": 2, "prefetch_factor": 2}, 700.0),
        _trial(2, "search", {"num_workers": 4, "prefetch_factor": 2}, 1200.0),
        _trial(3, "search", {"num_workers": 4, "prefetch_factor": 4}, 1150.0),
        TrialRecord(4, "search", {"num_workers": 16}, "pruned", epoch_samples_per_second=300.0),
        TrialRecord(5, "search", {"num_workers": 8}, "failed", reason="worker died"),
        _trial(6, "runoff", {"num_workers": 4, "prefetch_factor": 2}, 1210.0),
    ]


def test_plot_draws_each_prefetch_line_the_limits_and_every_trial(tmp_path: Path) -> None:
    result = _result(_trials(), {"num_workers": 4, "prefetch_factor": 2})
    path = tmp_path / "out" / "tuning.png"
    figure = result.plot(path)
    assert path.read_bytes().startswith(b"\x89PNG")
    by_workers, history = figure.axes
    labels = by_workers.get_legend_handles_labels()[1]
    assert labels[:3] == ["num_workers=0", "prefetch 2", "prefetch 4"]
    assert {"pruned (1)", "failed (1)", "tuned (median of its runs)"} <= set(labels)
    lines = {line.get_label(): line for line in by_workers.get_lines()}
    assert list(lines["prefetch 2"].get_xdata()) == [2, 4]
    assert list(lines["prefetch 2"].get_ydata()) == [700.0, 1210.0]  # best of each point
    levels = {
        round(line.get_ydata()[0])
        for line in by_workers.get_lines()
        if line.get_label().startswith("_")
    }
    assert {200, 1600} <= levels  # the baseline, and the ceiling: 16 / 10 ms
    assert len(history.collections) >= len(_trials())
    assert "best so far" in history.get_legend_handles_labels()[1]


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = _result(_trials(), {"num_workers": 4, "prefetch_factor": 2})
    with pytest.raises(ImportError, match=r"pip install 'torch-autoloader\[plot\]'"):
        result.plot()


def test_plot_draws_threads_and_processes_apart_where_both_were_measured() -> None:
    threads = {"num_workers": 4, "prefetch_factor": 2, "worker_kind": "threads"}
    trials = [*_trials(), _trial(7, "search", threads, 1300.0)]
    figure = _result(trials, threads).plot()
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["processes, prefetch 2"].get_ydata()) == [700.0, 1210.0]
    assert list(lines["threads, prefetch 2"].get_ydata()) == [1300.0]
    assert "prefetch 2" not in lines
