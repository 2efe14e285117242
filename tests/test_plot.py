from __future__ import annotations

import sys
from pathlib import Path

import pytest

import autoloader
from autoloader import TrialRecord
from autoloader.results._report import report

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
    figure = autoloader.plot(result, path)
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


def test_plot_draws_the_epoch_rates_and_its_title_gives_the_reports_figures() -> None:
    """Once started, 4 workers run 1,800 samples/s, but 1,200 and 1,100 over an epoch,
    start-up included: the plot, like the report, gives the rates over an epoch."""
    from matplotlib.text import Text

    tuned = {"num_workers": 4, "prefetch_factor": 2}
    trials = [
        BASELINE,
        _trial(1, "search", tuned, 1200.0, samples_per_second=1800.0),
        _trial(2, "runoff", tuned, 1100.0, samples_per_second=1700.0),
    ]
    result = _result(
        trials,
        tuned,
        throughput=1150.0,
        steady_throughput=1750.0,
        steady_baseline=200.0,
        startup_seconds=2.0,
        startup_each_epoch=True,
    )
    figure = autoloader.plot(result)
    by_workers, history = figure.axes
    lines = {line.get_label(): line for line in by_workers.get_lines()}
    assert list(lines["prefetch 2"].get_ydata()) == [1200.0]  # the best epoch rate
    (star,) = [c for c in by_workers.collections if c.get_label().startswith("tuned")]
    assert star.get_offsets()[0][1] == result.throughput
    assert [c.get_offsets()[0][1] for c in history.collections[:3]] == [200.0, 1200.0, 1100.0]
    (title,) = [t.get_text() for t in figure.findobj(Text) if t.get_text().startswith("autoloader")]
    headline = " ".join(report(result).split())
    assert "tuned 1,150 samples/s over an epoch = 5.75x the defaults" in title
    assert (
        "1,150 samples/s over an epoch, start-up included, against 200 with the defaults: 5.75x"
        in headline
    )


def test_the_plot_and_the_report_give_the_same_step_ceiling() -> None:
    """The step took 10 ms in most trials but 8 ms in the tuned setting's own: both
    presenters draw the ceiling from the tuned setting's trial, 16 / 8 ms = 2,000."""
    from matplotlib.text import Text

    tuned = {"num_workers": 4, "prefetch_factor": 2}
    trials = [*_trials()[:-1], _trial(6, "runoff", tuned, 1210.0, step_seconds=0.008)]
    result = _result(trials, tuned)
    texts = [t.get_text() for t in autoloader.plot(result).findobj(Text)]
    assert "step ceiling 2,000" in texts
    assert "of the step's ceiling of 2,000 samples/s" in " ".join(report(result).split())


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = _result(_trials(), {"num_workers": 4, "prefetch_factor": 2})
    with pytest.raises(ImportError, match=r"pip install 'torch-autoloader\[plot\]'"):
        autoloader.plot(result)


def test_plot_draws_threads_and_processes_apart_where_both_were_measured() -> None:
    threads = {"num_workers": 4, "prefetch_factor": 2, "worker_kind": "threads"}
    trials = [*_trials(), _trial(7, "search", threads, 1300.0)]
    figure = autoloader.plot(_result(trials, threads))
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["processes, prefetch 2"].get_ydata()) == [700.0, 1210.0]
    assert list(lines["threads, prefetch 2"].get_ydata()) == [1300.0]
    assert "prefetch 2" not in lines
