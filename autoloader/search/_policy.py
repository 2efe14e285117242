"""The search's rules, as a pure function of the trials so far.

:meth:`Policy.next` takes every finished trial and the seconds left, and returns the
next trial to run (a :class:`Plan`) or a :class:`Stop`. It holds no state between calls
and does no I/O, so every rule (the ladder, the cost model's guesses, patience, the
step-bound stop, known failures, bisection at a failure boundary, the runoff and its
budget, the final choice) is tested in milliseconds against made-up trials, and a run
resumed from storage continues from its trials as if it had never stopped.

A run has three phases:

1. ``baseline``: ``num_workers=0`` defaults. It validates the dataset, collate_fn and
   step_fn; its failure stops the run.
2. ``search``: the cost model's guesses and a doubling ladder of worker counts, then
   bisection at a failure boundary, then settings the sampler proposes.
3. ``runoff``: the closest candidates and the baseline measured again, interleaved,
   so the final choice and the speedup rest on repeated, side-by-side measurements.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoloader._exceptions import AllSettingsFailedError
from autoloader.loader._params import BASELINE_PARAMS, Params
from autoloader.measure._deadlines import Deadlines
from autoloader.measure._measurement import Measurement
from autoloader.search._cost_model import guess_threads, guess_workers, loads_on_several_threads
from autoloader.search._outcome import (
    WORKER_COUNT_FAULTS,
    Completed,
    Failed,
    FaultKind,
    Outcome,
    Phase,
    Pruned,
    PruneKind,
    Trial,
)
from autoloader.search._space import SearchSpace

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
# budget, at least _BASELINE_TIMEOUT. Within a trial, its own pace tightens the
# deadline (NOTE [ Pace deadline ] in measure/_timing_loop.py).
_TIMEOUT_FACTOR = 20.0
_MIN_BATCH_TIMEOUT = 3.0
_BASELINE_TIMEOUT = 60.0
# NOTE [ Enough searching ]
# Once the starting points (the cost model's guesses and the ladder) are measured, the
# search stops when _PATIENCE measured trials in a row (settings skipped as known to
# fail do not count) found nothing more than _TIE_TOLERANCE better than the best
# before them: the sampler is circling a plateau, and the time is better spent on the
# runoff, or given back. A loop that is bound by its step reaches such a plateau
# quickly: nothing beats the step.
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
# The sampler's proposals in a row that may all be known to fail (and so not run)
# before the search stops: it has nothing new left to propose.
_SKIPS_BEFORE_GIVING_UP = 10
# A trial is voted out as slower once, after this many windows, its value is below
# this share of the best complete value. Median-style pruners cut anything below the
# middle, which on a noisy machine cuts settings within noise of the best; a
# throughput estimate is comparable at any window, so only what is clearly worse stops.
_VOTE_AFTER_WINDOWS = 2
_VOTE_RATIO = 0.6

# The reason of a trial voted out as slower: the setting is slow, not broken.
PRUNED_AS_SLOWER = "clearly slower than the best setting so far"


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


@dataclass(frozen=True, slots=True)
class Plan:
    """The next trial: ``params`` ``None`` means the sampler's proposal."""

    phase: Phase
    params: Params | None
    max_seconds: float
    why: str


@dataclass(frozen=True, slots=True)
class Stop:
    """No more trials: ``why`` says what ended the run's trials."""

    why: str


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen settings, their steady samples/s, and the baseline's."""

    params: Params
    throughput: float
    baseline: float


@dataclass(frozen=True)
class Policy:
    """Every rule of the search, as pure functions of the finished trials.

    Args:
        space: the resolved search space.
        time_budget: seconds of the whole run.
        batch_size: samples per batch.
        batches_per_epoch: ``len(loader)``, or ``None`` if unknown.
        n_trials: cap on this run's search trials, or ``None``.
        usable_cpus: CPUs this process may run on.
    """

    space: SearchSpace
    time_budget: float
    batch_size: int
    batches_per_epoch: int | None = None
    n_trials: int | None = None
    usable_cpus: int = 1

    # The next trial -------------------------------------------------------------

    def next(self, history: Sequence[Trial], *, seconds_left: float) -> Plan | Stop:
        """The next trial to run, or why there is none.

        Args:
            history: every finished trial of the study, earlier runs' included, in order.
            seconds_left: until the run's deadline.

        Raises:
            AllSettingsFailedError: every setting with workers failed so far.
        """
        if baseline_measurement(history) is None:
            seconds = max(0.5 * _MIN_TRIAL_SECONDS, min(self._trial_seconds, seconds_left))
            return Plan(Phase.BASELINE, BASELINE_PARAMS, seconds, "the baseline")
        mine = [t for t in history if not t.earlier]
        if not any(t.phase is Phase.RUNOFF for t in mine):
            plan = self._search(history, mine, seconds_left)
            if isinstance(plan, Plan):
                return plan
        return self._runoff(history, mine, seconds_left)

    def search_ended(self, history: Sequence[Trial], *, seconds_left: float) -> str | None:
        """Why the search phase is over, or ``None`` if it goes on."""
        mine = [t for t in history if not t.earlier]
        searched = [t for t in mine if t.phase is Phase.SEARCH]
        self._stop_if_every_setting_fails(searched)
        step_bound = self.step_bound(history)
        if step_bound is not None:
            return step_bound
        if self.n_trials is not None and len(searched) >= self.n_trials:
            return f"n_trials={self.n_trials} search trials were run"
        if self._search_seconds(seconds_left) < 0.5 * _MIN_TRIAL_SECONDS:
            return "the search's share of the time budget is spent"
        if self._searched_enough(history, searched):
            return f"no gain in the last {_PATIENCE} trials: the search stops"
        skipped = list(reversed(searched))[:_SKIPS_BEFORE_GIVING_UP]
        if len(skipped) == _SKIPS_BEFORE_GIVING_UP and all(t.skipped for t in skipped):
            return (
                f"the sampler's last {_SKIPS_BEFORE_GIVING_UP} proposals were all known "
                "to fail: nothing new is left to search"
            )
        return None

    def _search(
        self, history: Sequence[Trial], mine: Sequence[Trial], seconds_left: float
    ) -> Plan | Stop:
        ended = self.search_ended(history, seconds_left=seconds_left)
        if ended is not None:
            return Stop(ended)
        seconds = min(self._trial_seconds, self._search_seconds(seconds_left))
        tried = {params_key(t.params) for t in history}
        for params in self.starting_points(history):
            if params_key(params) not in tried and self.known_failure(params, history) is None:
                return Plan(Phase.SEARCH, params, seconds, "a starting point")
        between = self.bisection(history)
        if between is not None and params_key(between) not in tried:
            return Plan(Phase.SEARCH, between, seconds, "bisecting a failure boundary")
        return Plan(Phase.SEARCH, None, seconds, "the sampler's proposal")

    def starting_points(self, history: Sequence[Trial]) -> list[Params]:
        """The cost model's guesses (with processes, then with threads), then the
        doubling ladder (see ``SearchSpace.ladder``)."""
        measured = baseline_measurement(history)
        facts = measured.as_dict() if measured is not None else {}
        return self.space.ladder(
            first=guess_workers(facts, usable_cpus=self.usable_cpus),
            limit_threads=loads_on_several_threads(facts),
            first_threads=guess_threads(facts),
        )

    # NOTE [ Failure boundary ]
    # Some faults come with the worker count: a WebDataset with k shards fails every
    # count above k; a dataset that crashes or hangs in workers >= k fails every count
    # above k. Once failures of such a kind are seen at two counts or more above the
    # largest count that worked, every count from the smallest of them up is known to
    # fail (the sampler draws fewer workers, and a proposal there would be recorded
    # without running), and the search bisects between the largest success and the
    # smallest failure to find the most workers that work, instead of spending the
    # budget above the boundary.
    def boundary(self, history: Sequence[Trial]) -> tuple[int, int] | None:
        """``(largest count that worked, smallest count that failed above it)``, when
        failures of a worker-count kind lie above every success; else ``None``. Thread
        workers have no such faults: only worker processes count."""
        history = [t for t in history if t.params.get("worker_kind") != "threads"]
        largest = max((t.workers for t in history if _ran(t.outcome)), default=0)
        failed = [t.workers for t in _worker_count_failures(history) if t.workers > largest]
        if not failed:
            return None
        return largest, min(failed)

    def bisection(self, history: Sequence[Trial]) -> Params | None:
        """A setting halfway between the largest count that worked and the smallest that
        failed, if there is room between them (the best setting's other options)."""
        found = self.boundary(history)
        if found is None:
            return None
        worked, failed = found
        if failed - worked <= 1 or worked == 0:
            return None
        best = max(
            (t for t in history if isinstance(t.outcome, Completed) and t.workers > 0),
            key=lambda t: t.outcome.value,  # type: ignore[union-attr]
            default=None,
        )
        if best is None:
            return None
        return {**best.params, "num_workers": (worked + failed) // 2}

    def step_bound(self, history: Sequence[Trial]) -> str | None:
        """Why the search can stop, if a measured setting left the loop bound by its
        step (see ``_STEP_BOUND_WAIT``)."""
        for trial in history:
            measurement = trial.measurement
            if not isinstance(trial.outcome, Completed) or measurement is None:
                continue
            wait = measurement.data_wait_fraction
            if wait > _STEP_BOUND_WAIT or measurement.relative_error > _STEP_BOUND_ERROR:
                continue
            if trial.phase is Phase.BASELINE:
                return (
                    f"the loop is bound by its step already with num_workers=0: it waits for "
                    f"data {wait:.1%} of the time, so no setting can make it faster; nothing "
                    "was searched"
                )
            searched = sum(t.phase is Phase.SEARCH and not t.earlier for t in history)
            return (
                f"the loop is bound by its step: with trial {trial.number}'s setting it "
                f"waits for data {wait:.1%} of the time, so no setting can make it faster; "
                f"the search stopped after {searched} trials"
            )
        return None

    def _searched_enough(self, history: Sequence[Trial], searched: Sequence[Trial]) -> bool:
        """Whether the last _PATIENCE search trials, after the starting points, found
        nothing better than the best before them (see ``NOTE [ Enough searching ]``)."""
        measured = [t for t in searched if not t.skipped]
        if len(measured) < len(self.starting_points(history)) + _PATIENCE:
            return False
        before, recent = measured[:-_PATIENCE], measured[-_PATIENCE:]
        best_before = max((t.value for t in before if t.value is not None), default=None)
        if best_before is None:
            return False
        best_recent = max((t.value for t in recent if t.value is not None), default=0.0)
        return best_recent <= (1 + _TIE_TOLERANCE) * best_before

    def _stop_if_every_setting_fails(self, searched: Sequence[Trial]) -> None:
        if len(searched) < _FAILURES_BEFORE_GIVING_UP:
            return
        if any(not isinstance(t.outcome, Failed) for t in searched):
            return
        reasons = sorted({t.outcome.reason for t in searched if isinstance(t.outcome, Failed)})
        raise AllSettingsFailedError(
            f"All {len(searched)} settings with workers failed, while num_workers=0 works: "
            f"{'; '.join(reasons)}. The dataset or collate_fn fails in worker processes "
            "(state that does not survive fork or pickling, per-process resources, "
            "limits); fix that, or keep num_workers=0."
        )

    def _runoff(
        self, history: Sequence[Trial], mine: Sequence[Trial], seconds_left: float
    ) -> Plan | Stop:
        """The next setting of the runoff's rounds: each round measures the candidates,
        best first, then the baseline. A setting is run only if its typical duration
        fits in the time left; the runoff ends at the first that does not."""
        order = self.runoff_order(history)
        if not order:
            return Stop("nothing to measure again")
        rounds = 1 if self.step_bound(history) else _RUNOFF_ROUNDS
        done = sum(t.phase is Phase.RUNOFF for t in mine)
        sequence = [*order, BASELINE_PARAMS] * rounds
        if done >= len(sequence):
            return Stop(f"the runoff's {rounds} round(s) are done")
        params = sequence[done]
        if _typical_duration(history, params, self._trial_seconds) > seconds_left:
            return Stop("no time left for another runoff trial")
        # Runoff trials get the same time as search trials: shorter ones catch the
        # CPU burst of many workers starting on few cores and understate them.
        return Plan(Phase.RUNOFF, params, self._trial_seconds, "measured again, interleaved")

    def runoff_order(self, history: Sequence[Trial]) -> list[Params]:
        """The runoff's candidates, best first: the best medians of the search (and of
        earlier runs' runoffs), not this run's runoff, so the order holds throughout."""
        searched = [
            t for t in history if t.phase is Phase.SEARCH or (t.earlier and t.phase is Phase.RUNOFF)
        ]
        groups = _values_by_setting(searched)
        baseline = params_key(BASELINE_PARAMS)
        ranked = sorted(
            (key for key in groups if key != baseline),
            key=lambda key: -statistics.median(groups[key][1]),
        )
        return [json.loads(key) for key in ranked[:_RUNOFF_CANDIDATES]]

    # During a trial -----------------------------------------------------------------

    def deadlines(self, params: Mapping[str, Any], history: Sequence[Trial]) -> Deadlines:
        """How long one batch may take with ``params`` (see ``NOTE [ Hang deadlines ]``)."""
        workers = int(params["num_workers"])
        measured = baseline_measurement(history)
        if measured is None:
            limit = max(_BASELINE_TIMEOUT, self.time_budget)
            return Deadlines(first=limit, each=limit)
        per_batch = measured.load_seconds + measured.step_seconds
        slowdown = max(1.0, workers / self.usable_cpus)
        each = max(_MIN_BATCH_TIMEOUT, _TIMEOUT_FACTOR * per_batch * slowdown)
        return Deadlines.per_batch(each, workers=workers)

    def value(
        self, params: Mapping[str, Any], measurement: Measurement, history: Sequence[Trial]
    ) -> float:
        """The objective: samples per second over an epoch (``NOTE [ Epoch model ]``)."""
        measured = baseline_measurement(history)
        return epoch_samples_per_second(
            params,
            measurement,
            batch_size=self.batch_size,
            batches_per_epoch=self.batches_per_epoch,
            refill_seconds=measured.load_seconds if measured is not None else 0.0,
        )

    def vote(
        self, phase: Phase, params: Mapping[str, Any], window: int, measurement: Measurement,
        history: Sequence[Trial],
    ) -> bool:  # fmt: skip
        """Whether a search trial should stop at this window: clearly slower than the
        best complete trial so far. The runoff and the baseline are always measured."""
        if phase is not Phase.SEARCH or window < _VOTE_AFTER_WINDOWS:
            return False
        best = max((t.value for t in history if t.value is not None), default=None)
        if best is None:
            return False
        return self.value(params, measurement, history) < _VOTE_RATIO * best

    def judge(
        self, phase: Phase, params: Mapping[str, Any], measurement: Measurement,
        history: Sequence[Trial], *, voted: bool = False,
    ) -> Outcome:  # fmt: skip
        """The outcome of a trial that measured ``measurement``."""
        if voted:
            return Pruned(PruneKind.SLOWER, PRUNED_AS_SLOWER, measurement)
        if measurement.too_short and phase is not Phase.BASELINE:
            return Pruned(PruneKind.TOO_SHORT, _too_short_reason(measurement), measurement)
        return Completed(measurement, self.value(params, measurement, history))

    def known_failure(self, params: Mapping[str, Any], history: Sequence[Trial]) -> Outcome | None:
        """The outcome an earlier trial shows ``params`` would have, if it would fail;
        ``None`` if it is worth running.

        A setting that failed fails again (crashes and hangs are rarely a matter of
        luck, and measuring a hang again costs its whole deadline). Memory only grows
        with workers, prefetch and pinning, so a setting that asks at least as much as
        one that passed the memory budget (or was OOM-killed) would pass it too. Past a
        failure boundary (``NOTE [ Failure boundary ]``) every count fails. Once thread
        workers failed (the dataset raised or hung when read from several threads, see
        ``NOTE [ Thread workers ]``), no thread setting is run again.
        """
        threads = params.get("worker_kind") == "threads"
        for trial in history:
            outcome = trial.outcome
            if _over_memory(outcome) and _asks_at_least(params, trial.params):
                assert isinstance(outcome, Pruned)
                note = f" (not run: asks at least as much memory as trial {trial.number})"
                return Pruned(outcome.kind, outcome.reason + note, same_as=trial.number)
            same = params_key(params) == params_key(trial.params)
            if same and isinstance(outcome, Failed) and outcome.kind is not FaultKind.INTERRUPTED:
                return Failed(outcome.kind, outcome.reason, same_as=trial.number)
            if threads and _threads_failed(trial):
                assert isinstance(outcome, Failed)
                note = f" (not run: thread workers failed in trial {trial.number})"
                return Failed(outcome.kind, outcome.reason + note, same_as=trial.number)
        return None if threads else self._beyond_boundary(params, history)

    def failing_from(self, history: Sequence[Trial]) -> int | None:
        """The worker count from which every count is known to fail (``NOTE [ Failure
        boundary ]``): failures of a worker-count kind at two counts or more above every
        count that ran. The sampler is then asked for fewer workers only."""
        found = self.boundary(history)
        if found is None:
            return None
        _, smallest = found
        counts = {t.workers for t in _worker_count_failures(history) if t.workers >= smallest}
        return smallest if len(counts) >= 2 else None

    def _beyond_boundary(
        self, params: Mapping[str, Any], history: Sequence[Trial]
    ) -> Failed | None:
        smallest = self.failing_from(history)
        if smallest is None or int(params["num_workers"]) < smallest:
            return None
        first = min(
            (t for t in _worker_count_failures(history) if t.workers >= smallest),
            key=lambda t: t.workers,
        )
        assert isinstance(first.outcome, Failed)
        return Failed(
            first.outcome.kind,
            f"{first.outcome.reason} (not run: every count from {smallest} workers up "
            f"failed so far)",
            same_as=first.number,
        )

    # The choice -----------------------------------------------------------------------

    def choose(self, history: Sequence[Trial]) -> Choice:
        """The settings to return, from every complete trial of the study.

        Only the baseline and settings measured as often as the best-measured ones are
        eligible (at most twice is asked: the runoff's candidates are measured in the
        search and then in each round, interleaved), so a setting measured once cannot
        beat repeated, side-by-side measurements with one lucky sample. Each is scored by the median
        of its values (a heavy-tailed sample moves a median of three little); among
        those within ``_TIE_TOLERANCE`` of the best score the cheapest wins: more
        workers or prefetch only cost memory and start-up.

        Raises:
            ValueError: no trial completed (the baseline always does, or the run stops).
        """
        groups = _values_by_setting(history)
        if not groups:
            raise ValueError("no complete trial to choose from")
        most = max(len(values) for _, values in groups.values())
        baseline_key = params_key(BASELINE_PARAMS)
        eligible = {
            k: v for k, (_, v) in groups.items() if len(v) >= min(2, most) or k == baseline_key
        }
        scores = {key: statistics.median(values) for key, values in eligible.items()}
        top = max(scores.values())
        ties = [key for key, score in scores.items() if score >= (1 - _TIE_TOLERANCE) * top]
        chosen = min(ties, key=lambda key: _cost(json.loads(key)))
        baseline = groups.get(baseline_key, ([], []))[0]
        return Choice(json.loads(chosen), _median_rate(groups[chosen][0]), _median_rate(baseline))

    def shortcomings(self, history: Sequence[Trial], *, search_seconds: float) -> list[str]:
        """What the result rests on less than a search for, in words: a baseline measured
        too briefly to tell its error, or no setting with workers measured to the end.
        The defaults are never returned without saying why.

        Args:
            search_seconds: what the checks and the baseline left for the search.
        """
        mine = [t for t in history if not t.earlier]
        found = []
        measured = baseline_measurement(mine)
        if measured is not None and not math.isfinite(measured.relative_error):
            found.append(
                f"the baseline (num_workers=0) timed {measured.batches} batches "
                "before its time ran out, too few to tell its rate's error: the speedup "
                "against it is uncertain; a larger time_budget measures it properly"
            )
        if any(isinstance(t.outcome, Completed) and t.phase is not Phase.BASELINE for t in history):
            return found
        searched = [t for t in mine if t.phase is not Phase.BASELINE]
        if not searched and self.step_bound(history) is None:
            found.append(
                f"the search did not run: the checks and the baseline left "
                f"{search_seconds:.1f} s of the {self.time_budget:.0f} s budget, too "
                "little for a trial; these are the defaults. Tune with a larger time_budget"
            )
        elif searched:
            states: dict[str, int] = {}
            for trial in searched:
                state = type(trial.outcome).__name__.lower()
                states[state] = states.get(state, 0) + 1
            counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
            found.append(
                f"no setting with workers was measured to the end ({counts}): these are "
                "the defaults, not a tuned setting; the failures say why"
            )
        return found

    @property
    def _trial_seconds(self) -> float:
        return trial_seconds(self.time_budget)

    def _search_seconds(self, seconds_left: float) -> float:
        return seconds_left - _RUNOFF_SHARE * self.time_budget


def _worker_count_failures(history: Sequence[Trial]) -> list[Trial]:
    """Trials run that failed with a fault that comes with the worker count."""
    return [
        t for t in history
        if isinstance(t.outcome, Failed) and t.outcome.kind in WORKER_COUNT_FAULTS
        and not t.skipped
    ]  # fmt: skip


def _threads_failed(trial: Trial) -> bool:
    """Whether ``trial`` ran thread workers and failed for the setting's sake."""
    outcome = trial.outcome
    return (
        trial.params.get("worker_kind") == "threads"
        and isinstance(outcome, Failed)
        and outcome.kind is not FaultKind.INTERRUPTED
    )


def _over_memory(outcome: Outcome) -> bool:
    return isinstance(outcome, Pruned) and outcome.kind in (PruneKind.MEMORY, PruneKind.KILLED)


def _ran(outcome: Outcome) -> bool:
    """Whether the setting ran without failing: complete, or not counted for its pace."""
    return isinstance(outcome, Completed) or (
        isinstance(outcome, Pruned) and outcome.kind in (PruneKind.SLOWER, PruneKind.TOO_SHORT)
    )


def baseline_measurement(history: Sequence[Trial]) -> Measurement | None:
    """What the first complete baseline trial measured, or ``None`` before it."""
    for trial in history:
        if trial.phase is Phase.BASELINE and isinstance(trial.outcome, Completed):
            return trial.outcome.measurement
    return None


def _values_by_setting(trials: Sequence[Trial]) -> dict[str, tuple[list[Measurement], list[float]]]:
    """Complete trials grouped by their settings: their measurements and values."""
    groups: dict[str, tuple[list[Measurement], list[float]]] = {}
    for trial in trials:
        if isinstance(trial.outcome, Completed):
            measurements, values = groups.setdefault(params_key(trial.params), ([], []))
            measurements.append(trial.outcome.measurement)
            values.append(trial.outcome.value)
    return groups


def _typical_duration(history: Sequence[Trial], params: Mapping[str, Any], default: float) -> float:
    """Median seconds the complete trials of a setting took, or ``default``."""
    key = params_key(params)
    durations = [
        t.outcome.measurement.duration
        for t in history
        if isinstance(t.outcome, Completed) and params_key(t.params) == key
    ]
    return statistics.median(durations) if durations else default


def _too_short_reason(measurement: Measurement) -> str:
    if measurement.burst_undrained:
        return (
            f"{PruneKind.TOO_SHORT.value}: timing had to begin with {measurement.burst_left} "
            "of the batches queued at start-up not yet drained, and they would count as "
            f"loaded in the {measurement.batches} batches timed, so its rate is "
            "not counted (a larger time_budget gives each trial time to drain them)"
        )
    return (
        f"{PruneKind.TOO_SHORT.value}: the trial's {measurement.duration:.1f} s ran out before "
        f"two timing windows (first batch after {measurement.time_to_first_batch:.1f} s, "
        f"{measurement.batches} batches timed), so its rate has no error estimate and is "
        "not counted"
    )


def _asks_at_least(params: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether ``params`` holds at least as many batches, as pinned, as ``other``, with
    workers of the same kind (worker processes copy what thread workers share)."""
    return (
        params.get("worker_kind") == other.get("worker_kind")
        and params["num_workers"] >= other["num_workers"] > 0
        and (params["prefetch_factor"] or 0) >= (other["prefetch_factor"] or 0)
        and params["pin_memory"] >= other["pin_memory"]
    )


def _cost(params: Mapping[str, Any]) -> tuple[int, int, int, bool, bool, bool]:
    """Fewest worker processes (each a copy of what it reads, and a start-up), then
    fewest threads, smallest prefetch, no pinning; then one indexing per batch (less
    CPU), then batches in order (reproducible)."""
    threads = params.get("worker_kind") == "threads"
    return (
        0 if threads else params["num_workers"],
        params["num_workers"] if threads else 0,
        params["prefetch_factor"] or 0,
        params["pin_memory"],
        not params.get("batched_fetch", False),
        not params.get("in_order", True),
    )


def _median_rate(measurements: list[Measurement]) -> float:
    if not measurements:
        return 0.0
    return float(statistics.median(m.samples_per_second for m in measurements))
