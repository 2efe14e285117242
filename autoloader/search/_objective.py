"""What a trial is worth and how long it may measure: the epoch model, a trial's share
of the time budget, and why one too short to count is pruned."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from autoloader.measure import Measurement
from autoloader.search._outcome import Completed, Phase, PruneKind, Trial

# Bounds on one trial's measurement time, and its share of the time budget.
_TRIAL_SHARE = 0.1
MIN_TRIAL_SECONDS = 1.0
_MAX_TRIAL_SECONDS = 15.0


def trial_seconds(time_budget: float) -> float:
    """The longest one trial may measure, from the whole run's time budget."""
    return min(_MAX_TRIAL_SECONDS, max(MIN_TRIAL_SECONDS, _TRIAL_SHARE * time_budget))


# NOTE [ Trials that fit ]
# A trial's time is set before it starts (max_seconds), but it runs longer: its workers'
# start-up, and under torchrun a length in batches never under what the setting can be
# measured in (NOTE [ Joint segments ] in _loop_search.py). So the time left is shared
# by what trials of the run really took. The search starts a trial only while what it
# leaves for the search holds its trials' typical duration, and the runoff keeps its
# share of the budget, or one measurement of its first candidate where that is longer:
# a runoff shorter than its first trial measures nothing. In a 2-rank Lightning DDP fit
# of 12-batch epochs with a 10 s budget (benchmarks/ddp_short_epochs.py), a trial took
# 1.7-2.3 s: the search's last trial (the sampler's, at three quarters of the best's
# rate) started with 1.5 s of the search's share left, and the runoff's 2 s could not
# hold the best's 2.3 s again. The best, measured once, then tied with a cheaper setting
# within its error, and 8 workers were chosen where 12 train 1.2x faster.
def typical_duration(trials: Sequence[Trial], default: float, *, phase: Phase | None = None,
                     params: Mapping[str, Any] | None = None) -> float:  # fmt: skip
    """Median seconds the complete trials among ``trials`` took, of ``phase`` and
    ``params`` where given, or ``default`` where none is (``NOTE [ Trials that fit ]``)."""
    durations = [
        t.outcome.measurement.duration
        for t in trials
        if isinstance(t.outcome, Completed)
        and (phase is None or t.phase is phase)
        and (params is None or t.params == params)
    ]
    return statistics.median(durations) if durations else default


# NOTE [ Epoch model ]
# Trials are ranked by the samples per second of a whole training epoch, not by the
# steady rate alone, so that worker start-up is charged where training pays it:
#
#   epoch_seconds = startup + (batches_per_epoch - 1) * steady_seconds_per_batch
#
# - Without persistent workers every epoch spawns workers again: startup is the
#   measured time to first batch (spawn + first load), or a measured epoch restart.
# - With persistent workers only the pipeline refills at an epoch's start: startup is
#   a measured restart if the trial crossed an epoch, else one batch loaded with an
#   empty pipeline, i.e. the baseline's load time per batch. The very first spawn is
#   paid once per training run and is ignored.
# An iterable dataset without __len__ has no known epoch: the steady rate is used.
# Where the trial timed a whole epoch (NOTE [ Whole epochs ]), the model is not needed:
# that rate is the objective, an epoch's edges included as training pays them.
def epoch_samples_per_second(
    params: Mapping[str, Any],
    measurement: Measurement,
    *,
    batch_size: int,
    batches_per_epoch: int | None,
    refill_seconds: float,
) -> float:
    rate = measurement.samples_per_second
    if batches_per_epoch is None or rate <= 0:
        return rate
    if measurement.epochs_samples_per_second:
        return measurement.epochs_samples_per_second
    if params["persistent_workers"]:
        startup = measurement.epoch_restart_seconds or refill_seconds
    else:
        startup = measurement.epoch_restart_seconds or measurement.time_to_first_batch
    seconds = startup + (batches_per_epoch - 1) * batch_size / rate
    return batches_per_epoch * batch_size / seconds


def too_short_reason(measurement: Measurement) -> str:
    """Why a trial too short to count is pruned, and what gives it the time."""
    if measurement.batches == 0 and measurement.samples_per_second == 0:
        return (
            f"{PruneKind.TOO_SHORT.value}: its workers had not delivered a first batch when "
            f"the trial's {measurement.duration:.1f} s ran out: they take longer to start "
            "than the trial could wait (a larger time_budget gives them the time)"
        )
    if measurement.burst_undrained:
        return (
            f"{PruneKind.TOO_SHORT.value}: timing had to begin with {measurement.burst_left} "
            "of the batches queued at start-up not yet drained, too many of the "
            f"{measurement.batches} batches timed to tell how much sooner they came than "
            "batches loaded while timed, so its rate is not counted (a larger time_budget "
            "gives each trial time to drain them)"
        )
    return (
        f"{PruneKind.TOO_SHORT.value}: the trial's {measurement.duration:.1f} s ran out before "
        f"two timing windows (first batch after {measurement.time_to_first_batch:.1f} s, "
        f"{measurement.batches} batches timed), so its rate has no error estimate and is "
        "not counted"
    )
