"""The search: an Optuna study whose trials are measured loader settings.

A run has three phases, each a set of trials in one study:

1. ``baseline``: ``num_workers=0`` defaults. It validates the dataset, collate_fn and
   step_fn; its failure stops the run (:class:`~autoloader.BaselineError`).
2. ``search``: a doubling ladder of worker counts, then settings the sampler proposes.
3. ``runoff``: the closest candidates and the baseline measured again, interleaved,
   so the final choice and the speedup rest on repeated, side-by-side measurements.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import socket
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from autoloader._cost_model import guess_workers, loads_on_several_threads
from autoloader._deadlines import Deadlines
from autoloader._exceptions import AllSettingsFailedError, BaselineError
from autoloader._faults import classify
from autoloader._measure import Measurement, Runner, TrialError
from autoloader._memory import MemoryBudgetExceeded
from autoloader._report import describe
from autoloader._result import PRUNED_AS_SLOWER, TOO_SHORT, TrialRecord
from autoloader._search_space import BASELINE_PARAMS, Params, SearchSpace, trial_params

_logger = logging.getLogger(__name__)

# Share of the time budget kept for the runoff, and how it is spent.
_RUNOFF_SHARE = 0.2
_RUNOFF_CANDIDATES = 3
_RUNOFF_ROUNDS = 2
# Candidates whose median value is within this fraction of the best are ties; the
# cheapest of them (fewest workers, then smallest prefetch) is chosen.
_TIE_TOLERANCE = 0.02
# Bounds on one trial's measurement time, and its share of the time budget.
_TRIAL_SHARE = 0.1
_MIN_TRIAL_SECONDS = 1.0
_MAX_TRIAL_SECONDS = 15.0
# NOTE [ Hang deadlines ]
# A batch (loading it, or the step on it) is hung once it takes _TIMEOUT_FACTOR times
# the baseline's time per batch, and never less than _MIN_BATCH_TIMEOUT seconds. With
# more workers than CPUs a CPU-bound batch legitimately slows by workers / CPUs; the
# first batch of an epoch also waits for workers to start (Deadlines.per_batch).
# Before the baseline there is nothing to derive from: the baseline gets the whole
# budget, at least _BASELINE_TIMEOUT.
_TIMEOUT_FACTOR = 20.0
_MIN_BATCH_TIMEOUT = 10.0
_BASELINE_TIMEOUT = 60.0
# NOTE [ Enough searching ]
# Once the starting points (the cost model's guesses and the ladder) are measured, the
# search stops when _PATIENCE measured trials in a row (settings skipped as known to
# fail do not count) found nothing more than _TIE_TOLERANCE
# better than the best before them: the sampler is circling a plateau, and the time is
# better spent on the runoff, or given back. A loop that is bound by its step reaches
# such a plateau quickly: nothing beats the step.
_PATIENCE = 6
# A loop that waits for data less than this share of its time is bound by its step:
# no setting can make it faster, so the search ends with the first setting that gets
# there (measured to the usual confidence), and the rest of the budget is given back.
# If the baseline already gets there, there is no search at all. (Receiving a batch
# from a worker costs the main process about 1.3 ms on the development VM, so with a
# 20 ms step even the best setting with workers waits some 6% of the time.)
_STEP_BOUND_WAIT = 0.03
_STEP_BOUND_ERROR = 0.05
# Search trials that may all fail before the run stops: the pipeline itself, not a
# setting, is failing in worker processes.
_FAILURES_BEFORE_GIVING_UP = 5


class _TrialFailed(Exception):
    """A setting made user code fail; the trial is recorded FAILED and the run goes on."""


def trial_seconds(time_budget: float) -> float:
    """The longest one trial may measure, from the whole run's time budget."""
    return min(_MAX_TRIAL_SECONDS, max(_MIN_TRIAL_SECONDS, _TRIAL_SHARE * time_budget))


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


def params_key(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True)


@dataclass
class Search:
    """Runs the phases of one tuning run against a study.

    Args:
        runner: measures one setting.
        space: the resolved search space.
        study: the Optuna study (``direction="maximize"``) trials are recorded in.
        batches_per_epoch: ``len(loader)``, or ``None`` if unknown.
        deadline: ``perf_counter()`` time when the run must end.
        time_budget: seconds of the whole run.
        n_trials: cap on search-phase trials, or ``None``.
        on_trial: called after each trial with its record.
        interrupted: set when Ctrl-C was pressed; checked at every timing window and
            trial, in case the KeyboardInterrupt itself was lost on its way.
    """

    runner: Runner
    space: SearchSpace
    study: optuna.Study
    batches_per_epoch: int | None
    deadline: float
    time_budget: float
    n_trials: int | None = None
    usable_cpus: int = 1
    on_trial: Callable[[TrialRecord], None] | None = None
    interrupted: threading.Event | None = None

    def __post_init__(self) -> None:
        self._owner = _this_process()
        self._plan: deque[tuple[str, Params | None, float]] = deque()
        self._refill_seconds = 0.0
        self._baseline_batch_seconds: float | None = None
        self._batch_bytes = 0
        self._guesses: list[int] = []
        self._limit_threads = False
        self.stopped_early: str | None = None
        self._numbers: list[int] = []
        self._trial_seconds = trial_seconds(self.time_budget)
        self._left_for_search = 0.0

    # The phases -------------------------------------------------------------------

    def run(self) -> None:
        """Run every phase; :meth:`records` and :meth:`best` then give the outcome."""
        self._fail_orphans()
        self._run_baseline()
        self._run_search()
        self._run_runoff()

    def _fail_orphans(self) -> None:
        """Fail the RUNNING trials of a tuning process on this machine that has died.

        A run killed mid-trial (SIGKILL, the OOM killer, a power cut) leaves its trial
        RUNNING in the storage forever. Its owner is recorded with each trial: a gone
        process (or a pid reused by another) means the trial will never finish. Trials
        of live processes, or of other machines sharing the study, are left alone.
        """
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for trial in running:
            owner = trial.user_attrs.get("owner") or {}
            if owner.get("host") != self._owner["host"] or _is_alive(owner):
                continue
            # Optuna has no public call to end another process's trial.
            storage = self.study._storage
            reason = f"interrupted: the tuning process (pid {owner.get('pid')}) died"
            storage.set_trial_user_attr(trial._trial_id, "reason", reason)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            _logger.info("trial %d: %s", trial.number, reason)

    def _run_baseline(self) -> None:
        self._execute([("baseline", BASELINE_PARAMS, self._trial_seconds)])
        baseline = self._trials()[-1]
        measurement = baseline.user_attrs.get("measurement", {})
        self._refill_seconds = float(measurement.get("load_seconds", 0.0))
        self._baseline_batch_seconds = self._refill_seconds + float(
            measurement.get("step_seconds", 0.0)
        )
        self._batch_bytes = int(measurement.get("batch_bytes", 0))
        self._guesses = guess_workers(measurement, usable_cpus=self.usable_cpus)
        self._limit_threads = loads_on_several_threads(measurement)

    def _run_search(self) -> None:
        self._left_for_search = self._seconds_left(self.deadline)
        search_end = self.deadline - _RUNOFF_SHARE * self.time_budget
        self.stopped_early = self._step_bound(self._trials())
        if self.stopped_early is not None:  # the baseline: nothing queued, nothing to search
            _logger.info("%s", self.stopped_early)
            return
        starting_points = self.space.ladder(first=self._guesses, limit_threads=self._limit_threads)[
            : self.n_trials
        ]
        # Queued one at a time: a search that stops early leaves none for later phases.
        pending = deque(starting_points)
        remaining = self.n_trials
        while remaining is None or remaining > 0:
            seconds = min(self._trial_seconds, self._seconds_left(search_end))
            if seconds < 0.5 * _MIN_TRIAL_SECONDS:
                break
            if pending:
                # skip_if_exists: a study resumed from storage already measured it.
                self.study.enqueue_trial(trial_params(pending.popleft()), skip_if_exists=True)
            self._execute([("search", None, seconds)])
            # One read of the study serves both checks.
            searched = [t for t in self._trials() if t.user_attrs.get("phase") == "search"]
            self._stop_if_every_setting_fails(searched)
            if remaining is not None:
                remaining -= 1
            self.stopped_early = self._step_bound(searched)
            if self.stopped_early is not None:
                _logger.info("%s", self.stopped_early)
                break
            if self._searched_enough(searched, len(starting_points)):
                _logger.info("no gain in the last %d trials: the search stops", _PATIENCE)
                break

    def _step_bound(self, trials: list[FrozenTrial]) -> str | None:
        """Why the search can stop, if a measured setting left the loop bound by its
        step (see ``_STEP_BOUND_WAIT``)."""
        for trial in trials:
            measurement = trial.user_attrs.get("measurement") or {}
            wait = measurement.get("data_wait_fraction", 1.0)
            confident = measurement.get("relative_error", math.inf) <= _STEP_BOUND_ERROR
            if trial.state != TrialState.COMPLETE or wait > _STEP_BOUND_WAIT or not confident:
                continue
            if trial.user_attrs.get("phase") == "baseline":
                return (
                    f"the loop is bound by its step already with num_workers=0: it waits for "
                    f"data {wait:.1%} of the time, so no setting can make it faster; nothing "
                    "was searched"
                )
            return (
                f"the loop is bound by its step: with trial {trial.number}'s setting it "
                f"waits for data {wait:.1%} of the time, so no setting can make it faster; "
                f"the search stopped after {len(trials)} trials"
            )
        return None

    def _searched_enough(self, searched: list[FrozenTrial], starting_points: int) -> bool:
        """Whether the last _PATIENCE search trials, after the starting points, found
        nothing better than the best before them (see ``NOTE [ Enough searching ]``)."""
        # Settings recorded without running (known to fail) are not search effort.
        searched = [t for t in searched if "same_as" not in t.user_attrs]
        if len(searched) < starting_points + _PATIENCE:
            return False
        before, recent = searched[:-_PATIENCE], searched[-_PATIENCE:]
        best_before = max((t.value for t in before if t.value is not None), default=None)
        if best_before is None:
            return False
        best_recent = max((t.value for t in recent if t.value is not None), default=0.0)
        return best_recent <= (1 + _TIE_TOLERANCE) * best_before

    def _stop_if_every_setting_fails(self, searched: list[FrozenTrial]) -> None:
        if len(searched) < _FAILURES_BEFORE_GIVING_UP:
            return
        if any(t.state != TrialState.FAIL for t in searched):
            return
        reasons = sorted({str(t.user_attrs.get("reason")) for t in searched})
        raise AllSettingsFailedError(
            f"All {len(searched)} settings with workers failed, while num_workers=0 works: "
            f"{'; '.join(reasons)}. The dataset or collate_fn fails in worker processes "
            "(state that does not survive fork or pickling, per-process resources, "
            "limits); fix that, or keep num_workers=0."
        )

    def deadlines(self, params: Params) -> Deadlines:
        """How long one batch may take with ``params`` (see ``NOTE [ Hang deadlines ]``)."""
        workers = int(params["num_workers"])
        if self._baseline_batch_seconds is None:
            limit = max(_BASELINE_TIMEOUT, self.time_budget)
            return Deadlines(first=limit, each=limit)
        slowdown = max(1.0, workers / self.usable_cpus)
        each = max(_MIN_BATCH_TIMEOUT, _TIMEOUT_FACTOR * self._baseline_batch_seconds * slowdown)
        return Deadlines.per_batch(each, workers=workers)

    def _run_runoff(self) -> None:
        groups = self._groups(phases=("search", "runoff"))
        ranked = sorted(groups.values(), key=lambda group: -statistics.median(group[1]))
        candidates = [_params_of(trials[0]) for trials, _ in ranked[:_RUNOFF_CANDIDATES]]
        candidates = [p for p in candidates if params_key(p) != params_key(BASELINE_PARAMS)]
        # Runoff trials get the same time as search trials: shorter ones catch the CPU
        # burst of many workers starting on few cores and understate those settings.
        # A loop bound by its step has no winner to find, only the cheapest of equals.
        for _ in range(1 if self.stopped_early else _RUNOFF_ROUNDS):
            duration = self._typical_durations()
            left = self._seconds_left(self.deadline) - duration(BASELINE_PARAMS)
            fitting: list[Params] = []
            for params in candidates:  # best first: drop the weakest when time is short
                left -= duration(params)
                if left < 0:
                    break
                fitting.append(params)
            if not fitting:
                _logger.info("no time left for another runoff round")
                return
            self._execute([("runoff", p, self._trial_seconds) for p in [*fitting, BASELINE_PARAMS]])

    def _typical_durations(self) -> Callable[[Params], float]:
        """Median seconds the trials of a setting took in this run (one study read)."""
        groups = self._groups(phases=("baseline", "search", "runoff"))

        def duration(params: Params) -> float:
            trials, _ = groups.get(params_key(params), ([], []))
            durations = [t.user_attrs["measurement"]["duration"] for t in trials]
            return statistics.median(durations) if durations else self._trial_seconds

        return duration

    def shortcomings(self) -> list[str]:
        """What the result rests on less than a search for, in words: a baseline measured
        too briefly to tell its error, or no setting with workers measured to the end.
        The defaults are never returned without saying why."""
        trials = self._trials()
        found = []
        baselines = [t for t in trials if t.user_attrs.get("phase") == "baseline"]
        baseline = baselines[0] if baselines else None
        measurement = (baseline.user_attrs.get("measurement") or {}) if baseline else {}
        if (
            baseline
            and baseline.state == TrialState.COMPLETE
            and not math.isfinite(measurement.get("relative_error", math.inf))
        ):
            found.append(
                f"the baseline (num_workers=0) timed {measurement.get('batches', 0)} batches "
                "before its time ran out, too few to tell its rate's error: the speedup "
                "against it is uncertain; a larger time_budget measures it properly"
            )
        searched = [t for t in trials if t.user_attrs.get("phase") != "baseline"]
        if any(t.state == TrialState.COMPLETE for t in searched):
            return found
        if not searched and self.stopped_early is None:
            found.append(
                f"the search did not run: the checks and the baseline left "
                f"{self._left_for_search:.1f} s of the {self.time_budget:.0f} s budget, too "
                "little for a trial; these are the defaults. Tune with a larger time_budget"
            )
        elif searched:
            states = collections.Counter(_STATES.get(t.state, "running") for t in searched)
            counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
            found.append(
                f"no setting with workers was measured to the end ({counts}): these are "
                "the defaults, not a tuned setting; the failures say why"
            )
        return found

    # The choice ---------------------------------------------------------------------

    def has_baseline(self) -> bool:
        """Whether the baseline finished: without it there is nothing to compare to."""
        return bool(group_complete(self._trials(), ("baseline",)))

    def best(self) -> tuple[Params, float, float]:
        """The chosen settings, their steady samples/s, and the baseline's (see :func:`choose`)."""
        return choose(self._trials())

    # Trials ---------------------------------------------------------------------

    def _execute(self, plan: Iterable[tuple[str, Params | None, float]]) -> None:
        self._plan.extend(plan)
        while self._plan:  # a queued setting can take a trial meant for the plan
            self.study.optimize(
                self._objective,
                n_trials=len(self._plan),
                catch=(_TrialFailed,),
                callbacks=[self._after_trial],
                gc_after_trial=True,
            )

    def _after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        record = self._record(trial)
        _logger.info(describe(record))
        if self.on_trial is not None:
            self.on_trial(record)
        self._stop_if_interrupted()

    def _stop_if_interrupted(self) -> None:
        if self.interrupted is not None and self.interrupted.is_set():
            raise KeyboardInterrupt

    def _objective(self, trial: optuna.Trial) -> float:
        phase, planned, seconds = self._plan.popleft()
        if planned is not None and getattr(trial, "_fixed_params", None):
            # Optuna hands a trial any setting still queued in the study (a run that
            # died left its ladder): measure that setting, as queued, and keep the
            # planned one for the next trial.
            self._plan.appendleft((phase, planned, seconds))
            phase, planned = "search", None
        # A plan is made before its trials run: hold each to the time actually left.
        seconds = max(0.5 * _MIN_TRIAL_SECONDS, min(seconds, self._seconds_left(self.deadline)))
        self._numbers.append(trial.number)
        params = planned if planned is not None else self.space.suggest(trial)
        trial.set_user_attr("phase", phase)
        trial.set_user_attr("params", params)
        trial.set_user_attr("owner", self._owner)
        if phase == "search":
            self._skip_if_known_to_fail(trial, params)
        try:
            return self._measure(trial, phase, params, seconds)
        except KeyboardInterrupt:
            trial.set_user_attr("reason", "interrupted (Ctrl-C)")
            raise

    def _skip_if_known_to_fail(self, trial: optuna.Trial, params: Params) -> None:
        """Record, without measuring, a setting that an earlier trial shows will fail.

        A setting that failed fails again (crashes and hangs are rarely a matter of
        luck, and measuring a hang again costs its whole deadline). Memory only grows
        with workers, prefetch and pinning, so a setting that asks at least as much as
        one that passed the memory budget (or was OOM-killed) would pass it too.
        """
        earlier = self.study.get_trials(deepcopy=False, states=(TrialState.PRUNED, TrialState.FAIL))
        for other in earlier:
            reason = str(other.user_attrs.get("reason") or "")
            known = other.user_attrs.get("params")
            if not known:
                continue
            if reason.startswith(("memory", "killed")) and _asks_at_least(params, known):
                trial.set_user_attr(
                    "reason",
                    f"{reason} (not run: asks at least as much memory as trial {other.number})",
                )
                trial.set_user_attr("same_as", other.number)
                raise optuna.TrialPruned(reason)
            if other.state == TrialState.FAIL and params_key(params) == params_key(known):
                if reason.startswith("interrupted"):
                    continue  # the process died, not the setting
                trial.set_user_attr("reason", reason)
                trial.set_user_attr("same_as", other.number)
                raise _TrialFailed(f"{reason} (as in trial {other.number}; not run again)")

    def _measure(self, trial: optuna.Trial, phase: str, params: Params, seconds: float) -> float:
        def value_of(measurement: Measurement) -> float:
            return epoch_samples_per_second(
                params,
                measurement,
                batch_size=self.runner.batch_size,
                batches_per_epoch=self.batches_per_epoch,
                refill_seconds=self._refill_seconds,
            )

        def on_window(step: int, measurement: Measurement) -> None:
            self._stop_if_interrupted()
            trial.set_user_attr("measurement", measurement.as_dict())
            trial.report(value_of(measurement), step)
            if phase == "search" and trial.should_prune():
                raise optuna.TrialPruned(PRUNED_AS_SLOWER)

        try:
            measurement = self.runner.measure(
                params,
                max_seconds=seconds,
                on_window=on_window,
                deadlines=self.deadlines(params),
            )
        except optuna.TrialPruned as pruned:
            trial.set_user_attr("reason", str(pruned))
            raise
        except MemoryBudgetExceeded as error:
            trial.set_user_attr("peak_memory", error.peak)
            if phase == "baseline":
                raise BaselineError(
                    f"The baseline (num_workers=0) alone went over the memory budget: "
                    f"{error}. Raise memory_budget or use a smaller batch_size."
                ) from None
            trial.set_user_attr("reason", f"memory: {error}")
            raise optuna.TrialPruned(f"memory: {error}") from error
        except TrialError as error:
            # Ctrl-C reaches the workers too: their deaths are its doing, not the setting's.
            self._stop_if_interrupted()
            trial.set_user_attr("peak_memory", error.peak_memory)
            if phase == "baseline":
                where = f" at {error.where}" if error.where else ""
                raise BaselineError(
                    f"The baseline (num_workers=0) failed while {error.stage}: "
                    f"{error.summary}{where}. This is a fault in the dataset, collate_fn or "
                    "step_fn, not in a loader setting; fix it and tune again."
                ) from error.error
            fault = classify(error, params=params, batch_bytes=self._batch_bytes)
            trial.set_user_attr("reason", fault.reason)
            if fault.state == "pruned":
                raise optuna.TrialPruned(fault.reason) from error
            raise _TrialFailed(fault.reason) from error
        trial.set_user_attr("measurement", measurement.as_dict())
        if measurement.too_short and phase != "baseline":
            if measurement.burst_undrained:
                reason = (
                    f"{TOO_SHORT}: timing had to begin with {measurement.burst_left} of the "
                    "batches queued at start-up not yet drained, and they would count as "
                    f"loaded in the {measurement.batches} batches timed, so its rate is "
                    "not counted (a larger time_budget gives each trial time to drain them)"
                )
            else:
                reason = (
                    f"{TOO_SHORT}: the trial's {seconds:.1f} s ran out before two timing "
                    f"windows (first batch after {measurement.time_to_first_batch:.1f} s, "
                    f"{measurement.batches} batches timed), so its rate has no error "
                    "estimate and is not counted"
                )
            trial.set_user_attr("reason", reason)
            raise optuna.TrialPruned(reason)
        return value_of(measurement)

    # Records --------------------------------------------------------------------

    def records(self) -> list[TrialRecord]:
        return [self._record(trial) for trial in self._trials()]

    def _record(self, frozen: FrozenTrial) -> TrialRecord:
        attrs = frozen.user_attrs
        measurement = attrs.get("measurement") or {}
        state = _STATES.get(frozen.state, "running")
        value = frozen.value
        if value is None and frozen.intermediate_values:
            value = frozen.intermediate_values[max(frozen.intermediate_values)]
        relative_error = measurement.get("relative_error")
        return TrialRecord(
            number=frozen.number,
            phase=attrs.get("phase", "search"),
            params=attrs.get("params", {}),
            state=state,
            samples_per_second=measurement.get("samples_per_second"),
            epoch_samples_per_second=value,
            data_wait_fraction=measurement.get("data_wait_fraction"),
            time_to_first_batch=measurement.get("time_to_first_batch"),
            peak_memory=attrs.get("peak_memory", measurement.get("peak_memory")),
            relative_error=None if relative_error in (None, math.inf) else relative_error,
            duration=measurement.get("duration"),
            reason=attrs.get("reason"),
            load_seconds=measurement.get("load_seconds"),
            step_seconds=measurement.get("step_seconds"),
            load_cpu_seconds=measurement.get("load_cpu_seconds"),
            step_cpu_seconds=measurement.get("step_cpu_seconds"),
            batch_bytes=measurement.get("batch_bytes"),
        )

    def _groups(self, phases: tuple[str, ...]) -> dict[str, tuple[list[FrozenTrial], list[float]]]:
        return group_complete(self._trials(), phases)

    def _trials(self) -> list[FrozenTrial]:
        # One read of the study: with an RDB storage each read is a query.
        trials = self.study.get_trials(deepcopy=False)
        return [trials[n] for n in self._numbers]

    def _seconds_left(self, until: float) -> float:
        return max(0.0, until - perf_counter())


_STATES = {
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
}


def choose(trials: Iterable[FrozenTrial]) -> tuple[Params, float, float]:
    """The chosen settings, their steady samples/s, and the baseline's.

    Each distinct setting is scored by the median objective over all its complete
    trials; among those within ``_TIE_TOLERANCE`` of the best score, the cheapest wins:
    more workers or prefetch only cost memory and start-up.
    """
    groups = group_complete(trials, ("baseline", "search", "runoff"))
    scores = {key: statistics.median(values) for key, (_, values) in groups.items()}
    top = max(scores.values())
    ties = [key for key, score in scores.items() if score >= (1 - _TIE_TOLERANCE) * top]
    chosen = min(ties, key=lambda key: _cost(json.loads(key)))
    baseline = groups[params_key(BASELINE_PARAMS)][0]
    return json.loads(chosen), _median_rate(groups[chosen][0]), _median_rate(baseline)


def group_complete(
    trials: Iterable[FrozenTrial], phases: tuple[str, ...]
) -> dict[str, tuple[list[FrozenTrial], list[float]]]:
    """Complete trials in ``phases``, grouped by their settings, with their values."""
    groups: dict[str, tuple[list[FrozenTrial], list[float]]] = {}
    for trial in trials:
        if trial.state != TrialState.COMPLETE or trial.value is None:
            continue
        if trial.user_attrs.get("phase") not in phases:
            continue
        members, values = groups.setdefault(params_key(_params_of(trial)), ([], []))
        members.append(trial)
        values.append(trial.value)
    return groups


def _params_of(trial: FrozenTrial) -> Params:
    params: Params = trial.user_attrs["params"]
    return params


def _this_process() -> dict[str, Any]:
    process = psutil.Process()
    return {"host": socket.gethostname(), "pid": process.pid, "started": process.create_time()}


def _is_alive(owner: Mapping[str, Any]) -> bool:
    """Whether the process that ran a trial still runs (and is not a reused pid)."""
    try:
        process = psutil.Process(int(owner["pid"]))
        return bool(abs(process.create_time() - float(owner["started"])) < 1.0)
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def _asks_at_least(params: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether ``params`` holds at least as many batches, as pinned, as ``other``."""
    return (
        params["num_workers"] >= other["num_workers"] > 0
        and (params["prefetch_factor"] or 0) >= (other["prefetch_factor"] or 0)
        and params["pin_memory"] >= other["pin_memory"]
    )


def _cost(params: Mapping[str, Any]) -> tuple[int, int, bool, bool, bool]:
    """Fewest workers, smallest prefetch, no pinning; then one indexing per batch (less
    CPU), then batches in order (reproducible)."""
    return (
        params["num_workers"],
        params["prefetch_factor"] or 0,
        params["pin_memory"],
        not params.get("batched_fetch", False),
        not params.get("in_order", True),
    )


def _median_rate(trials: list[FrozenTrial]) -> float:
    return float(
        statistics.median(t.user_attrs["measurement"]["samples_per_second"] for t in trials)
    )
