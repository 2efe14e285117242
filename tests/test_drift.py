"""Loading watched once tuned (``NOTE [ Drift ]``, ``_drift.py``): a dataset that slows
down mid-training is searched again, every batch still DataLoader's; one that does not
change, or an AutoLoader with ``retune=False``, is never searched again."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import autoloader
from autoloader import AutoLoader
from autoloader._drift import DriftWatch
from autoloader.loader import BASELINE_PARAMS, normalize_params
from autoloader.measure import Measurement
from autoloader.search._outcome import Completed, Phase, Trial
from autoloader.search._policy import Plan, Policy

from .workloads import SleepDataset, SlowsDownDataset

LENGTH = 96
# The torch threads left as they are: the steps sleep, but a busy machine's baseline can
# read them as CPU work, and an AutoLoader keeps the count it tuned (a test left them at
# 1 of 2 once, in a full run).
SPACE = {
    "num_workers": (0, 4),
    "prefetch_factor": 2,
    "worker_kind": "processes",
    "step_threads": None,
}
TIME_BUDGET = 4  # a search started by drift: 4 s too
# The gap before the watch counts, in re-search budgets: 5 in the library (20 s here),
# 1 in these tests (4 s): the same watch, hysteresis and bounds, 16 s less waiting.
GAP = 1.0
# Epochs a test may train for before it gives up on what it waits for.
MOST_EPOCHS = 600


@pytest.fixture(autouse=True)
def _short_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autoloader._drift, "_GAP", GAP)


def _loader(dataset: Dataset[Any], path: Path | None, *, retune: bool = True) -> AutoLoader[Any]:
    return AutoLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        time_budget=TIME_BUDGET,
        search_space=SPACE,
        path=path,
        verbose=False,
        retune=retune,
    )


def _epoch(loader: DataLoader[Any], step: float = 0.004) -> list[list[int]]:
    """The ids of one epoch's batches, a ``step`` of sleep after each."""
    seen = []
    for batch in loader:
        time.sleep(step)
        seen.append([int(i) for i in batch[:, 0]])
    return seen


def _reference(epochs: int) -> list[list[list[int]]]:
    """DataLoader's batches of the same arguments, epoch by epoch."""
    loader = DataLoader(
        SleepDataset(LENGTH, latency=0.0),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    return [_epoch(loader, step=0.0) for _ in range(epochs)]


def _watched_past(loader: AutoLoader[Any], windows: int) -> bool:
    """Whether the watch has counted for ``windows`` windows' time."""
    watch = loader.tuning.drift  # type: ignore[union-attr]
    return watch is not None and time.perf_counter() > watch.counts_from + 2.0 * windows


@pytest.mark.light  # mostly waits
@pytest.mark.paced  # its verdict rests on a pace it measures
@pytest.mark.slow
def test_loading_that_slows_down_mid_training_is_searched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    switch = tmp_path / "slow"
    path = tmp_path / "loader.json"
    loader = _loader(SlowsDownDataset(LENGTH, 0.001, 0.008, str(switch)), path)
    caplog.set_level(logging.INFO, logger="autoloader")
    seen = []
    try:
        while not loader.tuned:
            seen.append(_epoch(loader))
        first = loader.result
        assert first is not None and loader.tuning is not None
        assert loader.tuning.drift is not None, "a tuned setting is watched"
        switch.touch()  # 8 ms a read from here, where it was 1
        while not (loader.tuning.researches and loader.tuned) and len(seen) < MOST_EPOCHS:
            seen.append(_epoch(loader))
    finally:
        loader.close()
    (warning,) = [r for r in caplog.records if "loading drifted" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert warning.getMessage().startswith("AutoLoader: loading drifted: the loop now waits ")
    assert "when tuned: searching again for up to 4 s" in warning.getMessage()  # the budget
    assert loader.tuning.researches == 1
    assert loader.result is not None
    if loader.result is first:  # the search found nothing faster than it, now
        (kept,) = [r for r in caplog.records if "searched again: the best found" in r.getMessage()]
        assert kept.getMessage().endswith(": kept")
    else:
        assert loader.result.trials != first.trials  # a search of its own
    assert autoloader.load(path).trials == loader.result.trials  # and saved
    # Exactly DataLoader's batches, through the watch, the switch and the search.
    assert seen == _reference(len(seen))


@pytest.mark.slow
def test_loading_that_does_not_change_is_never_searched_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = _loader(SleepDataset(LENGTH, latency=0.0), None)
    caplog.set_level(logging.INFO, logger="autoloader")
    epochs = 0
    try:
        while not loader.tuned:
            _epoch(loader)
        first = loader.result
        # Past the gap, for five of the watch's windows.
        while not _watched_past(loader, 5) and epochs < MOST_EPOCHS:
            _epoch(loader)
            epochs += 1
        assert _watched_past(loader, 5), "watched for five windows"
    finally:
        loader.close()
    assert loader.tuning is not None and loader.tuning.researches == 0
    assert "loading drifted" not in caplog.text
    assert loader.result is first


@pytest.mark.light  # mostly waits
@pytest.mark.slow
def test_retune_false_never_searches_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    switch = tmp_path / "slow"
    loader = _loader(SlowsDownDataset(LENGTH, 0.001, 0.008, str(switch)), None, retune=False)
    caplog.set_level(logging.INFO, logger="autoloader")
    try:
        while not loader.tuned:
            _epoch(loader)
        first = loader.result
        assert loader.tuning is not None and loader.tuning.drift is None, "nothing watched"
        switch.touch()
        # Past where the first test's loader searches again: the gap, three windows.
        ends = time.perf_counter() + GAP * TIME_BUDGET / 2 + 3 * 2.0 + 5
        while time.perf_counter() < ends:
            _epoch(loader)
    finally:
        loader.close()
    assert loader.tuning.researches == 0
    assert "loading drifted" not in caplog.text
    assert loader.result is first


def _windows(watch: DriftWatch, windows: int, wait: float, step: float) -> bool:
    """Feed ``windows`` whole windows of batches of ``wait`` and ``step``: whether the
    watch said to search again at the last one's end."""
    said = False
    for _ in range(windows):
        said = watch.batch(wait, step)
        while watch.batches:
            said = watch.batch(wait, step)
    return said


def test_the_watch_wants_a_sustained_stretch_of_loading_grown_beyond_when_tuned() -> None:
    # Tuned: 1 ms of wait and 9 ms of step a batch (10% of the loop's time).
    watch = DriftWatch(0.001, 0.009, gap=0.0)
    assert not _windows(watch, 10, 0.001, 0.009)  # as tuned
    assert not _windows(watch, 10, 0.001, 0.050)  # the step slowed: not loading's
    # Blips: two windows of loading 9 ms a batch (50%), then one as tuned, twice.
    for _ in range(2):
        assert not _windows(watch, 2, 0.009, 0.009)
        assert not _windows(watch, 1, 0.001, 0.009)
    # Grown, but by less than half a batch's time when tuned: not enough.
    assert not _windows(watch, 10, 0.0055, 0.009)
    # Sustained: three windows in a row.
    assert not _windows(watch, 2, 0.009, 0.009)
    assert _windows(watch, 1, 0.009, 0.009)
    assert watch.why() == "the loop now waits 50% of its time for data, 10% when tuned"


def test_the_watch_counts_nothing_before_its_gap() -> None:
    watch = DriftWatch(0.001, 0.009, gap=3600.0)
    assert not _windows(watch, 10, 0.05, 0.009)


def test_a_copy_takes_its_originals_retune() -> None:
    original = _loader(SleepDataset(LENGTH, latency=0.0), None, retune=False)
    # As Lightning rebuilds it: its attributes, retune among them, passed back.
    copy = AutoLoader(original.dataset, batch_size=8, tuning=original.tuning, retune=True)
    assert original.retune is False and copy.retune is False
    assert copy.tuning is original.tuning and not copy.tuning.retune  # type: ignore[union-attr]


def test_the_search_drift_starts_first_measures_the_workers_that_keep_up() -> None:
    # 5 thread workers handed the loop a batch every 12 ms + 5 ms of step: 17 workers
    # would hand it one a step.
    watch = DriftWatch(0.0005, 0.005, gap=0.0)
    assert _windows(watch, 3, 0.012, 0.005)
    chosen = normalize_params({"num_workers": 5, "worker_kind": "threads", "prefetch_factor": 4})
    wanted = watch.keeping_up(chosen)
    assert wanted == {**chosen, "num_workers": 17}
    assert watch.keeping_up(BASELINE_PARAMS) is None  # no workers: their count tells nothing
    assert DriftWatch(0.0005, 0.005, gap=0.0).keeping_up(chosen) is None  # no window yet
    # The search's policy measures it first, held to the space (16 workers at most),
    # after its baseline and before the cost model's guesses and the ladder.
    space, _ = autoloader.SearchSpace(num_workers=(0, 16)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, threads_problem=None
    )
    policy = Policy(space=space, time_budget=5.0, batch_size=16, usable_cpus=2, first=(wanted,))
    assert wanted is not None
    plan = policy.next([], seconds_left=5.0)
    assert isinstance(plan, Plan) and plan.phase is Phase.BASELINE
    baseline = Trial(
        number=0,
        params=BASELINE_PARAMS,
        phase=Phase.BASELINE,
        outcome=Completed(_measurement(load=0.1, step=0.005), 150.0),
    )
    plan = policy.next([baseline], seconds_left=4.0)
    assert isinstance(plan, Plan) and plan.params is not None
    assert plan.params == {**chosen, "num_workers": 16, "step_threads": None}
    rest = policy.starting_points([baseline])[1:]
    assert rest and all(p != plan.params for p in rest)


def test_a_setting_outside_the_space_is_not_measured_first() -> None:
    space, _ = autoloader.SearchSpace(num_workers=(0, 8), worker_kind="processes").resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    threads = normalize_params({"num_workers": 12, "worker_kind": "threads"})
    processes = normalize_params({"num_workers": 12, "persistent_workers": True})
    assert space.held(threads) is None
    # The training process's threads, searched in this space: the most it allows.
    assert space.held(processes) == {**processes, "num_workers": 8, "step_threads": 2}


def _measurement(*, load: float, step: float) -> Measurement:
    return Measurement(
        samples_per_second=150.0,
        relative_error=0.01,
        data_wait_fraction=load / (load + step),
        load_seconds=load,
        step_seconds=step,
        time_to_first_batch=0.1,
        epoch_restart_seconds=None,
        batches=20,
        duration=1.0,
        peak_memory=1,
    )
