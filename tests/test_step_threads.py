"""The training process's own threads (NOTE [ Step threads ]): set for a trial, put back
after it and after tune(), searched only where the step works on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

import autoloader
from autoloader.loader import kept_threads, step_threads
from autoloader.loader._params import normalize_params
from autoloader.measure._errors import TrialError
from autoloader.measure._runner import TrialRunner

from .workloads import (
    SleepDataset,
    ThreadSettingStep,
    ThreadsSeenStep,
    failing_step,
)

GiB = 1024**3

needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one CPU: there are no threads to split"
)


@pytest.fixture(autouse=True)
def _two_threads() -> object:
    """Each test starts from 2 threads and leaves the process as it found it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_block_runs_on_the_threads_asked_and_gives_them_back_even_when_it_raises() -> None:
    with step_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="made up"), step_threads(1):
        raise RuntimeError("made up")
    assert torch.get_num_threads() == 2
    with step_threads(None):
        assert torch.get_num_threads() == 2
    with kept_threads():
        torch.set_num_threads(1)  # the user's step, say
    assert torch.get_num_threads() == 2


def test_a_trial_runs_the_step_on_its_threads_and_puts_them_back() -> None:
    step = ThreadsSeenStep()
    runner = TrialRunner(SleepDataset(64, latency=0), step, batch_size=4, memory_budget=64 * GiB)
    runner.measure(normalize_params({"num_workers": 0, "step_threads": 1}), max_seconds=0.5)
    assert step.seen and set(step.seen) == {1}
    assert torch.get_num_threads() == 2
    failing = TrialRunner(SleepDataset(64), failing_step, batch_size=4, memory_budget=64 * GiB)
    with pytest.raises(TrialError):
        failing.measure(normalize_params({"num_workers": 1, "step_threads": 1}), max_seconds=1)
    assert torch.get_num_threads() == 2


@needs_two_cpus
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_tune_searches_the_threads_of_a_step_on_the_cpu_and_returns_the_users() -> None:
    step = ThreadSettingStep()  # it even sets them itself
    # Items that wait 5 ms: the defaults spend 20 ms loading each batch, which workers
    # overlap, so a setting with workers (and with searched step threads) is chosen.
    result = autoloader.tune(
        SleepDataset(256, latency=0.005),
        step,
        batch_size=4,
        time_budget=6,
        show_progress=False,
    )
    assert torch.get_num_threads() == 2
    assert any(note.startswith("step_threads searched from 1 to 2") for note in result.notes)
    searched = [t.params["step_threads"] for t in result.trials if t.phase == "search"]
    assert searched and set(searched) <= {1, 2}
    # The baseline is the user's setting; what the choice asks is said, and applied only
    # when asked.
    assert [t.params["step_threads"] for t in result.trials if t.phase == "baseline"] == [None]
    assert result.params["num_workers"] > 0
    chosen = result.params["step_threads"]
    assert chosen in {1, 2}
    # The step set 1 thread itself; the note says what the process had before tune().
    words = f"step_threads={chosen}: the tuned settings train on {chosen} torch thread"
    assert any(n.startswith(words) and "(this process had 2)" in n for n in result.notes)
    assert f"the step on {chosen} torch thread" in autoloader.report(result)
    # Applied, they replace whatever the process has then, which is given back.
    other = 3 - chosen
    torch.set_num_threads(other)
    assert result.apply_threads() == other and torch.get_num_threads() == chosen


def test_tune_gives_the_threads_back_when_the_baseline_fails() -> None:
    with pytest.raises(autoloader.BaselineError):
        autoloader.tune(
            SleepDataset(64), ThreadSettingStep(), batch_size=4, time_budget=4,
            show_progress=False, loader_kwargs={"collate_fn": _broken_collate},
        )  # fmt: skip
    assert torch.get_num_threads() == 2


def _broken_collate(items: object) -> object:
    torch.set_num_threads(1)
    raise ValueError("made up")
