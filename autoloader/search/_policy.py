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

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoloader._exceptions import AllSettingsFailedError
from autoloader.loader import BASELINE_PARAMS, Params
from autoloader.measure import Deadlines, Measurement
from autoloader.search._choice import Choice, choose, values_by_setting
from autoloader.search._cost_model import (
    GIVE_BACK_WAIT,
    STEP_ON_CPU,
    STEP_SHARE_OF_WORK,
    batch_seconds,
    guess_threads,
    guess_workers,
    loading_on_cpu,
    loads_on_several_threads,
    split_step_threads,
)
from autoloader.search._hang_deadlines import HangRules
from autoloader.search._known_failures import bisection, known_failure, params_key
from autoloader.search._objective import (
    MIN_TRIAL_SECONDS,
    epoch_samples_per_second,
    too_short_reason,
    trial_seconds,
    typical_duration,
)
from autoloader.search._outcome import (
    Completed,
    Failed,
    Outcome,
    Phase,
    Pruned,
    PruneKind,
    Trial,
    baseline_measurement,
)
from autoloader.search._patience import patience, searched_enough
from autoloader.search._reasons import (
    BaselineUncertain,
    NoGain,
    NothingNewToPropose,
    NothingToMeasureAgain,
    NoTimeForRunoff,
    NoWorkerSettingMeasured,
    RunoffDone,
    SearchDidNotRun,
    SearchEnd,
    SearchShareSpent,
    Shortcoming,
    StepBound,
    StepThreadsLeft,
    StepThreadsSearched,
    StepThreadsToApply,
    StopReason,
    ThreadsNote,
    TrialCap,
    WorkersCappedAtCores,
)
from autoloader.search._space import SearchSpace

# Share of the time budget kept for the runoff, and how it is spent.
_RUNOFF_SHARE = 0.2
_RUNOFF_CANDIDATES = 3
_RUNOFF_ROUNDS = 2
# NOTE [ The baseline in training ]
# In AutoLoader's search the baseline is training at the defaults' pace, measured once
# (not again in the runoff): its figure is the speedup's reference and the cost model's
# input, and it may measure half a trial's time. On the development VM's images pipeline
# (a 20 s budget) it took 2 s to reach its target error, at 0.58 of the chosen rate.
_TRAINING_BASELINE_SHARE = 0.5
# A loop that waits for data less than GIVE_BACK_WAIT of its time (see _cost_model.py)
# is bound by its step: no setting can make it faster, so the search ends with the first
# setting that gets there (measured to _STEP_BOUND_ERROR), and the rest of the budget is
# given back. If the baseline already gets there, there is no search at all.
_STEP_BOUND_ERROR = 0.05
# Where the baseline's loading was CPU work, the ladder's rungs stop at this many
# workers a CPU (NOTE [ Cost model ]): past the cores, workers only take turns on them.
# On the development VM's images pipeline (JPEG decoding, 2 cores), the rungs of 8 and
# 16 workers took 6-7 s of a 20 s budget (16 workers start in about 1.5 s) and measured
# 5-15% under 2 to 4 workers; a rung that high left the runoff no time, and one lucky
# sample chose it. The sampler may still propose more.
_RUNGS_PER_CPU = 2
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
# NOTE [ Starting points that cannot win ]
# A starting point whose best case, by the cost model (the step, or the baseline's load
# shared by its workers, an epoch's refill added: Policy.batch_seconds), is below
# _VOTE_RATIO of the best value measured would be voted out: it is not measured. Under
# torchrun a trial cannot be voted out (its length in batches is agreed beforehand), so
# the ladder's low rungs ran whole: in a 2-rank Lightning DDP fit of 12-batch epochs
# (benchmarks/ddp_short_epochs.py), after the guess of 12 workers scored 1,770 samples/s,
# the rungs of 1 and 2 workers (at most 333 and 666) took 2.5 s of a 10 s budget at a
# fifth of its rate. Settings without workers or fetching whole batches are measured:
# the baseline's load per item says nothing of them.

# The step works on the CPU, and its threads are searched (NOTE [ Step threads ]), where
# the thread that runs it was on the CPU at least STEP_ON_CPU (_cost_model.py) of the
# step in the baseline. The thread's own time, not the process's: torch's pool spins for
# a while after each parallel op, so the loading's ops charge a sleeping step CPU time (in the
# baselines of the development VM's corpus, the images pipeline's 20 ms sleep after JPEG
# decoding and torch ops kept 0.56 CPUs busy, its own thread 0.01; cpu-train's CNN
# trained on the CPU kept 1.96 busy, its own thread 1.00).
# And the step's CPU time must be a real share of the CPU work per batch
# (STEP_SHARE_OF_WORK, NOTE [ Cost model ]): a step of a few microseconds of Python is on
# the CPU all its time, and its threads matter to nothing.

# The reason of a trial voted out as slower: the setting is slow, not broken.
PRUNED_AS_SLOWER = "clearly slower than the best setting so far"


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

    why: StopReason


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
        worker_start: seconds to start one worker process, as measured before the
            search (``NOTE [ Worker start-up ]`` in ``checks/_facts.py``), or ``None``.
        accelerator: the device the step's batches go to, where it is an accelerator
            (``"cuda:0"``): the step waits on it, and its threads are left alone unless
            asked for (``step_threads_asked``).
        step_threads_asked: the user asked for ``step_threads`` in the search space:
            they are searched whatever the step does.
        runoff_baseline: the runoff measures the baseline again in each round, beside
            the candidates, so that the speedup is measured side by side too. AutoLoader
            leaves it out: in the training loop, each of its trials is training run at
            the defaults' pace.
        first: settings measured before the cost model's guesses, their worker counts
            held to the space (``SearchSpace.held``): in a search drift started, the
            setting in use with the workers its slowed loading needs (``NOTE [ Drift ]``).
        in_training: the trials run in the user's training loop (AutoLoader's): the
            search counts its starting points in its patience (``NOTE [ Enough
            searching ]`` in ``_patience.py``).
    """

    space: SearchSpace
    time_budget: float
    batch_size: int
    batches_per_epoch: int | None = None
    n_trials: int | None = None
    usable_cpus: int = 1
    worker_start: float | None = None
    accelerator: str | None = None
    step_threads_asked: bool = False
    runoff_baseline: bool = True
    first: tuple[Params, ...] = ()
    in_training: bool = False

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
            # Half a trial in training (NOTE [ The baseline in training ]).
            longest = self._trial_seconds * (_TRAINING_BASELINE_SHARE if self.in_training else 1)
            seconds = max(0.5 * MIN_TRIAL_SECONDS, min(longest, seconds_left))
            return Plan(Phase.BASELINE, BASELINE_PARAMS, seconds, "the baseline")
        mine = [t for t in history if not t.earlier]
        if not any(t.phase is Phase.RUNOFF for t in mine):
            plan = self._search(history, mine, seconds_left)
            if isinstance(plan, Plan):
                return plan
        return self._runoff(history, mine, seconds_left)

    def search_ended(self, history: Sequence[Trial], *, seconds_left: float) -> SearchEnd | None:
        """Why the search phase is over, or ``None`` if it goes on."""
        mine = [t for t in history if not t.earlier]
        searched = [t for t in mine if t.phase is Phase.SEARCH]
        self._stop_if_every_setting_fails(searched)
        step_bound = self.step_bound(history)
        if step_bound is not None:
            return step_bound
        if self.n_trials is not None and len(searched) >= self.n_trials:
            return TrialCap(self.n_trials)
        fits = typical_duration(mine, 0.5 * MIN_TRIAL_SECONDS, phase=Phase.SEARCH)
        if self._search_seconds(history, seconds_left) < fits:  # NOTE [ Trials that fit ]
            return SearchShareSpent()
        measured = [t for t in searched if not t.skipped]
        starting_points = len(self.starting_points(history))
        if searched_enough(measured, starting_points=starting_points, in_training=self.in_training):
            return NoGain(patience(in_training=self.in_training))
        skipped = list(reversed(searched))[:_SKIPS_BEFORE_GIVING_UP]
        if len(skipped) == _SKIPS_BEFORE_GIVING_UP and all(t.skipped for t in skipped):
            return NothingNewToPropose(_SKIPS_BEFORE_GIVING_UP)
        return None

    def _search(
        self, history: Sequence[Trial], mine: Sequence[Trial], seconds_left: float
    ) -> Plan | Stop:
        ended = self.search_ended(history, seconds_left=seconds_left)
        if ended is not None:
            return Stop(ended)
        seconds = min(self._trial_seconds, self._search_seconds(history, seconds_left))
        tried = {params_key(t.params) for t in history}
        startable = self.startable(history, seconds_left)
        for params in self.starting_points(history):
            if params_key(params) in tried or known_failure(params, history) is not None:
                continue
            if startable is not None and params["num_workers"] > startable:
                continue  # its workers would not start before the run's end
            if self.cannot_win(params, history):
                continue
            return Plan(Phase.SEARCH, params, seconds, "a starting point")
        between = bisection(history)
        if between is not None and params_key(between) not in tried:
            return Plan(Phase.SEARCH, between, seconds, "bisecting a failure boundary")
        return Plan(Phase.SEARCH, None, seconds, "the sampler's proposal")

    def starting_points(self, history: Sequence[Trial]) -> list[Params]:
        """The settings given :attr:`first`, then the cost model's guesses (with
        processes, then with threads), then the doubling ladder (see
        ``SearchSpace.ladder``), its rungs held to :meth:`rungs_up_to`."""
        measured = baseline_measurement(history)
        facts = measured.as_dict() if measured is not None else {}
        space = self.sampled_space(history)
        first = [held for held in map(space.held, self.first) if held is not None]
        on_cpu = space.step_threads is not None
        guesses = guess_workers(facts, usable_cpus=self.usable_cpus, step_on_cpu=on_cpu)
        points = space.ladder(
            first=guesses,
            limit_threads=loads_on_several_threads(facts),
            first_threads=guess_threads(facts),
            step_threads=split_step_threads(facts, usable_cpus=self.usable_cpus),
        )
        rungs = self.rungs_up_to(history)
        if rungs is not None and points:
            rungs = max(rungs, min(p["num_workers"] for p in points))  # one rung at least
            points = [p for p in points if p["num_workers"] <= rungs or p["num_workers"] in guesses]
        cap = self.workers_cap(history)
        return [p for p in [*first, *points] if cap is None or p["num_workers"] <= cap.cpus]

    def batch_seconds(self, params: Mapping[str, Any], history: Sequence[Trial]) -> float | None:
        """Seconds a batch is expected to take the loop with ``params``, epoch edges
        included, from the baseline's measurement (``NOTE [ Cost model ]``); ``None``
        before it."""
        measured = baseline_measurement(history)
        if measured is None:
            return None
        return batch_seconds(
            measured.as_dict(),
            int(params["num_workers"]),
            usable_cpus=self.usable_cpus,
            batches_per_epoch=self.batches_per_epoch,
            step_on_cpu=self.sampled_space(history).step_threads is not None,
        )

    def cannot_win(self, params: Mapping[str, Any], history: Sequence[Trial]) -> bool:
        """Whether a starting point would be voted out even at its best: the rate the
        cost model's time a batch allows (:meth:`batch_seconds`, the step or the load
        shared by the workers, which contention only slows) below _VOTE_RATIO of the
        best value measured (``NOTE [ Starting points that cannot win ]``). Where a
        batch is fetched whole, or without workers, the baseline's load says nothing
        of it: those are measured."""
        if not params["num_workers"] or params.get("batched_fetch"):
            return False
        seconds = self.batch_seconds(params, history)
        best = max((t.value for t in history if t.value is not None), default=None)
        if not seconds or best is None:
            return False
        return self.batch_size / seconds < _VOTE_RATIO * best

    def rungs_up_to(self, history: Sequence[Trial]) -> int | None:
        """The most workers a rung of the ladder has where the baseline's loading was CPU
        work: twice the CPUs (``NOTE [ Cost model ]``), the ladder's lowest rung at
        least; ``None`` elsewhere."""
        measured = baseline_measurement(history)
        on_cpu = self.sampled_space(history).step_threads is not None
        if measured is None or not loading_on_cpu(measured.as_dict(), step_on_cpu=on_cpu):
            return None
        return _RUNGS_PER_CPU * self.usable_cpus

    # The training process's threads ------------------------------------------------

    def sampled_space(self, history: Sequence[Trial]) -> SearchSpace:
        """The space the sampler draws from, now that the baseline showed what the step
        does: without ``step_threads`` where they are left alone (see
        :meth:`step_threads_left`)."""
        if self.step_threads_left(history, threads=0) is None:
            return self.space
        return dataclasses.replace(self.space, step_threads=None)

    def workers_cap(self, history: Sequence[Trial]) -> WorkersCappedAtCores | None:
        """The most workers worth measuring where the step's threads are searched and
        the baseline's loading was CPU work too: the CPUs (``NOTE [ Cost model ]``).
        ``None`` elsewhere, or where the space's range starts above them."""
        measured = baseline_measurement(history)
        if measured is None or self.sampled_space(history).step_threads is None:
            return None
        low, high = self.space.num_workers  # type: ignore[misc]
        if not low <= self.usable_cpus < high:
            return None
        if not loading_on_cpu(measured.as_dict(), step_on_cpu=True):
            return None
        return WorkersCappedAtCores(self.usable_cpus)

    def step_threads_left(
        self, history: Sequence[Trial], *, threads: int
    ) -> StepThreadsLeft | None:
        """Why the training process's ``threads`` are left alone though the space has a
        range for them, or ``None`` where they are searched (or the space fixes them):
        the step runs on an accelerator, or waits (``STEP_ON_CPU``), or does too
        small a share of the CPU work to matter. Before the baseline, nothing is known,
        and they are searched."""
        choices = self.space.step_threads
        if not isinstance(choices, tuple) or choices[0] == choices[1] or self.step_threads_asked:
            return None
        measured = baseline_measurement(history)
        if measured is None:
            return None
        own = _own_share(measured)
        if self.accelerator is not None:
            return StepThreadsLeft(threads, own, self.accelerator)
        if own < STEP_ON_CPU:
            return StepThreadsLeft(threads, own)
        work = measured.step_cpu_seconds + measured.load_cpu_seconds
        share = measured.step_cpu_seconds / work if work > 0 else 0.0
        if share < STEP_SHARE_OF_WORK:
            return StepThreadsLeft(threads, own, work_share=share)
        return None

    def step_threads_notes(
        self, history: Sequence[Trial], choice: Choice, *, threads: int
    ) -> list[ThreadsNote]:
        """What the user should know of the training process's threads: searched or left
        alone (``threads``: what the process has), the workers they cap, and what the
        choice asks of them."""
        notes: list[ThreadsNote] = []
        measured = baseline_measurement(history)
        left = self.step_threads_left(history, threads=threads)
        choices = self.space.step_threads
        if left is not None:
            notes.append(left)
        elif (
            isinstance(choices, tuple)
            and choices[0] < choices[1]
            and not self.step_threads_asked  # asked for, they need no why
            and measured is not None
        ):
            busy = measured.step_cpu_seconds
            step_cpus = busy / measured.step_seconds if measured.step_seconds else 0.0
            notes.append(StepThreadsSearched(*choices, _own_share(measured), step_cpus))
        cap = self.workers_cap(history)
        if cap is not None:
            notes.append(cap)
        chosen = choice.params.get("step_threads")
        if chosen is not None:
            notes.append(
                StepThreadsToApply(chosen, threads, choice.params["num_workers"], self.usable_cpus)
            )
        return notes

    def step_bound(self, history: Sequence[Trial]) -> StepBound | None:
        """Why the search can stop, if a measured setting left the loop bound by its
        step (see ``GIVE_BACK_WAIT``)."""
        for trial in history:
            measurement = trial.measurement
            if not isinstance(trial.outcome, Completed) or measurement is None:
                continue
            wait = measurement.data_wait_fraction
            if wait > GIVE_BACK_WAIT or measurement.relative_error > _STEP_BOUND_ERROR:
                continue
            searched = sum(t.phase is Phase.SEARCH and not t.earlier for t in history)
            return StepBound(trial.number, wait, searched, trial.phase is Phase.BASELINE)
        return None

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
        best first, then the baseline (``runoff_baseline``). A setting is run only if
        its typical duration fits in the time left; the runoff ends at the first that
        does not."""
        order = self.runoff_order(history)
        if not order:
            return Stop(NothingToMeasureAgain())
        rounds = 1 if self.step_bound(history) is not None else _RUNOFF_ROUNDS
        done = sum(t.phase is Phase.RUNOFF for t in mine)
        sequence = [*order, *([BASELINE_PARAMS] if self.runoff_baseline else [])] * rounds
        if done >= len(sequence):
            return Stop(RunoffDone(rounds))
        params = sequence[done]
        if typical_duration(history, self._trial_seconds, params=params) > seconds_left:
            return Stop(NoTimeForRunoff())
        # Runoff trials get the same time as search trials: shorter ones catch the
        # CPU burst of many workers starting on few cores and understate them.
        return Plan(Phase.RUNOFF, params, self._trial_seconds, "measured again, interleaved")

    def runoff_order(self, history: Sequence[Trial]) -> list[Params]:
        """The runoff's candidates, best first: the best medians of the search (and of
        earlier runs' runoffs), not this run's runoff, so the order holds throughout."""
        searched = [
            t for t in history if t.phase is Phase.SEARCH or (t.earlier and t.phase is Phase.RUNOFF)
        ]
        groups = values_by_setting(searched)
        baseline = params_key(BASELINE_PARAMS)
        ranked = sorted(
            (key for key in groups if key != baseline),
            key=lambda key: -statistics.median(groups[key][1]),
        )
        return [json.loads(key) for key in ranked[:_RUNOFF_CANDIDATES]]

    # During a trial -----------------------------------------------------------------

    @property
    def hangs(self) -> HangRules:
        """How long a batch, and a worker's start, may take (``NOTE [ Hang deadlines ]``)."""
        return HangRules(self.time_budget, self.usable_cpus, self.worker_start)

    def deadlines(self, params: Mapping[str, Any], history: Sequence[Trial]) -> Deadlines:
        """How long one batch may take with ``params`` (see ``NOTE [ Hang deadlines ]``)."""
        return self.hangs.deadlines(params, history)

    def startable(self, history: Sequence[Trial], seconds_left: float) -> int | None:
        """The most worker processes that start in ``seconds_left`` (``HangRules``)."""
        return self.hangs.startable(history, seconds_left)

    def startup_seconds(self, params: Mapping[str, Any], history: Sequence[Trial]) -> float:
        """Seconds ``params``'s workers are expected to take to start (``HangRules``)."""
        return self.hangs.startup_seconds(params, history)

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
            return Pruned(PruneKind.TOO_SHORT, too_short_reason(measurement), measurement)
        return Completed(measurement, self.value(params, measurement, history))

    # The choice -----------------------------------------------------------------------

    def choose(self, history: Sequence[Trial]) -> Choice:
        """The settings to return, from every complete trial of the study (see
        :func:`~autoloader.search._choice.choose`)."""
        return choose(history)

    def shortcomings(self, history: Sequence[Trial], *, search_seconds: float) -> list[Shortcoming]:
        """What the result rests on less than a search for: a baseline measured too
        briefly to tell its error, or no setting with workers measured to the end. The
        defaults are never returned without saying why.

        Args:
            search_seconds: what the checks and the baseline left for the search.
        """
        mine = [t for t in history if not t.earlier]
        found: list[Shortcoming] = []
        measured = baseline_measurement(mine)
        if measured is not None and not math.isfinite(measured.relative_error):
            found.append(BaselineUncertain(measured.batches))
        if any(isinstance(t.outcome, Completed) and t.phase is not Phase.BASELINE for t in history):
            return found
        searched = [t for t in mine if t.phase is not Phase.BASELINE]
        if not searched and self.step_bound(history) is None:
            found.append(SearchDidNotRun(search_seconds, self.time_budget))
        elif searched:
            states: dict[str, int] = {}
            for trial in searched:
                state = type(trial.outcome).__name__.lower()
                states[state] = states.get(state, 0) + 1
            found.append(NoWorkerSettingMeasured(tuple(sorted(states.items()))))
        return found

    @property
    def _trial_seconds(self) -> float:
        return trial_seconds(self.time_budget)

    def _search_seconds(self, history: Sequence[Trial], seconds_left: float) -> float:
        """What ``seconds_left`` leaves the search: all but the runoff's share of the
        budget, or one measurement of its first candidate where that is longer (``NOTE
        [ Trials that fit ]``)."""
        order = self.runoff_order(history)
        first = typical_duration(history, 0.0, params=order[0]) if order else 0.0
        return seconds_left - max(_RUNOFF_SHARE * self.time_budget, first)


def _own_share(measured: Measurement) -> float:
    """The share of the step its own thread was on the CPU (``STEP_ON_CPU``)."""
    if not measured.step_seconds:
        return 0.0
    return measured.step_thread_cpu_seconds / measured.step_seconds
