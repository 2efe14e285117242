"""The search's rules, tested as pure functions of made-up trials, and the driver
against a fake runner and a fake clock: no processes, milliseconds each."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import optuna
import pytest

from autoloader import AllSettingsFailedError, AutoloaderError, BaselineError
from autoloader.loader._params import BASELINE_PARAMS, normalize_params
from autoloader.measure._errors import TrialError
from autoloader.measure._measurement import Measurement
from autoloader.results._record import record_of
from autoloader.search import (
    Completed,
    Driver,
    Failed,
    FaultKind,
    Phase,
    Plan,
    Policy,
    Pruned,
    PruneKind,
    Stop,
    Trial,
)
from autoloader.search._known_failures import (
    _asks_at_least,
    bisection,
    boundary,
    failing_from,
    known_failure,
)
from autoloader.search._objective import epoch_samples_per_second, trial_seconds
from autoloader.search._reasons import (
    BaselineUncertain,
    BatchedFetchSearched,
    BudgetGivenBack,
    Interrupted,
    NoAccelerator,
    NoGain,
    Note,
    NothingNewToPropose,
    NothingToMeasureAgain,
    NoTimeForRunoff,
    NoWorkerSettingMeasured,
    PinMemoryAskedForInVain,
    ProcessesOnly,
    Resumed,
    RunoffDone,
    SearchDidNotRun,
    SearchShareSpent,
    StepBound,
    StepThreadsLeft,
    StepThreadsSearched,
    StepThreadsToApply,
    ThreadsSearched,
    TrialCap,
    TunedJointly,
    WorkersCappedAtCores,
    WorkersCappedAtEpoch,
    WorkersCappedAtStartup,
    render,
)
from autoloader.search._space import SearchSpace, Startup, resolve_space


def _measurement(rate: float, *, ttfb: float = 1.0, restart: float | None = None) -> Measurement:
    return Measurement(
        samples_per_second=rate,
        relative_error=0.01,
        data_wait_fraction=0.1,
        load_seconds=0.5,
        step_seconds=0.01,
        time_to_first_batch=ttfb,
        epoch_restart_seconds=restart,
        batches=100,
        duration=2.0,
        peak_memory=1,
    )


def _params(workers: int, *, persistent: bool = False, prefetch: int = 2) -> dict[str, Any]:
    return normalize_params(
        {"num_workers": workers, "prefetch_factor": prefetch, "persistent_workers": persistent}
    )


def test_epoch_model_charges_startup_every_epoch_without_persistent_workers() -> None:
    # 10 batches of 10 samples at 100 samples/s: the 9 after the first take 0.9 s.
    value = epoch_samples_per_second(
        _params(4),
        _measurement(100.0, ttfb=3.0),
        batch_size=10,
        batches_per_epoch=10,
        refill_seconds=0.5,
    )
    assert value == pytest.approx(100 / (3.0 + 0.9))


def test_epoch_model_charges_only_a_refill_with_persistent_workers() -> None:
    value = epoch_samples_per_second(
        _params(4, persistent=True),
        _measurement(100.0, ttfb=3.0),
        batch_size=10,
        batches_per_epoch=10,
        refill_seconds=0.5,
    )
    assert value == pytest.approx(100 / (0.5 + 0.9))


def test_epoch_model_prefers_a_measured_restart() -> None:
    value = epoch_samples_per_second(
        _params(4, persistent=True),
        _measurement(100.0, ttfb=3.0, restart=0.2),
        batch_size=10,
        batches_per_epoch=10,
        refill_seconds=0.5,
    )
    assert value == pytest.approx(100 / (0.2 + 0.9))


def test_whole_epochs_timed_by_the_trial_are_the_objective() -> None:
    """The steady rate and the restart leave out the drain and the refill around an
    epoch's edges; where the trial timed whole epochs, that rate is used as it is."""
    measured = dataclasses.replace(
        _measurement(100.0, ttfb=3.0, restart=0.2), epochs_samples_per_second=61.0
    )
    value = epoch_samples_per_second(
        _params(16, persistent=True),
        measured,
        batch_size=10,
        batches_per_epoch=10,
        refill_seconds=0.5,
    )
    assert value == 61.0


def test_an_undrained_burst_makes_a_measurement_too_short_unless_whole_epochs_were_timed() -> None:
    measured = dataclasses.replace(_measurement(100.0), burst_left=50, batches=100)
    assert measured.burst_undrained and measured.too_short
    assert not dataclasses.replace(measured, burst_left=49).too_short  # the rest tell
    assert not dataclasses.replace(measured, epochs_samples_per_second=90.0).too_short


def test_epoch_model_without_epoch_length_is_the_steady_rate() -> None:
    value = epoch_samples_per_second(
        _params(4), _measurement(123.0), batch_size=10, batches_per_epoch=None, refill_seconds=0.5
    )
    assert value == 123.0


def test_trial_seconds_is_a_bounded_share_of_the_budget() -> None:
    assert trial_seconds(5) == 1.0
    assert trial_seconds(60) == 6.0
    assert trial_seconds(3600) == 15.0


# Made-up trials -------------------------------------------------------------------


def _space(**options: Any) -> SearchSpace:
    space, _ = SearchSpace(**{"num_workers": (0, 16), **options}).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    return space


def _policy(budget: float = 30.0, **options: Any) -> Policy:
    return Policy(space=_space(), time_budget=budget, batch_size=8, usable_cpus=2, **options)


def _done(
    number: int,
    params: Mapping[str, Any],
    value: float,
    *,
    phase: Phase = Phase.SEARCH,
    wait: float = 0.5,
    earlier: bool = False,
    duration: float = 2.0,
) -> Trial:
    measurement = dataclasses.replace(
        _measurement(value), data_wait_fraction=wait, duration=duration
    )
    return Trial(number, phase, dict(params), Completed(measurement, value), earlier=earlier)


def _measured(trial: Trial, **fields: Any) -> Trial:
    """``trial``, its measurement's ``fields`` replaced (its value kept)."""
    assert isinstance(trial.outcome, Completed)
    measurement = dataclasses.replace(trial.outcome.measurement, **fields)
    return dataclasses.replace(
        trial, outcome=dataclasses.replace(trial.outcome, measurement=measurement)
    )


def _failed(
    number: int, params: Mapping[str, Any], kind: FaultKind = FaultKind.WORKER_CRASHED
) -> Trial:
    return Trial(number, Phase.SEARCH, dict(params), Failed(kind, f"{kind.value}: made up"))


def _pruned(number: int, params: Mapping[str, Any], kind: PruneKind) -> Trial:
    return Trial(number, Phase.SEARCH, dict(params), Pruned(kind, f"{kind.value}: made up"))


def _baseline(value: float = 100.0, **kwargs: Any) -> Trial:
    return _done(0, BASELINE_PARAMS, value, phase=Phase.BASELINE, **kwargs)


def test_the_baseline_comes_first_and_a_resumed_run_does_not_repeat_it() -> None:
    policy = _policy()
    plan = policy.next([], seconds_left=30)
    assert isinstance(plan, Plan) and plan.phase is Phase.BASELINE
    assert plan.params == BASELINE_PARAMS
    resumed = policy.next([_baseline(earlier=True)], seconds_left=30)
    assert isinstance(resumed, Plan) and resumed.phase is Phase.SEARCH


def test_the_cost_models_guesses_come_before_the_doubling_ladder() -> None:
    # The baseline waits 0.05 s on I/O per batch and steps in 0.01 s: the model wants
    # 5 workers (and one more for jitter), then the ladder brackets them.
    baseline = _baseline()
    assert baseline.measurement is not None
    io_bound = dataclasses.replace(baseline.measurement, load_seconds=0.05, step_seconds=0.01)
    measured = dataclasses.replace(baseline, outcome=Completed(io_bound, 100.0))
    points = _policy().starting_points([measured])
    assert [p["num_workers"] for p in points] == [5, 6, 1, 2, 4, 8, 16]
    # A guess past the space is held to it: 50 workers wanted, 16 allowed, measured first.
    assert [p["num_workers"] for p in _policy().starting_points([baseline])] == [16, 1, 2, 4, 8]


def _quick_loading(trial: Trial) -> Trial:
    """``trial``, a baseline whose loading took 1 ms a batch: no rung is out of reach."""
    return _measured(trial, load_seconds=0.001)


def _proposed(policy: Policy, history: list[Trial], count: int) -> list[int]:
    """The worker counts of ``policy``'s next ``count`` proposals, each recorded in
    ``history`` as done (trial n scoring 100 + n samples/s)."""
    seen = []
    for _ in range(count):
        plan = policy.next(history, seconds_left=30)
        assert isinstance(plan, Plan) and plan.params is not None
        seen.append(plan.params["num_workers"])
        history.append(_done(len(history), plan.params, 100.0 + len(history)))
    return seen


def test_starting_points_are_proposed_in_order_and_never_twice() -> None:
    policy = _policy()
    history = [_quick_loading(_baseline())]
    assert _proposed(policy, history, 5) == [1, 2, 4, 8, 16]
    sampled = policy.next(history, seconds_left=30)
    assert isinstance(sampled, Plan) and sampled.params is None  # the sampler's turn


def test_a_starting_point_that_cannot_win_is_not_measured() -> None:
    """NOTE [ Starting points that cannot win ]: the baseline loads a batch of 8 in
    0.5 s; the guess held to the space (16 workers) scored 101 samples/s; 1 and 2
    workers could give at most 16 and 32, under 60% of it, and are left out. 4 workers
    (64 at best) are measured, as are whole batches fetched without workers."""
    policy = _policy()
    history = [_baseline()]
    assert _proposed(policy, history, 3) == [16, 4, 8]
    assert policy.cannot_win(_params(2), history)
    assert not policy.cannot_win(_params(4), history)
    assert not policy.cannot_win({**_params(2), "batched_fetch": True}, history)
    sampled = policy.next(history, seconds_left=30)
    assert isinstance(sampled, Plan) and sampled.params is None  # the sampler's turn


def test_a_loop_bound_by_its_step_at_the_baseline_is_not_searched() -> None:
    policy = _policy()
    history = [_baseline(wait=0.01)]
    assert isinstance(policy.next(history, seconds_left=30), Stop)
    assert policy.step_bound(history) == StepBound(0, 0.01, 0, at_baseline=True)


def test_the_search_stops_at_the_first_setting_bound_by_its_step() -> None:
    policy = _policy()
    history = [_baseline(), _done(1, _params(4), 500.0, wait=0.02)]
    plan = policy.next(history, seconds_left=30)
    assert isinstance(plan, Plan) and plan.phase is Phase.RUNOFF
    assert policy.step_bound(history) == StepBound(1, 0.02, 1, at_baseline=False)


def test_patience_ends_the_search_after_the_starting_points() -> None:
    policy = _policy()
    history = [_baseline()]
    for number, params in enumerate(policy.starting_points(history), start=1):
        history.append(_done(number, params, 500.0))
    for number in range(6, 11):
        history.append(_done(number, _params(number), 505.0))  # within 2%
        assert policy.search_ended(history, seconds_left=30) is None
    history.append(_done(11, _params(11), 501.0))
    assert policy.search_ended(history, seconds_left=30) == NoGain(6)


def test_a_gain_resets_patience() -> None:
    policy = _policy()
    history = [_baseline()]
    for number, params in enumerate(policy.starting_points(history), start=1):
        history.append(_done(number, params, 500.0))
    for number in range(6, 12):
        history.append(_done(number, _params(number), 500.0 if number != 9 else 600.0))
    assert policy.search_ended(history, seconds_left=30) is None


def test_in_training_the_baseline_measures_half_a_trials_time() -> None:
    tune_plan = _policy().next([], seconds_left=30)
    training_plan = _policy(in_training=True).next([], seconds_left=30)
    assert isinstance(tune_plan, Plan) and isinstance(training_plan, Plan)
    assert training_plan.phase is Phase.BASELINE
    assert training_plan.max_seconds == pytest.approx(0.5 * tune_plan.max_seconds)
    # Never under half the shortest trial, nor past the run's end.
    short = _policy(budget=5.0, in_training=True).next([], seconds_left=5)
    assert isinstance(short, Plan) and short.max_seconds == pytest.approx(0.5)


def test_in_training_the_starting_points_count_in_patience() -> None:
    # AutoLoader's search: the best starting point first, the next three no better.
    policy = _policy(in_training=True)
    history = [_baseline()]
    points = policy.starting_points(history)
    assert len(points) >= 4
    for number, params in enumerate(points, start=1):
        if number > 1 and number <= len(points) - 1:
            assert policy.search_ended(history, seconds_left=30) is None
        history.append(_done(number, params, 500.0 if number == 1 else 505.0))
    assert policy.search_ended(history, seconds_left=30) == NoGain(3)
    # The same trials in tune(): its patience starts after the starting points.
    assert _policy().search_ended(history, seconds_left=30) is None


def test_in_training_a_gain_within_the_trials_own_error_is_no_gain() -> None:
    # The images case: a starting point 3% over the best at +-5% does not reset it.
    def noisy(trial: Trial, error: float) -> Trial:
        assert isinstance(trial.outcome, Completed)
        measurement = dataclasses.replace(trial.outcome.measurement, relative_error=error)
        return dataclasses.replace(trial, outcome=Completed(measurement, trial.outcome.value))

    history = [_baseline()]
    points = _policy(in_training=True).starting_points(history)
    values = [500.0, 490.0, 480.0, 515.0]
    for number, (params, value) in enumerate(zip(points, values, strict=False), start=1):
        history.append(noisy(_done(number, params, value), 0.05))
    history += [_done(number, points[number - 1], 480.0) for number in range(5, len(points) + 1)]
    assert _policy(in_training=True).search_ended(history, seconds_left=30) == NoGain(3)
    # Measured to 1%, the same 3% is a gain.
    history[4] = noisy(history[4], 0.01)
    assert _policy(in_training=True).search_ended(history, seconds_left=30) is None


def test_in_training_the_starting_points_are_measured_before_patience_ends_it() -> None:
    policy = _policy(in_training=True)
    history = [_baseline()]
    points = policy.starting_points(history)
    for number, params in enumerate(points[:-1], start=1):
        history.append(_done(number, params, 120.0))  # the last one could still win
    # Three in a row without gain, but a starting point is left to measure.
    assert len(history) - 1 >= 4
    assert policy.search_ended(history, seconds_left=30) is None
    plan = policy.next(history, seconds_left=30)
    assert isinstance(plan, Plan) and plan.params == points[-1]


def test_in_training_a_starting_point_that_gains_keeps_the_search_going() -> None:
    policy = _policy(in_training=True)
    history = [_baseline()]
    for number, params in enumerate(policy.starting_points(history), start=1):
        history.append(_done(number, params, 500.0 + 50.0 * number))  # each one better
    assert policy.search_ended(history, seconds_left=30) is None
    history += [_done(number, _params(number), 400.0) for number in range(20, 22)]
    assert policy.search_ended(history, seconds_left=30) is None
    history.append(_done(22, _params(22), 400.0))
    assert policy.search_ended(history, seconds_left=30) == NoGain(3)


def test_the_search_leaves_the_runoff_its_share_of_the_budget() -> None:
    policy = _policy(budget=30.0)  # the runoff keeps 6 s
    history = [_baseline(), _done(1, _params(4), 500.0, duration=1.0)]
    assert policy.search_ended(history, seconds_left=6.9) == SearchShareSpent()
    assert policy.search_ended(history, seconds_left=7.0) is None


def test_a_search_trial_starts_only_where_its_typical_duration_fits() -> None:
    policy = _policy(budget=30.0)  # the runoff keeps 6 s; the search's trials take 2 s
    history = [_baseline(), _done(1, _params(4), 500.0), _done(2, _params(8), 450.0)]
    assert policy.search_ended(history, seconds_left=7.9) == SearchShareSpent()
    assert policy.search_ended(history, seconds_left=8.0) is None


def test_the_runoff_keeps_one_measurement_of_its_first_candidate() -> None:
    # A 10 s budget leaves the runoff 2 s, less than the best's trial took (NOTE [ Trials
    # that fit ]): the search ends where the best can be measured again, and it is.
    policy = _policy(budget=10.0)
    history = [
        _baseline(),
        _done(1, _params(12), 2000.0, duration=2.3),
        _done(2, _params(8), 1600.0, duration=1.7),
    ]
    assert policy.search_ended(history, seconds_left=4.4) is None
    assert policy.search_ended(history, seconds_left=4.2) == SearchShareSpent()
    plan = policy.next(history, seconds_left=4.2)
    assert isinstance(plan, Plan) and plan.phase is Phase.RUNOFF
    assert plan.params == _params(12)


def test_n_trials_caps_this_runs_search_but_not_earlier_runs_trials() -> None:
    policy = _policy(n_trials=2)
    history = [_baseline(), _done(1, _params(2), 200.0, earlier=True), _done(2, _params(3), 300.0)]
    assert policy.search_ended(history, seconds_left=30) is None
    history.append(_done(3, _params(5), 300.0))
    assert policy.search_ended(history, seconds_left=30) == TrialCap(2)


def test_every_setting_failing_stops_the_run() -> None:
    policy = _policy()
    history = [_baseline(), *(_failed(n, _params(n)) for n in range(1, 6))]
    with pytest.raises(AllSettingsFailedError, match="All 5 settings with workers failed"):
        policy.next(history, seconds_left=30)


def test_the_runoff_measures_the_candidates_best_first_then_the_baseline() -> None:
    policy = _policy()
    history = [_baseline(wait=0.5)]
    for number, (workers, value) in enumerate([(2, 300.0), (4, 500.0), (8, 450.0), (16, 400.0)]):
        history.append(_done(number + 1, _params(workers), value))
    order = [p["num_workers"] for p in policy.runoff_order(history)]
    assert order == [4, 8, 16]
    planned = []
    runoff_started = [*history, _done(9, _params(4), 500.0, phase=Phase.RUNOFF)]
    for number in range(10, 20):
        plan = policy.next(runoff_started, seconds_left=30)
        if isinstance(plan, Stop):
            break
        assert plan.phase is Phase.RUNOFF and plan.params is not None
        planned.append(plan.params["num_workers"])
        runoff_started.append(_done(number, plan.params, 400.0, phase=Phase.RUNOFF))
    assert planned == [8, 16, 0, 4, 8, 16, 0]  # two rounds in all, then it stops


def test_a_runoff_without_the_baseline_measures_the_candidates_alone() -> None:
    """AutoLoader's (runoff_baseline=False): in the training loop, a baseline trial is
    training at the defaults' pace, measured once is enough."""
    policy = dataclasses.replace(_policy(), runoff_baseline=False)
    history = [_baseline(wait=0.5)]
    for number, (workers, value) in enumerate([(2, 300.0), (4, 500.0), (8, 450.0)]):
        history.append(_done(number + 1, _params(workers), value))
    history.append(_done(9, _params(4), 500.0, phase=Phase.RUNOFF))  # the runoff began
    planned = []
    for number in range(10, 20):
        plan = policy.next(history, seconds_left=30)
        if isinstance(plan, Stop):
            break
        assert plan.phase is Phase.RUNOFF and plan.params is not None
        planned.append(plan.params["num_workers"])
        history.append(_done(number, plan.params, 400.0, phase=Phase.RUNOFF))
    assert planned == [8, 2, 4, 8, 2]  # two rounds in all, then it stops


def test_the_runoff_stops_when_the_next_trial_does_not_fit() -> None:
    policy = _policy()
    history = [_baseline(), _done(1, _params(4), 500.0, duration=3.0)]
    runoff = policy.next(history, seconds_left=3.5)
    assert isinstance(runoff, Plan) and runoff.phase is Phase.RUNOFF
    stop = policy.next(history, seconds_left=2.5)
    assert isinstance(stop, Stop) and isinstance(stop.why, NoTimeForRunoff)


# Failures ---------------------------------------------------------------------------


def test_a_setting_that_failed_is_known_to_fail_but_not_an_interrupted_one() -> None:
    history = [_baseline(), _failed(1, _params(4)), _failed(2, _params(6), FaultKind.INTERRUPTED)]
    known = known_failure(_params(4), history)
    assert isinstance(known, Failed) and known.same_as == 1
    assert known.kind is FaultKind.WORKER_CRASHED
    assert known_failure(_params(6), history) is None


def test_a_setting_that_asks_more_memory_than_one_over_budget_is_not_run() -> None:
    over = Trial(1, Phase.SEARCH, _params(4), Pruned(PruneKind.MEMORY, "memory: over"))
    known = known_failure(_params(8, prefetch=4), [_baseline(), over])
    assert isinstance(known, Pruned) and known.kind is PruneKind.MEMORY
    assert "asks at least as much memory as trial 1" in known.reason
    assert known_failure(_params(2), [_baseline(), over]) is None


def test_failures_at_two_counts_above_every_success_mark_a_boundary_and_bisect() -> None:
    policy = _policy()
    history = [_quick_loading(_baseline()), _done(1, _params(2), 300.0), _failed(2, _params(16))]
    assert boundary(history) == (2, 16)
    # One failure could be bad luck: counts above it are still run.
    assert known_failure(_params(12), history) is None
    history.append(_failed(3, _params(8)))
    assert boundary(history) == (2, 8)
    assert failing_from(history) == 8
    known = known_failure(_params(12, prefetch=4), history)
    assert isinstance(known, Failed) and "every count from 8 workers up" in known.reason
    between = bisection(history)
    assert between is not None and between["num_workers"] == 5
    plan = policy.next(history, seconds_left=30)
    assert isinstance(plan, Plan) and plan.params is not None
    assert plan.params["num_workers"] in (1, 4)  # starting points first...
    ladder = {p["num_workers"]: p for p in policy.starting_points(history)}
    history += [_done(4, ladder[1], 150.0), _done(5, ladder[4], 400.0), _done(6, ladder[2], 1.0)]
    plan = policy.next(history, seconds_left=30)
    assert isinstance(plan, Plan) and plan.params is not None
    assert plan.params["num_workers"] == 6  # ...then halfway between 4 and 8
    history.append(_failed(7, _params(6)))
    plan = policy.next(history, seconds_left=30)
    assert isinstance(plan, Plan) and plan.params is not None and plan.params["num_workers"] == 5
    history.append(_done(8, _params(5), 420.0))
    assert bisection(history) is None  # 5 works, 6 fails: found
    assert known_failure(_params(7), history) is not None


def test_sigkilled_workers_at_two_counts_mark_a_boundary_whatever_their_prefetch() -> None:
    """Workers from index 2 up SIGKILLed: 4 workers (prefetch 2) and 9 (prefetch 5) were
    killed, so 9 workers with prefetch 1, which asks less memory than either by the
    memory rule, is known to fail too, and the search bisects below 4 (AutoLoader ran
    it and reloaded its batches, 10 s of a 20 s budget)."""
    history = [_baseline(), _done(1, _params(2), 600.0)]
    history.append(_pruned(2, _params(4), PruneKind.KILLED))
    assert known_failure(_params(9, prefetch=1), history) is None  # one could be luck
    history.append(_pruned(3, _params(9, prefetch=5), PruneKind.KILLED))
    assert boundary(history) == (2, 4) and failing_from(history) == 4
    known = known_failure(_params(9, prefetch=1), history)
    assert isinstance(known, Pruned) and known.kind is PruneKind.KILLED
    assert known.same_as == 2 and "every count from 4 workers up" in known.reason
    between = bisection(history)
    assert between is not None and between["num_workers"] == 3


def test_memory_and_shared_memory_faults_do_not_mark_a_boundary() -> None:
    history = [
        _baseline(),
        _done(1, _params(2), 300.0),
        _failed(2, _params(8), FaultKind.SHARED_MEMORY),
        _failed(3, _params(16), FaultKind.SHARED_MEMORY),
    ]
    assert boundary(history) is None


# The vote -----------------------------------------------------------------------------


def test_the_vote_stops_a_clearly_slower_search_trial_after_two_windows() -> None:
    policy = _policy()
    history = [_baseline(), _done(1, _params(4), 1000.0)]
    slow = _measurement(500.0)
    assert not policy.vote(Phase.SEARCH, _params(8), 1, slow, history)  # too early
    assert policy.vote(Phase.SEARCH, _params(8), 2, slow, history)
    assert not policy.vote(Phase.SEARCH, _params(8), 4, _measurement(700.0), history)
    assert not policy.vote(Phase.RUNOFF, _params(8), 4, slow, history)  # always measured


def test_without_a_complete_trial_the_vote_keeps_everything() -> None:
    assert not _policy().vote(Phase.SEARCH, _params(8), 5, _measurement(1.0), [])


def test_a_trial_too_short_to_trust_is_pruned_as_such() -> None:
    policy = _policy()
    short = dataclasses.replace(_measurement(900.0), relative_error=math.inf, batches=1)
    outcome = policy.judge(Phase.SEARCH, _params(16), short, [_baseline()])
    assert isinstance(outcome, Pruned) and outcome.kind is PruneKind.TOO_SHORT
    assert outcome.reason.startswith("too short: the trial's ")
    baseline = policy.judge(Phase.BASELINE, BASELINE_PARAMS, short, [])
    assert isinstance(baseline, Completed)  # the baseline is what there is


# The choice --------------------------------------------------------------------------


def test_choose_takes_the_best_median_over_repeats() -> None:
    history = [
        _baseline(100.0),
        _done(1, _params(8), 500.0),
        _done(2, _params(8), 400.0, phase=Phase.RUNOFF),
        _done(3, _params(8), 410.0, phase=Phase.RUNOFF),
        _done(4, _params(4), 460.0),
        _done(5, _params(4), 470.0, phase=Phase.RUNOFF),
        _done(6, BASELINE_PARAMS, 90.0, phase=Phase.RUNOFF),
    ]
    choice = _policy().choose(history)
    assert choice.params == _params(4)
    assert choice.throughput == 465
    assert choice.baseline == 95


def _epoch(
    number: int,
    params: Mapping[str, Any],
    value: float,
    steady: float,
    *,
    ttfb: float,
    restart: float | None = None,
    phase: Phase = Phase.SEARCH,
) -> Trial:
    """A complete trial whose objective (``value``) is not its steady rate."""
    measurement = _measurement(steady, ttfb=ttfb, restart=restart)
    return Trial(number, phase, dict(params), Completed(measurement, value))


def test_choose_ranks_by_the_objective_and_gives_the_steady_rates_and_startup() -> None:
    """8 workers started every epoch are faster once started, 4 persistent ones over an
    epoch: the choice, its throughput and the baseline's are the epoch rates; the
    steady rates and the start-up come beside them."""
    persistent = _params(4, persistent=True)
    history = [
        _epoch(0, BASELINE_PARAMS, 100.0, 110.0, ttfb=0.1, phase=Phase.BASELINE),
        _epoch(1, _params(8), 400.0, 900.0, ttfb=3.0),
        _epoch(2, persistent, 600.0, 640.0, ttfb=1.0, restart=0.1),
        _epoch(3, _params(8), 420.0, 950.0, ttfb=2.8, restart=2.0, phase=Phase.RUNOFF),
        _epoch(4, persistent, 620.0, 660.0, ttfb=1.4, restart=0.2, phase=Phase.RUNOFF),
        _epoch(5, BASELINE_PARAMS, 90.0, 104.0, ttfb=0.1, phase=Phase.RUNOFF),
    ]
    choice = _policy().choose(history)
    assert choice.params == persistent
    assert (choice.throughput, choice.baseline) == (610.0, 95.0)
    assert (choice.steady_throughput, choice.steady_baseline) == (650.0, 107.0)
    # Persistent workers start once per run: the time to first batch, not the refills.
    assert choice.startup_seconds == pytest.approx(1.2)
    assert choice.startup_each_epoch is False
    # Workers started every epoch pay a measured restart, else the time to first batch.
    spawned = _policy().choose([t for t in history if t.params != persistent])
    assert spawned.params == _params(8)
    assert (spawned.throughput, spawned.steady_throughput) == (410.0, 925.0)
    assert spawned.startup_seconds == pytest.approx((3.0 + 2.0) / 2)
    assert spawned.startup_each_epoch is True


def test_choose_without_a_complete_trial_raises_an_autoloader_error() -> None:
    with pytest.raises(BaselineError, match="No trial completed, not even the baseline"):
        _policy().choose([_failed(1, _params(2))])
    assert issubclass(BaselineError, AutoloaderError)


def test_choose_breaks_ties_towards_the_cheapest_setting() -> None:
    history = [
        _baseline(100.0),
        _done(1, _params(12, prefetch=8), 700.0),
        _done(2, _params(6, prefetch=4), 690.0),
        _done(3, _params(6, prefetch=2), 689.0),
        _done(4, _params(5), 600.0),
    ]
    assert _policy().choose(history).params == _params(6, prefetch=2)


def test_a_setting_measured_once_does_not_beat_settings_measured_side_by_side() -> None:
    """16 workers got one lucky sample in the search; 4 and 8 workers were measured
    again in the runoff, interleaved."""
    history = [
        _baseline(100.0),
        _done(1, _params(4), 480.0),
        _done(2, _params(8), 500.0),
        _done(3, _params(16), 560.0),
        _done(4, _params(8), 505.0, phase=Phase.RUNOFF),
        _done(5, _params(4), 470.0, phase=Phase.RUNOFF),
    ]
    assert _policy().choose(history).params == _params(8)


def test_the_baselines_repeat_alone_does_not_outrank_a_setting_measured_once() -> None:
    """The tutorial on a 10 s budget (CI): 15 workers measured once at 7.6x, their
    runoff repeat too short to count, the baseline measured again: the workers win."""
    history = [
        _baseline(257.0),
        _done(1, _params(15), 1951.0),
        Trial(2, Phase.SEARCH, _params(16), Pruned(PruneKind.TOO_SHORT, "too short")),
        Trial(3, Phase.RUNOFF, _params(15), Pruned(PruneKind.TOO_SHORT, "too short")),
        _done(4, BASELINE_PARAMS, 179.0, phase=Phase.RUNOFF),
    ]
    assert _policy().choose(history).params == _params(15)


def test_a_cheaper_setting_measured_once_ties_with_a_best_measured_again() -> None:
    """The runoff had the time to measure only its first candidate again (the images
    pipeline, 20 s budget): 3 workers, measured once within the error of 4 workers'
    median, tie with them and cost less. Outside that error, they do not."""
    history = [
        _baseline(533.0),
        _erring(_done(1, _params(2), 882.0), 0.08),
        _erring(_done(2, _params(3), 926.0), 0.09),
        _erring(_done(3, _params(4), 955.0), 0.07),
        _erring(_done(4, _params(4), 969.0, phase=Phase.RUNOFF), 0.07),
    ]
    assert _policy().choose(history).params == _params(3)
    history[2] = _erring(_done(2, _params(3), 880.0), 0.09)
    assert _policy().choose(history).params == _params(4)


def _erring(trial: Trial, error: float) -> Trial:
    """``trial``, its measurement's relative error ``error``."""
    return _measured(trial, relative_error=error)


def test_a_best_within_its_own_error_of_a_cheaper_setting_is_a_tie() -> None:
    """NOTE [ A tie within the best's error ]: no runoff had the time; 16 workers scored
    6% above 2 workers in a trial that ended at +-20%, 2 workers at +-5%."""
    history = [
        _baseline(600.0),
        _erring(_done(1, _params(2), 1091.0), 0.05),
        _erring(_done(2, _params(16), 1162.0), 0.20),
    ]
    assert _policy().choose(history).params == _params(2)
    # Measured to +-1%, the same 6% is not a tie: the best wins.
    history[2] = _erring(history[2], 0.01)
    assert _policy().choose(history).params == _params(16)
    # Measured twice (the runoff), its median's error is its trials' over sqrt(2): a
    # 4% lead at +-5% each (3.5% the median's) is not a tie; at +-7% (4.9%) it is.
    again = [
        _baseline(600.0),
        *(_erring(_done(n, _params(2), 1000.0), 0.05) for n in (1, 3)),
        *(_erring(_done(n, _params(4), 1040.0, phase=Phase.RUNOFF), 0.05) for n in (2, 4)),
    ]
    assert _policy().choose(again).params == _params(4)
    again[3:] = [_erring(trial, 0.07) for trial in again[3:]]
    assert _policy().choose(again).params == _params(2)


def _steady(trial: Trial, rate: float, error: float) -> Trial:
    """``trial``, its measurement's steady rate ``rate`` at ``error``: its value an
    epoch's rate, the pipeline's refill each epoch included."""
    return _measured(trial, samples_per_second=rate, relative_error=error)


def test_the_tie_band_is_the_error_of_the_epochs_rate_not_the_steady_rates() -> None:
    """12-batch epochs in a DDP fit: 12 workers' steady rate measured at +-49% is a third
    of their epoch's time, the refill the rest; their epoch's rate leads 8 workers' by
    30%, no tie (8 workers trained 1.3x slower)."""
    history = [
        _baseline(311.0),
        _steady(_done(1, _params(8), 1595.0), 2912.0, 0.20),
        _steady(_done(2, _params(12), 2075.0), 5983.0, 0.49),
    ]
    assert _policy().choose(history).params == _params(12)
    # Where the steady rate is the epoch's, its whole error counts: a tie.
    history[2] = _steady(_done(2, _params(12), 2075.0), 2075.0, 0.49)
    assert _policy().choose(history).params == _params(8)


def test_a_lead_of_a_quarter_is_no_tie_however_short_the_trials() -> None:
    """A 4 s budget in a Lightning DDP fit: 0.8 s trials end at +-37%; 3 workers' 48%
    lead over the defaults is not a tie, 4 workers' 5% behind them is."""
    history = [
        _erring(_baseline(211.0), 0.13),
        _erring(_done(1, _params(3), 312.0), 0.37),
        _erring(_done(2, _params(4), 297.0), 0.25),
    ]
    assert _policy().choose(history).params == _params(3)


def test_choose_ignores_pruned_and_failed_trials() -> None:
    history = [
        _baseline(100.0),
        Trial(1, Phase.SEARCH, _params(9), Pruned(PruneKind.TOO_SHORT, "too short")),
        _failed(2, _params(7)),
    ]
    assert _policy().choose(history).params == BASELINE_PARAMS


def test_heavy_tailed_noise_rarely_fools_the_choice() -> None:
    """Two settings 10% apart, each measured three times with log-normal noise
    (sigma 0.1 per measurement: what a second of batches with sigma-1 item latency
    leaves): the slower one must not win often."""
    rng = random.Random(0)
    wins = 0
    for _ in range(200):
        history = [_baseline(100.0)]
        number = 1
        for _round in range(3):
            for workers, true in ((4, 1000.0), (6, 900.0)):
                phase = Phase.SEARCH if _round == 0 else Phase.RUNOFF
                value = true * rng.lognormvariate(0.0, 0.1)
                history.append(_done(number, _params(workers), value, phase=phase))
                number += 1
        wins += _policy().choose(history).params == _params(4)
    assert wins >= 180


@pytest.mark.parametrize(
    ("params", "other", "expected"),
    [
        ({"num_workers": 4, "prefetch_factor": 2}, {"num_workers": 2, "prefetch_factor": 2}, True),
        ({"num_workers": 2, "prefetch_factor": 4}, {"num_workers": 2, "prefetch_factor": 2}, True),
        ({"num_workers": 4, "prefetch_factor": 1}, {"num_workers": 2, "prefetch_factor": 2}, False),
        ({"num_workers": 1, "prefetch_factor": 8}, {"num_workers": 2, "prefetch_factor": 2}, False),
        (
            {"num_workers": 2, "prefetch_factor": 2},
            {"num_workers": 2, "prefetch_factor": 2, "pin_memory": True},
            False,
        ),
        ({"num_workers": 0}, {"num_workers": 0}, False),
    ],
)
def test_a_setting_asks_at_least_the_memory_of_one_it_dominates(
    params: dict[str, Any], other: dict[str, Any], expected: bool
) -> None:
    assert _asks_at_least(normalize_params(params), normalize_params(other)) is expected


# The driver against a fake runner and a fake clock ------------------------------------


class FakeRunner:
    """Answers each setting with a made-up measurement of ``rate(num_workers)``,
    advancing a fake clock by the trial's length. ``fails(num_workers)`` raises a
    worker crash instead, ``too_short(num_workers)`` leaves no error estimate."""

    batch_size = 8

    def __init__(
        self,
        rate: Callable[[int], float],
        *,
        too_short: Callable[[int], bool] = lambda workers: False,
        fails: Callable[[int], bool] = lambda workers: False,
        seconds: float = 1.0,
    ) -> None:
        self.rate = rate
        self.too_short = too_short
        self.fails = fails
        self.seconds = seconds
        self.now = 0.0
        self.measured: list[dict[str, Any]] = []

    def clock(self) -> float:
        return self.now

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: Any = None,
        deadlines: Any = None,
        max_batches: int | None = None,
    ) -> Measurement:
        self.measured.append(dict(params))
        self.now += min(self.seconds, max_seconds)
        workers = int(params["num_workers"])
        if self.fails(workers):
            error = TrialError("loading a batch", RuntimeError("made up"), 1)
            error.worker_signals = [11]  # SIGSEGV
            raise error
        return dataclasses.replace(
            _measurement(self.rate(workers)),
            relative_error=math.inf if self.too_short(workers) else 0.01,
            data_wait_fraction=0.5,
            load_seconds=0.02,
            step_seconds=0.01,
            batches=1 if self.too_short(workers) else 100,
            duration=self.seconds,
        )


def _driver(
    runner: FakeRunner,
    *,
    budget: float = 30.0,
    n_trials: int | None = None,
    study: optuna.Study | None = None,
) -> Driver:
    policy = Policy(
        space=_space(), time_budget=budget, batch_size=8, n_trials=n_trials, usable_cpus=2
    )
    study = study or optuna.create_study(
        direction="maximize", sampler=optuna.samplers.TPESampler(seed=0)
    )
    return Driver(policy, runner, study, deadline=budget, clock=runner.clock)


def _peaks_at_5(workers: int) -> float:
    return 1000.0 - 40.0 * abs(workers - 5) if workers else 100.0


def test_a_run_measures_the_baseline_searches_and_runs_off_within_its_budget() -> None:
    runner = FakeRunner(_peaks_at_5)
    driver = _driver(runner)
    driver.run()
    phases = [t.phase for t in driver.history]
    assert phases[0] is Phase.BASELINE and Phase.RUNOFF in phases
    # Patience ended the search, two runoff rounds ran, and the rest was given back.
    assert driver.stopped == RunoffDone(2)
    assert driver.search_ended == NoGain(6)
    assert runner.now < 30.0
    best = max(t.value or 0 for t in driver.history)
    choice = driver.policy.choose(driver.history)
    assert _peaks_at_5(choice.params["num_workers"]) == best
    assert choice.baseline == 100.0


def test_the_driver_persists_typed_outcomes_and_a_resumed_run_chooses_among_all_trials() -> None:
    """A first run is stopped after a few trials; the second, on the same study, sees
    them as earlier trials, does not repeat the baseline or the ladder, and its choice
    counts them: the best setting was only measured by the first run."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    first = FakeRunner(lambda n: 2000.0 if n == 16 else 100.0 + n)
    _driver(first, n_trials=6, study=study, budget=12.0).run()
    assert 16 in [p["num_workers"] for p in first.measured]

    second = FakeRunner(lambda n: 100.0 + n)  # the machine is the same; 16 was not seen
    driver = _driver(second, n_trials=3, study=study, budget=12.0)
    driver.run()
    earlier = [t for t in driver.history if t.earlier]
    assert earlier and all(t.number < len(earlier) for t in earlier)
    assert second.measured[0]["num_workers"] != 0  # the baseline was not repeated
    searched_before = [t.params for t in earlier if t.phase is Phase.SEARCH]
    searched_now = [t.params for t in driver.history if t.phase is Phase.SEARCH and not t.earlier]
    assert searched_now and not [p for p in searched_now if p in searched_before]
    assert driver.policy.choose(driver.history).params["num_workers"] == 16


def test_a_worker_index_crash_is_bracketed_and_nothing_above_it_is_run_again() -> None:
    """Workers 6 and above crash (a dataset with 6 shards): after failures at 8 and 16
    the search bisects to 6 and 5, and never runs a count from 6 up again."""
    runner = FakeRunner(_peaks_at_5, fails=lambda n: n >= 6)
    driver = _driver(runner, budget=60.0)
    driver.run()
    ran = [int(p["num_workers"]) for p in runner.measured]
    crashed_at = [n for n in ran if n >= 6]
    assert set(crashed_at) >= {8, 16}
    assert 6 in crashed_at or 7 in crashed_at  # the bisection probed between 4 and 8
    assert len(crashed_at) <= 4
    skipped = [t for t in driver.history if t.skipped]
    assert all(t.workers >= 6 for t in skipped)
    # Past the boundary the sampler is asked for fewer workers: it spends no proposals
    # on counts known to fail (the starting points already skip them).
    assert failing_from(driver.history) == 6
    assert len(skipped) <= 1
    assert driver.policy.choose(driver.history).params["num_workers"] == 5


def test_a_measurement_too_short_to_trust_is_pruned_and_never_chosen() -> None:
    """16 workers look fastest, but their trial ran out before two timing windows."""
    runner = FakeRunner(lambda n: 10_000.0 if n >= 16 else 100.0 + n, too_short=lambda n: n >= 16)
    driver = _driver(runner, n_trials=6)
    driver.run()
    assert driver.policy.choose(driver.history).params["num_workers"] < 16
    short = [record_of(t) for t in driver.history if t.workers >= 16]
    assert short and all(r.state == "pruned" and r.too_short for r in short)
    assert driver.policy.shortcomings(driver.history, search_seconds=20) == []


def test_when_no_setting_with_workers_is_measured_the_result_says_so() -> None:
    driver = _driver(FakeRunner(lambda n: 100.0, too_short=lambda n: n > 0), n_trials=4)
    driver.run()
    assert driver.policy.choose(driver.history).params == BASELINE_PARAMS
    (shortcoming,) = driver.policy.shortcomings(driver.history, search_seconds=20)
    assert isinstance(shortcoming, NoWorkerSettingMeasured)
    assert [state for state, _ in shortcoming.counts] == ["pruned"]


def test_a_search_with_no_time_left_says_it_did_not_run() -> None:
    runner = FakeRunner(lambda n: 100.0)
    driver = _driver(runner, budget=1.2)
    driver.run()
    assert [t.phase for t in driver.history] == [Phase.BASELINE]
    (shortcoming,) = driver.policy.shortcomings(driver.history, search_seconds=0.2)
    assert shortcoming == SearchDidNotRun(0.2, 1.2)


def test_a_baseline_too_short_to_trust_is_said_to_be_so() -> None:
    driver = _driver(FakeRunner(lambda n: 100.0 + n, too_short=lambda n: n == 0), n_trials=3)
    driver.run()
    assert BaselineUncertain(1) in driver.policy.shortcomings(driver.history, search_seconds=20)


# Thread workers -----------------------------------------------------------------------


def _threads(workers: int, *, prefetch: int = 2) -> dict[str, Any]:
    return normalize_params(
        {"num_workers": workers, "prefetch_factor": prefetch, "worker_kind": "threads"}
    )


def _both_kinds_policy() -> Policy:
    space, _ = SearchSpace(num_workers=(0, 16)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, threads_problem=None
    )
    return Policy(space=space, time_budget=30.0, batch_size=8, usable_cpus=2)


def test_once_thread_workers_failed_no_thread_setting_is_run_again() -> None:
    """A dataset that passed the threads check but then raised (or hung) under threads:
    every thread setting is recorded failed without running; processes still run."""
    history = [_baseline(), _failed(1, _threads(4), FaultKind.ERROR)]
    known = known_failure(_threads(8, prefetch=4), history)
    assert isinstance(known, Failed) and known.same_as == 1
    assert "thread workers failed in trial 1" in known.reason
    assert known_failure(_params(4), history) is None
    interrupted = [_baseline(), _failed(1, _threads(4), FaultKind.INTERRUPTED)]
    assert known_failure(_threads(8), interrupted) is None


def test_thread_failures_mark_no_worker_count_boundary() -> None:
    history = [
        _baseline(),
        _done(1, _params(2), 300.0),
        _failed(2, _threads(8), FaultKind.TIMEOUT),
        _failed(3, _threads(16), FaultKind.TIMEOUT),
    ]
    assert boundary(history) is None
    assert known_failure(_params(12), history) is None


def test_memory_over_budget_with_processes_says_nothing_of_threads() -> None:
    """Worker processes copy what thread workers share: a process setting over the budget
    does not rule out as many threads."""
    over = Trial(1, Phase.SEARCH, _params(4), Pruned(PruneKind.MEMORY, "memory: over"))
    assert known_failure(_threads(8), [_baseline(), over]) is None


def test_the_guessed_thread_counts_follow_the_process_guesses_where_loading_waits() -> None:
    baseline = _baseline()
    assert baseline.measurement is not None
    waits = dataclasses.replace(
        baseline.measurement, load_seconds=0.05, step_seconds=0.01, load_cpu_seconds=0.005
    )
    measured = dataclasses.replace(baseline, outcome=Completed(waits, 100.0))
    points = [
        (p["worker_kind"], p["num_workers"])
        for p in _both_kinds_policy().starting_points([measured])
    ]
    assert points[:4] == [("processes", 5), ("processes", 6), ("threads", 6), ("threads", 10)]
    # Loading that is Python work under the GIL: no thread guess (the sampler may try).
    busy = dataclasses.replace(waits, load_cpu_seconds=0.045)
    on_cpu = dataclasses.replace(baseline, outcome=Completed(busy, 100.0))
    kinds = {p["worker_kind"] for p in _both_kinds_policy().starting_points([on_cpu])}
    assert kinds == {"processes"}


def test_within_two_percent_threads_are_chosen_over_worker_processes() -> None:
    """Processes cost a copy of what they read and a start-up; threads neither."""
    history = [
        _baseline(100.0),
        _done(1, _params(4), 700.0),
        _done(2, _threads(8), 695.0),
        _done(3, _threads(12), 690.0),
    ]
    assert _policy().choose(history).params == _threads(8)


# Reasons, in words -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (
            StepBound(0, 0.012, 0, at_baseline=True),
            "the loop is bound by its step already with num_workers=0: it waits for data "
            "1.2% of the time, so no setting can make it faster; nothing was searched",
        ),
        (
            StepBound(3, 0.02, 2, at_baseline=False),
            "the loop is bound by its step: with trial 3's setting it waits for data 2.0% "
            "of the time, so no setting can make it faster; the search stopped after 2 "
            "trials",
        ),
        (TrialCap(2), "n_trials=2 search trials were run"),
        (SearchShareSpent(), "the search's share of the time budget is spent"),
        (NoGain(6), "no gain in the last 6 trials: the search stops"),
        (
            NothingNewToPropose(10),
            "the sampler's last 10 proposals were all known to fail: nothing new is left to search",
        ),
        (NothingToMeasureAgain(), "nothing to measure again"),
        (RunoffDone(2), "the runoff's 2 round(s) are done"),
        (NoTimeForRunoff(), "no time left for another runoff trial"),
        (
            BaselineUncertain(1),
            "the baseline (num_workers=0) timed 1 batches before its time ran out, too few "
            "to tell its rate's error: the speedup against it is uncertain; a larger "
            "time_budget measures it properly",
        ),
        (
            SearchDidNotRun(0.24, 1.2),
            "the search did not run: the checks and the baseline left 0.2 s of the 1 s "
            "budget, too little for a trial; these are the defaults. Tune with a larger "
            "time_budget",
        ),
        (
            NoWorkerSettingMeasured((("failed", 1), ("pruned", 3))),
            "no setting with workers was measured to the end (1 failed, 3 pruned): these "
            "are the defaults, not a tuned setting; the failures say why",
        ),
        (WorkersCappedAtEpoch(5), "num_workers searched up to 5: an epoch has only 5 batches."),
        (
            PinMemoryAskedForInVain(),
            "pin_memory=True was asked for, but there is no accelerator here.",
        ),
        (NoAccelerator(), "pin_memory fixed to False: this machine has no accelerator."),
        (
            BatchedFetchSearched(),
            "batched_fetch searched: dataset[list of indices] gives the same batches as "
            "loading the items one by one and collating them.",
        ),
        (ProcessesOnly("it keeps state"), "worker_kind fixed to processes: it keeps state."),
        (
            ThreadsSearched(),
            "worker_kind searched: the dataset gave the same batches read from several "
            "threads as from one, so thread workers were measured too.",
        ),
        (
            TunedJointly(2, 2, 4),
            "tuned jointly by 2 ranks (2 per node), each with 4 of its node's CPUs: figures "
            "are samples per second of the slowest rank",
        ),
        (
            Interrupted(),
            "interrupted (Ctrl-C): these settings are the best of the trials that finished; "
            "tune again for a complete search",
        ),
        (
            BudgetGivenBack(12.4, 60.0, NoGain(6), RunoffDone(2)),
            "done in 12 s of the 60 s budget, the rest given back: no gain in the last 6 "
            "trials: the search stops, and the runoff's 2 round(s) are done",
        ),
        (
            BudgetGivenBack(3.0, 30.0, StepBound(1, 0.02, 1, at_baseline=False), RunoffDone(1)),
            "done in 3 s of the 30 s budget, the rest given back: no setting can beat the "
            "step (see above), and the runoff's 1 round(s) are done",
        ),
        (
            StepThreadsSearched(1, 4, 0.97, 3.6),
            "step_threads searched from 1 to 4: the step works on the CPU (its thread busy "
            "97% of the step, 3.6 CPUs busy in all), on the cores the workers load on.",
        ),
        (
            StepThreadsLeft(8, 0.02),
            "step_threads left as they are (8 torch threads): the step waits (its thread "
            "was on the CPU 2% of the step), so its threads do not compete with the workers.",
        ),
        (
            StepThreadsLeft(8, 0.98, "cuda:0"),
            "step_threads left as they are (8 torch threads): the step runs on cuda:0 (pass "
            "SearchSpace(step_threads=(1, N)) to search them for a step that also works on "
            "the CPU).",
        ),
        (
            StepThreadsLeft(2, 1.0, work_share=0.004),
            "step_threads left as they are (2 torch threads): the step does 0% of the CPU "
            "work per batch, too little for its threads to matter.",
        ),
        (
            WorkersCappedAtCores(2),
            "num_workers searched up to 2: loading and the step are both CPU work, and "
            "more workers than the 2 CPUs would only take turns with the step's threads.",
        ),
        (
            StepThreadsToApply(1, 2, 1, 2),
            "step_threads=1: the tuned settings train on 1 torch thread (this process had "
            "2), leaving 1 of 2 CPUs to 1 worker. No DataLoader can carry a setting of the "
            "training process: call result.apply_threads() before training (make_loader() "
            "does not).",
        ),
        (
            Resumed(7),
            "resumed from storage: 7 trials of earlier runs on the same problem were "
            "counted in the choice",
        ),
    ],
)
def test_each_reason_and_note_is_rendered_in_the_words_users_read(value: Note, words: str) -> None:
    assert render(value) == words


def test_the_space_gives_its_notes_typed_and_resolve_gives_them_in_words() -> None:
    facts: dict[str, Any] = {"usable_cpus": 2, "has_accelerator": False, "batches_per_epoch": 5}
    _, typed = resolve_space(
        SearchSpace(pin_memory=True), **facts, batched_fetch_problem="no", threads_problem=None
    )
    assert typed == [
        WorkersCappedAtEpoch(5), PinMemoryAskedForInVain(), NoAccelerator(), ThreadsSearched()
    ]  # fmt: skip
    _, words = SearchSpace(pin_memory=True).resolve(
        **facts, batched_fetch_problem="no", threads_problem=None
    )
    assert words == [render(note) for note in typed]


# Worker start-up and deadlines (NOTE [ Worker start-up ], NOTE [ Sibling pace ]) ----------


def test_a_trial_gets_its_workers_start_up_on_top_of_its_measuring_time() -> None:
    """Workers measured to take 1.5 s each to start (spawn): a trial of 4 gets 6 s more
    than one without workers, and its first batch may wait 3 x 1.5 s per worker."""
    runner = FakeRunner(_peaks_at_5)
    asked: list[tuple[int, float, Any]] = []
    measure = runner.measure

    def recording(params: Mapping[str, Any], **kwargs: Any) -> Measurement:
        asked.append((params["num_workers"], kwargs["max_seconds"], kwargs["deadlines"]))
        return measure(params, **kwargs)

    runner.measure = recording  # type: ignore[method-assign]
    policy = Policy(space=_space(), time_budget=60, batch_size=8, usable_cpus=2, worker_start=1.5)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    driver = Driver(policy, runner, study, deadline=60, clock=runner.clock)
    for _ in range(2):
        proposal = driver.propose()
        assert proposal is not None
        driver.finish(proposal, driver._run(proposal.spec))
    _, (workers, seconds, deadlines) = asked
    assert workers > 0
    assert seconds == pytest.approx(trial_seconds(60) + 1.5 * workers)
    assert deadlines.start_each == pytest.approx(4.5)
    assert deadlines.first == pytest.approx(deadlines.each + 4.5 * workers)


def test_start_up_is_the_slowest_per_worker_start_seen() -> None:
    """A trial whose first batch came 9 s after the start, with 4 workers, started them
    at about 2.2 s each: slower than the 1 s measured alone (four starting at once), so
    later trials get that."""
    policy = _policy(worker_start=1.0)
    history = [_baseline(), _done(1, _params(2), 300.0)]  # first batch after 1 s: 0.25 s each
    assert policy.hangs.start_each(history) == pytest.approx(1.0)
    slow = Trial(
        2,
        Phase.SEARCH,
        _params(4),
        Completed(dataclasses.replace(_measurement(300.0), time_to_first_batch=9.0), 300.0),
    )
    assert policy.hangs.start_each([*history, slow]) == pytest.approx((9.0 - 0.5) / 4)
    assert policy.startup_seconds(_params(4), [*history, slow]) == pytest.approx(9.0 - 0.5)
    threads = normalize_params({"num_workers": 4, "worker_kind": "threads"})
    assert policy.startup_seconds(threads, history) == 0.0
    assert _policy().startup_seconds(_params(4), history) == 0.0  # not measured


def test_the_baselines_first_step_may_take_the_budget_and_ten_seconds_at_least() -> None:
    """NOTE [ The first step ]: the run's first call of step_fn (the baseline's) does
    the step's one-time set-up; the batches keep half the budget, 3 s at least, and
    the trials after the baseline have no first-step deadline of their own."""
    short = _policy(budget=4.0).deadlines(_params(0), [])
    assert (short.first, short.each, short.first_step) == (3.0, 3.0, 10.0)
    long = _policy(budget=60.0).deadlines(_params(0), [])
    assert (long.first, long.each, long.first_step) == (30.0, 30.0, 60.0)
    assert _policy().deadlines(_params(2), [_baseline()]).first_step is None


def test_a_batch_late_by_its_siblings_pace_gets_a_multiple_of_a_workers_load_time() -> None:
    """The baseline loads a batch in 0.5 s, mostly waiting (no CPU): a worker takes
    about that whatever the count, and a batch whose siblings have delivered later ones
    is hung after 20 x 0.5 s. Loading that is CPU work slows with more workers than
    CPUs, and the deadline with it."""
    waiting = _baseline()
    deadlines = _policy().deadlines(_params(8), [waiting])
    assert deadlines.sibling == pytest.approx(10.0)
    busy = dataclasses.replace(
        waiting,
        outcome=Completed(dataclasses.replace(_measurement(100.0), load_cpu_seconds=0.45), 100.0),
    )
    deadlines = _policy().deadlines(_params(8), [busy])
    assert deadlines.sibling == pytest.approx(40.0)  # 8 workers on 2 CPUs: 4x slower
    quick = dataclasses.replace(
        waiting,
        outcome=Completed(dataclasses.replace(_measurement(100.0), load_seconds=0.001), 100.0),
    )
    assert _policy().deadlines(_params(8), [quick]).sibling == 1.0  # the floor


def _resolved_with(
    space: SearchSpace, seconds: float, method: str
) -> tuple[SearchSpace, list[Any]]:
    """``space`` resolved on 2 CPUs after a worker took ``seconds`` to start, at 60 s."""
    return resolve_space(
        space,
        usable_cpus=2,
        has_accelerator=False,
        batches_per_epoch=None,
        batched_fetch_problem=None,
        threads_problem=None,
        startup=Startup(seconds, method, 60.0, trial_seconds(60.0)),
    )


def test_workers_too_slow_to_start_cap_the_default_range_with_a_note() -> None:
    assert Startup(3.0, "spawn", 60.0, trial_seconds(60.0)).most_workers() == 4  # 12 s
    space, notes = _resolved_with(SearchSpace(), 3.0, "spawn")
    assert space.num_workers == (0, 4)
    (capped,) = [n for n in notes if isinstance(n, WorkersCappedAtStartup)]
    assert render(capped) == (
        "num_workers searched up to 4: starting a worker takes 3.0 s here (spawn), and more "
        "workers would spend more of the 60 s budget starting than measuring; a larger "
        "time_budget lets more be measured."
    )
    fork, notes = _resolved_with(SearchSpace(), 0.02, "fork")
    assert fork.num_workers == (0, 16)
    assert not any(isinstance(n, WorkersCappedAtStartup) for n in notes)
    asked, _ = _resolved_with(SearchSpace(num_workers=(0, 8)), 3.0, "spawn")
    assert asked.num_workers == (0, 8)  # a range asked for is the user's to keep


def test_a_trial_whose_workers_delivered_nothing_is_too_short_and_says_why() -> None:
    unstarted = Measurement(
        samples_per_second=0.0,
        relative_error=math.inf,
        data_wait_fraction=1.0,
        load_seconds=0.0,
        step_seconds=0.0,
        time_to_first_batch=6.4,
        epoch_restart_seconds=None,
        batches=0,
        duration=6.4,
        peak_memory=1,
    )
    outcome = _policy().judge(Phase.SEARCH, _params(4), unstarted, [_baseline()])
    assert isinstance(outcome, Pruned) and outcome.kind is PruneKind.TOO_SHORT
    assert outcome.reason.startswith(
        "too short: its workers had not delivered a first batch when the trial's 6.4 s ran out"
    )


def test_no_trial_starts_more_workers_than_can_start_before_the_run_ends() -> None:
    """DataLoader starts its workers inside iter(), where no deadline reaches: with 5 s a
    worker and 12 s left, a trial of more than 2 would end past the budget."""
    policy = _policy(budget=60.0, worker_start=5.0)
    history = [_baseline()]
    assert policy.startable(history, 12.0) == 2
    plan = policy.next(history, seconds_left=12.0 + 0.2 * 60)
    assert isinstance(plan, Plan) and plan.params is not None
    assert plan.params["num_workers"] <= policy.startable(history, 12.0 + 0.2 * 60)  # type: ignore[operator]
    assert _policy().startable(history, 12.0) is None  # start-up not measured
    runner = FakeRunner(_peaks_at_5)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    driver = Driver(policy, runner, study, deadline=12.0, clock=runner.clock)
    driver.history = history
    bounds = driver._sampler_bounds()
    assert bounds is not None and bounds["num_workers"].high == 2  # type: ignore[attr-defined]


# The training process's threads (NOTE [ Step threads ]) ---------------------------------


def _step_on_cpu(baseline: Trial, *, own: float, load_cpu: float = 0.018) -> Trial:
    """``baseline`` with a step whose own thread is busy ``own`` of the step, and
    loading that takes ``load_cpu`` of its 0.02 s on the CPU."""
    assert baseline.measurement is not None
    measured = dataclasses.replace(
        baseline.measurement,
        load_seconds=0.02,
        load_cpu_seconds=load_cpu,
        load_thread_cpu_seconds=load_cpu,
        step_seconds=0.5,  # a power of two: own * 0.5 / 0.5 is own exactly
        step_cpu_seconds=0.9375,
        step_thread_cpu_seconds=own * 0.5,
    )
    return dataclasses.replace(baseline, outcome=Completed(measured, 100.0))


def test_a_step_on_the_cpu_has_its_threads_split_from_the_workers_cores() -> None:
    """Loading is CPU work: n workers leave the step 2 - n threads (at least one), the
    guesses leave the step a core, and no setting has more workers than CPUs; the
    sampler then draws the threads too."""
    history = [_step_on_cpu(_baseline(), own=0.96)]
    policy = _policy()
    assert policy.step_threads_left(history, threads=2) is None
    assert policy.sampled_space(history).step_threads == (1, 2)
    points = [(p["num_workers"], p["step_threads"]) for p in policy.starting_points(history)]
    assert points == [(1, 1), (2, 1)]
    assert policy.workers_cap(history) == WorkersCappedAtCores(2)
    # Loading that waits: the workers take no core, the step keeps both, and the ladder
    # goes on past the CPUs.
    waits = [_step_on_cpu(_baseline(), own=0.96, load_cpu=0.001)]
    assert {p["step_threads"] for p in policy.starting_points(waits)} == {2}
    assert [p["num_workers"] for p in policy.starting_points(waits)] == [1, 2, 4, 8, 16]
    assert policy.workers_cap(waits) is None
    # Loading that waits, charged the CPU torch's pool spun after the step: not CPU work.
    spun = [_step_on_cpu(_baseline(), own=0.96, load_cpu=0.001)]
    assert spun[0].measurement is not None
    process = dataclasses.replace(spun[0].measurement, load_cpu_seconds=0.018)
    spun = [dataclasses.replace(spun[0], outcome=Completed(process, 100.0))]
    assert policy.workers_cap(spun) is None


def test_a_step_that_waits_or_runs_on_an_accelerator_keeps_its_threads() -> None:
    sleeps = [_step_on_cpu(_baseline(), own=0.03)]
    policy = _policy()
    assert policy.step_threads_left(sleeps, threads=2) == StepThreadsLeft(2, 0.03)
    assert policy.sampled_space(sleeps).step_threads is None
    assert {p["step_threads"] for p in policy.starting_points(sleeps)} == {None}
    busy = [_step_on_cpu(_baseline(), own=0.96)]
    on_gpu = _policy(accelerator="cuda:0")
    assert on_gpu.step_threads_left(busy, threads=8) == StepThreadsLeft(8, 0.96, "cuda:0")
    # A step on the CPU all its time, but a sliver of the work (a few microseconds of
    # Python beside 18 ms of decoding): its threads matter to nothing.
    assert busy[0].measurement is not None
    tiny = dataclasses.replace(
        busy[0].measurement,
        step_seconds=0.0005,
        step_cpu_seconds=0.0005,
        step_thread_cpu_seconds=0.0005,
    )
    tiny_step = [dataclasses.replace(busy[0], outcome=Completed(tiny, 100.0))]
    left_small = policy.step_threads_left(tiny_step, threads=2)
    assert left_small is not None and left_small.work_share is not None
    assert left_small.work_share < 0.05
    # Asked for in the space, they are searched whatever the step does.
    asked = _policy(accelerator="cuda:0", step_threads_asked=True)
    assert asked.step_threads_left(sleeps, threads=2) is None
    asked_notes = asked.step_threads_notes(sleeps, asked.choose(sleeps), threads=2)
    # Asked for: no note says why they were searched (loading is CPU work: the cap is said).
    assert asked_notes == [WorkersCappedAtCores(2)]
    # Before the baseline nothing is known: the space is as resolved.
    assert policy.sampled_space([]).step_threads == (1, 2)


def test_the_notes_say_whether_the_threads_were_searched_and_what_to_apply() -> None:
    history = [_step_on_cpu(_baseline(), own=0.96)]
    policy = _policy()
    split = {**_params(1), "step_threads": 1}
    history += [_done(n, split, 150.0) for n in (1, 2)]
    choice = policy.choose(history)
    assert choice.params["step_threads"] == 1
    assert policy.step_threads_notes(history, choice, threads=2) == [
        StepThreadsSearched(1, 2, 0.96, 1.875),
        WorkersCappedAtCores(2),
        StepThreadsToApply(1, 2, 1, 2),
    ]
    baseline_only = [_step_on_cpu(_baseline(), own=0.01)]
    assert policy.step_threads_notes(baseline_only, policy.choose(baseline_only), threads=2) == [
        StepThreadsLeft(2, 0.01)
    ]


class ThreadedRunner(FakeRunner):
    """A step on the CPU of 2 cores, loading CPU work: it runs fastest on 1 thread
    beside 1 worker, and slowest on 2 threads beside workers (they take turns)."""

    def measure(self, params: Mapping[str, Any], **kwargs: Any) -> Measurement:
        measured = super().measure(params, **kwargs)
        workers, threads = params["num_workers"], params["step_threads"] or 2
        rate = {0: 800.0}.get(workers, 1100.0 if threads == 1 else 650.0)
        return dataclasses.replace(
            measured,
            samples_per_second=rate,
            step_seconds=0.04,
            step_thread_cpu_seconds=0.039,
            step_cpu_seconds=0.075,
            load_cpu_seconds=0.019,
            load_thread_cpu_seconds=0.019,
        )


def test_the_driver_searches_the_step_threads_and_chooses_the_split() -> None:
    runner = ThreadedRunner(lambda workers: 0.0)
    driver = _driver(runner)
    driver.run()
    drawn = [t.params["step_threads"] for t in driver.history if t.phase is Phase.SEARCH]
    assert None not in drawn and set(drawn) <= {1, 2}
    # Loading and the step both on the CPU: no more workers than the 2 CPUs.
    assert max(t.params["num_workers"] for t in driver.history) <= 2
    choice = driver.policy.choose(driver.history)
    assert choice.params["step_threads"] == 1 and choice.params["num_workers"] >= 1
    assert runner.measured[0]["step_threads"] is None  # the baseline: the user's own


def test_the_ladder_stops_at_twice_the_cores_where_loading_is_cpu_work() -> None:
    """NOTE [ Cost model ]: 45 ms of decoding a batch, on the CPU all its time, and a
    20 ms step that waits: past the 2 cores workers only take turns on them."""
    baseline = _baseline()
    assert baseline.measurement is not None
    decoding = dataclasses.replace(
        baseline.measurement, load_seconds=0.045, load_cpu_seconds=0.045, step_seconds=0.02
    )
    measured = dataclasses.replace(baseline, outcome=Completed(decoding, 100.0))
    assert [p["num_workers"] for p in _policy().starting_points([measured])] == [2, 3, 1, 4]
    # Loading that waits (storage) climbs the whole ladder.
    waiting = dataclasses.replace(decoding, load_cpu_seconds=0.005)
    measured = dataclasses.replace(baseline, outcome=Completed(waiting, 100.0))
    assert [p["num_workers"] for p in _policy().starting_points([measured])] == [3, 4, 1, 2, 8, 16]
    # A space whose fewest workers are above the rungs keeps its lowest: the guesses
    # held to it.
    high = Policy(space=_space(num_workers=(6, 16)), time_budget=30, batch_size=8, usable_cpus=2)
    counts = [
        p["num_workers"]
        for p in high.starting_points(
            [dataclasses.replace(baseline, outcome=Completed(decoding, 100.0))]
        )
    ]
    assert counts == [6]
