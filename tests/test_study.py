from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from autoloader._measure import Measurement
from autoloader._pruner import ClearlyWorsePruner
from autoloader._search_space import BASELINE_PARAMS, SearchSpace, normalize_params
from autoloader._study import (
    Search,
    _asks_at_least,
    choose,
    epoch_samples_per_second,
    trial_seconds,
)


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
    measured = dataclasses.replace(_measurement(100.0), burst_left=20, batches=100)
    assert measured.burst_undrained and measured.too_short
    assert not dataclasses.replace(measured, burst_left=9).too_short  # under a tenth
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


def _trial(
    phase: str, params: dict[str, Any], value: float, rate: float
) -> optuna.trial.FrozenTrial:
    return create_trial(
        value=value,
        user_attrs={"phase": phase, "params": params, "measurement": {"samples_per_second": rate}},
    )


def test_choose_takes_the_best_median_over_repeats() -> None:
    trials = [
        _trial("baseline", BASELINE_PARAMS, 100, 100),
        _trial("search", _params(8), 500, 500),
        _trial("runoff", _params(8), 400, 400),
        _trial("runoff", _params(8), 410, 410),
        _trial("search", _params(4), 460, 460),
        _trial("runoff", _params(4), 470, 470),
        _trial("runoff", _params(0), 90, 90),
    ]
    params, throughput, baseline = choose(trials)
    assert params == _params(4)
    assert throughput == 465
    assert baseline == 95


def test_choose_breaks_ties_towards_the_cheapest_setting() -> None:
    trials = [
        _trial("baseline", BASELINE_PARAMS, 100, 100),
        _trial("search", _params(12, prefetch=8), 700, 700),
        _trial("search", _params(6, prefetch=4), 690, 690),
        _trial("search", _params(6, prefetch=2), 689, 689),
        _trial("search", _params(5), 600, 600),
    ]
    params, _, _ = choose(trials)
    assert params == _params(6, prefetch=2)


def test_choose_ignores_pruned_and_failed_trials() -> None:
    trials = [
        _trial("baseline", BASELINE_PARAMS, 100, 100),
        create_trial(state=TrialState.PRUNED, user_attrs={"phase": "search", "params": _params(9)}),
        create_trial(state=TrialState.FAIL, user_attrs={"phase": "search", "params": _params(7)}),
    ]
    assert choose(trials)[0] == BASELINE_PARAMS


def _study_with_best(value: float) -> optuna.Study:
    study = optuna.create_study(
        direction="maximize", pruner=ClearlyWorsePruner(ratio=0.6, n_warmup_steps=2)
    )
    study.add_trial(
        create_trial(value=value, params={"x": 1}, distributions={"x": IntDistribution(0, 2)})
    )
    return study


def test_pruner_stops_a_clearly_worse_trial_after_warmup() -> None:
    study = _study_with_best(1000.0)
    trial = study.ask()
    trial.report(100.0, 1)
    assert not trial.should_prune()  # too early to tell
    trial.report(500.0, 2)
    assert trial.should_prune()


def test_pruner_keeps_a_trial_within_reach_of_the_best() -> None:
    study = _study_with_best(1000.0)
    trial = study.ask()
    for step in range(1, 5):
        trial.report(700.0, step)
        assert not trial.should_prune()


def test_pruner_without_a_complete_trial_keeps_everything() -> None:
    study = optuna.create_study(direction="maximize", pruner=ClearlyWorsePruner())
    trial = study.ask()
    for step in range(1, 5):
        trial.report(1.0, step)
    assert not trial.should_prune()


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"ratio": 1.5}, "ratio"), ({"n_warmup_steps": 0}, "n_warmup_steps")]
)
def test_pruner_rejects_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClearlyWorsePruner(**kwargs)


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


# The search against a fake runner: policy in milliseconds, no processes ------------------


class FakeRunner:
    """Answers each setting with a measurement it makes up: ``rate(num_workers)``, too
    short to trust (no error estimate) where ``too_short(num_workers)`` says so."""

    batch_size = 8

    def __init__(
        self,
        rate: Callable[[int], float],
        too_short: Callable[[int], bool] = lambda workers: False,
    ) -> None:
        self.rate = rate
        self.too_short = too_short

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: Any = None,
        deadlines: Any = None,
    ) -> Measurement:
        workers = int(params["num_workers"])
        return dataclasses.replace(
            _measurement(self.rate(workers)),
            relative_error=math.inf if self.too_short(workers) else 0.01,
            data_wait_fraction=0.5,
            load_seconds=0.02,
            step_seconds=0.01,
            batches=1 if self.too_short(workers) else 100,
        )


def _search(runner: FakeRunner, *, seconds: float = 30.0, n_trials: int | None = 12) -> Search:
    space, _ = SearchSpace(num_workers=(0, 16)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    return Search(
        runner=runner,
        space=space,
        study=optuna.create_study(direction="maximize"),
        batches_per_epoch=None,
        deadline=time.perf_counter() + seconds,
        time_budget=seconds,
        n_trials=n_trials,
        usable_cpus=2,
    )


def test_a_measurement_too_short_to_trust_is_pruned_and_never_chosen() -> None:
    """16 workers look fastest, but their trial ran out before two timing windows."""
    rate = FakeRunner(lambda n: 10_000.0 if n >= 16 else 100.0 + n, lambda n: n >= 16)
    search = _search(rate, n_trials=6)  # the guesses 2 and 3, then 1, 4, 8, 16
    search.run()
    params, _, _ = search.best()
    assert params["num_workers"] < 16
    short = [r for r in search.records() if r.params["num_workers"] >= 16]
    assert short and all(r.state == "pruned" and r.too_short for r in short)
    assert short[0].reason and short[0].reason.startswith("too short: the trial's ")
    assert search.shortcomings() == []


def test_when_no_setting_with_workers_is_measured_the_result_says_so() -> None:
    search = _search(FakeRunner(lambda n: 100.0, lambda n: n > 0), n_trials=4)
    search.run()
    assert search.best()[0] == BASELINE_PARAMS
    (shortcoming,) = search.shortcomings()
    assert shortcoming.startswith("no setting with workers was measured to the end (")
    assert "pruned" in shortcoming and "these are the defaults" in shortcoming


def test_a_search_with_no_time_left_says_it_did_not_run() -> None:
    search = _search(FakeRunner(lambda n: 100.0), seconds=0.4)
    search.run()
    assert [r.phase for r in search.records()] == ["baseline"]
    (shortcoming,) = search.shortcomings()
    assert shortcoming.startswith("the search did not run: the checks and the baseline left ")
    assert "Tune with a larger time_budget" in shortcoming


def test_a_baseline_too_short_to_trust_is_said_to_be_so() -> None:
    search = _search(FakeRunner(lambda n: 100.0 + n, lambda n: n == 0), n_trials=3)
    search.run()
    assert any(
        s.startswith("the baseline (num_workers=0) timed 1 batches") for s in search.shortcomings()
    )
