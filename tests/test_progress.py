from __future__ import annotations

import io

import pytest

from autoloader import TrialRecord
from autoloader.results._progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _done(number: int, state: str, rate: float | None = None) -> TrialRecord:
    return TrialRecord(number, "search", {"num_workers": 2}, state, samples_per_second=rate)


def test_the_bar_shows_trials_and_the_best_rate_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with Progress(time_budget=30, enabled=True) as progress:
        progress.trial_done(_done(0, "complete", 812.0))
        progress.trial_done(_done(1, "pruned"))
        progress.trial_done(_done(2, "complete", 640.0))
    shown = terminal.getvalue()
    assert "trials 3 (pruned 1, failed 0), best 812 samples/s" in shown
    assert "/30s" in shown


@pytest.mark.parametrize("terminal", [True, False])
def test_no_bar_when_disabled_or_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    with Progress(time_budget=30, enabled=not terminal) as progress:
        progress.trial_done(_done(0, "complete", 812.0))
    assert stream.getvalue() == ""
