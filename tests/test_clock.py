"""The rules of a trial's clock, shared by the timer and the live trial."""

from __future__ import annotations

import math

import pytest

from autoloader.measure import Measurement
from autoloader.measure._clock import Totals, TrialClock, memory_horizon, pace_limit


def _clock(workers: int = 2, prefetch: int = 2, **kwargs: float) -> TrialClock:
    return TrialClock(
        {"num_workers": workers, "prefetch_factor": prefetch},
        min_windows=int(kwargs.get("min_windows", 2)),
        min_window_seconds=kwargs.get("min_window_seconds", 1.0),
        target_relative_error=kwargs.get("target_relative_error", 0.05),
    )


def _batch(step: float = 0.5) -> Totals:
    return Totals(samples=4, batches=1, step=step, wait=0.0)


def test_the_warm_up_skips_the_start_up_burst_or_stops_at_its_share_of_the_trial() -> None:
    clock = _clock(workers=2, prefetch=2)
    clock.first_batch(at=0.0, deadline=100.0)  # warm-up until 50 s at most
    assert [clock.warming(t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] == [True] * 4 + [False]
    capped = _clock(workers=2, prefetch=2)
    capped.first_batch(at=0.0, deadline=10.0)  # until 5 s
    assert [capped.warming(t) for t in (1.0, 6.0)] == [True, False]
    capped.open(6.0)
    assert capped.burst_left == 3  # three of the burst's four left queued when timing began


def _estimate(clock: TrialClock) -> Measurement:
    return clock.estimate(
        time_to_first_batch=1.0,
        restarts=[],
        duration=10.0,
        peak_memory=0,
        batch_bytes=0,
        epochs_samples_per_second=None,
    )


def test_batches_of_the_burst_queued_when_timing_began_are_charged_the_later_wait() -> None:
    """Two windows of two 4-sample batches a second, timing begun with one batch of the
    burst queued. Where that first batch timed came without waiting and the three after
    it waited 0.4 s each, it would have waited 0.4 s more at the loader's pace: 16
    samples in 2.4 s. Where it waited as long as the later ones (a loader loading the
    burst at its own pace), or the later ones no longer (a loader that keeps up), the
    rate is as timed."""
    for first, later, added in ((0.0, 0.4, 0.4), (0.4, 0.4, 0.0), (0.0, 0.0, 0.0)):
        clock = _clock(workers=2, prefetch=2, min_window_seconds=0.0)
        clock.first_batch(at=0.0, deadline=1.0)
        clock.to_skip = 1  # what the warm-up's cap left to skip
        for window, waits in enumerate(((first, later), (later, later))):
            clock.open(float(window))
            for end, wait in zip((0.5, 1.0), waits, strict=True):
                clock.add(Totals(samples=4, batches=1, step=0.5 - wait, wait=wait), window + end)
            clock.close(window + 1.0)
        measured = _estimate(clock)
        assert (measured.burst_left, measured.burst_seconds) == (1, pytest.approx(added))
        assert measured.samples_per_second == pytest.approx(16 / (2.0 + added))
        assert not measured.burst_undrained  # three batches timed after the burst's one


def test_a_window_closes_after_a_batch_a_worker_and_its_shortest_time() -> None:
    clock = _clock(workers=3, min_window_seconds=1.0)
    clock.open(0.0)
    assert not clock.add(_batch(), 0.5)
    assert not clock.add(_batch(), 1.0)  # two batches, three workers
    assert clock.add(_batch(), 1.5)
    clock.close(1.5)
    assert clock.window is None and clock.total.batches == 3 and clock.total.seconds == 1.5


def test_an_epochs_edge_is_off_the_open_windows_clock() -> None:
    clock = _clock(workers=2, min_window_seconds=0.0)
    clock.open(0.0)
    clock.add(_batch(), 1.0)
    clock.epoch_edge(5.0)  # the next epoch's first batch took 5 s to come
    clock.add(_batch(), 7.0)
    clock.close(7.0)
    assert clock.windows[0].seconds == 2.0
    later = _clock()
    later.epoch_edge(5.0)  # during the warm-up: nothing to take off
    later.open(10.0)
    assert later.window_start == 10.0 and later.burst_left == 0


@pytest.mark.parametrize("burst_left", [0, 2])
def test_the_rate_is_known_after_enough_windows_that_agree(burst_left: int) -> None:
    """Unless timing began with half the batches it timed still queued at start-up:
    too few after them to tell how much sooner those came."""
    clock = _clock(workers=2, min_window_seconds=0.0, min_windows=2)
    clock.to_skip = burst_left  # what the warm-up left queued
    for start in (0.0, 1.0):
        clock.open(start)
        clock.add(_batch(), start + 0.5)
        clock.add(_batch(), start + 1.0)
        clock.close(start + 1.0)
    estimate = _estimate(clock)
    assert estimate.samples_per_second == pytest.approx(8.0)
    assert estimate.relative_error == 0.0
    assert clock.converged(estimate) is (burst_left == 0)


def test_a_trial_without_a_window_falls_back_to_its_first_batch() -> None:
    clock = _clock()
    clock.finish(3.0, first_samples=4, time_to_first_batch=2.0)
    assert clock.total == Totals(samples=4, batches=1, seconds=2.0, wait=2.0)
    partial = _clock(workers=2, min_window_seconds=10.0)
    partial.open(0.0)
    partial.add(_batch(), 1.0)
    partial.finish(2.0, first_samples=4, time_to_first_batch=0.1)
    assert partial.windows[0].seconds == 2.0 and partial.total.batches == 1


def test_the_pace_tightens_a_workers_deadline_only() -> None:
    clock = _clock(workers=4, min_window_seconds=0.0)
    clock.open(0.0)
    clock.add(_batch(), 0.5)
    clock.add(_batch(), 1.0)
    clock.add(_batch(), 1.5)
    clock.add(_batch(), 2.0)
    clock.close(2.0)  # 0.5 s a batch, 4 workers: 20 x 4 x 0.5 = 40 s
    assert pace_limit(clock.total, 4) == 40.0
    assert clock.paced(100.0) == 40.0 and clock.paced(None) is None
    assert _clock(workers=0).paced(100.0) == 100.0  # the baseline keeps its own


def test_memory_growth_is_projected_over_the_trials_time_left_or_a_second() -> None:
    assert memory_horizon(2.0, deadline=10.0, now=4.0) == 6.0
    assert memory_horizon(8.0, deadline=10.0, now=4.0) == 8.0
    assert memory_horizon(0.5, deadline=math.inf, now=4.0) == 1.0
