"""Why the search stopped, and what a user should know about the run: typed values,
put into words in one place, :func:`render`.

The rules decide with these values (``isinstance(ended, StepBound)``), never with their
words; the sentences are made once, for the log and for ``TuneResult.notes``::

    SearchEnd    why the search phase is over: StepBound | TrialCap | SearchShareSpent
                 | NoGain | NothingNewToPropose
    RunoffEnd    why the runoff is over: NothingToMeasureAgain | RunoffDone
                 | NoTimeForRunoff
    Shortcoming  what the result rests on less than a search for: BaselineUncertain
                 | SearchDidNotRun | NoWorkerSettingMeasured
    SpaceNote    a setting fixed, or searched, by SearchSpace resolution
    ThreadsNote  the training process's threads, searched or left alone once the
                 baseline showed what the step does, and what the choice asks of them
    RunNote      about the run as a whole: TunedJointly | Interrupted | BudgetGivenBack
                 | Resumed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, TypeAlias

# Why the search ends -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepBound:
    """The loop waits for data so little with trial ``trial``'s setting (the baseline's,
    ``at_baseline``) that no setting can make it faster; ``searched`` search trials ran."""

    trial: int
    wait: float
    searched: int
    at_baseline: bool


@dataclass(frozen=True, slots=True)
class TrialCap:
    """``n_trials`` search trials were run."""

    n: int


@dataclass(frozen=True, slots=True)
class SearchShareSpent:
    """What is left of the time budget is the runoff's."""


@dataclass(frozen=True, slots=True)
class NoGain:
    """The last ``patience`` search trials found nothing better (NOTE [ Enough searching ])."""

    patience: int


@dataclass(frozen=True, slots=True)
class NothingNewToPropose:
    """The sampler's last ``n`` proposals were all known to fail."""

    n: int


# Why the runoff ends -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NothingToMeasureAgain:
    """No setting with workers completed: the runoff has no candidate."""


@dataclass(frozen=True, slots=True)
class RunoffDone:
    """The runoff's ``rounds`` rounds were all measured."""

    rounds: int


@dataclass(frozen=True, slots=True)
class NoTimeForRunoff:
    """The next runoff trial would not fit in the time left."""


# What the result rests on less than a search for ------------------------------------


@dataclass(frozen=True, slots=True)
class BaselineUncertain:
    """The baseline timed only ``batches`` batches: too few to tell its rate's error."""

    batches: int


@dataclass(frozen=True, slots=True)
class SearchDidNotRun:
    """The checks and the baseline left ``seconds`` of the ``budget``: no trial fit."""

    seconds: float
    budget: float


@dataclass(frozen=True, slots=True)
class NoWorkerSettingMeasured:
    """No setting with workers completed; ``counts``: ``(state, trials)`` of those that
    ran, by state name."""

    counts: tuple[tuple[str, int], ...]


# Settings fixed, or searched, by SearchSpace resolution ----------------------------


@dataclass(frozen=True, slots=True)
class WorkersCappedAtEpoch:
    """``num_workers`` is searched up to the ``batches`` of one epoch."""

    batches: int


@dataclass(frozen=True, slots=True)
class WorkersCappedAtStartup:
    """``num_workers`` is searched up to ``workers``: each takes ``seconds`` to start
    (``start_method``), and more would take longer than two trials to start."""

    workers: int
    seconds: float
    start_method: str
    time_budget: float


@dataclass(frozen=True, slots=True)
class PinMemoryAskedForInVain:
    """``pin_memory=True`` was asked for where there is no accelerator."""


@dataclass(frozen=True, slots=True)
class NoAccelerator:
    """``pin_memory`` is fixed to False: there is no accelerator."""


@dataclass(frozen=True, slots=True)
class BatchedFetchSearched:
    """The dataset was checked to give the same batches fetched a batch at a time."""


@dataclass(frozen=True, slots=True)
class ProcessesOnly:
    """Thread workers are not searched: ``problem`` says why."""

    problem: str


@dataclass(frozen=True, slots=True)
class ThreadsSearched:
    """The dataset was checked to give the same batches read from several threads."""


# The training process's threads (NOTE [ Step threads ]) ---------------------------


@dataclass(frozen=True, slots=True)
class StepThreadsSearched:
    """``step_threads`` searched from ``low`` to ``high``: in the baseline, the step's
    own thread was on the CPU ``own_share`` of the step, and the process kept
    ``step_cpus`` CPUs busy."""

    low: int
    high: int
    own_share: float
    step_cpus: float


@dataclass(frozen=True, slots=True)
class StepThreadsLeft:
    """``step_threads`` left as they are (``threads``): the step's own thread was on the
    CPU ``own_share`` of the step in the baseline, or it runs on ``accelerator``, or its
    CPU time was only ``work_share`` of the CPU work per batch."""

    threads: int
    own_share: float
    accelerator: str | None = None
    work_share: float | None = None


@dataclass(frozen=True, slots=True)
class WorkersCappedAtCores:
    """``num_workers`` searched up to the ``cpus``: loading and the step are both CPU
    work, and more workers only take turns with the step's threads."""

    cpus: int


@dataclass(frozen=True, slots=True)
class StepThreadsToApply:
    """The chosen setting runs the step on ``threads`` torch threads, where the process
    had ``before``, leaving ``cpus_left`` of ``usable_cpus`` CPUs to ``workers`` workers:
    a setting of the process, for ``TuneResult.apply_threads()``."""

    threads: int
    before: int
    workers: int
    usable_cpus: int


# About the run as a whole ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TunedJointly:
    """Every rank of a torchrun job measured each trial together."""

    world_size: int
    local_world_size: int
    usable_cpus: int
    nodes: int = 1


@dataclass(frozen=True, slots=True)
class Interrupted:
    """Ctrl-C or SIGTERM (``by``) stopped the run: the result is the best of the trials
    that finished."""

    by: str = "Ctrl-C"


@dataclass(frozen=True, slots=True)
class BudgetGivenBack:
    """The run ended ``elapsed`` seconds into its ``budget``: the search ended for
    ``ended``, and the trials for ``stopped``."""

    elapsed: float
    budget: float
    ended: SearchEnd
    stopped: StopReason


@dataclass(frozen=True, slots=True)
class Resumed:
    """``count`` trials of earlier runs on the same problem were counted in the choice."""

    count: int


SearchEnd: TypeAlias = StepBound | TrialCap | SearchShareSpent | NoGain | NothingNewToPropose
RunoffEnd: TypeAlias = NothingToMeasureAgain | RunoffDone | NoTimeForRunoff
StopReason: TypeAlias = SearchEnd | RunoffEnd
Shortcoming: TypeAlias = BaselineUncertain | SearchDidNotRun | NoWorkerSettingMeasured
SpaceNote: TypeAlias = (
    WorkersCappedAtEpoch
    | WorkersCappedAtStartup
    | PinMemoryAskedForInVain
    | NoAccelerator
    | BatchedFetchSearched
    | ProcessesOnly
    | ThreadsSearched
)
ThreadsNote: TypeAlias = (
    StepThreadsSearched | StepThreadsLeft | WorkersCappedAtCores | StepThreadsToApply
)
RunNote: TypeAlias = TunedJointly | Interrupted | BudgetGivenBack | Resumed
Note: TypeAlias = StopReason | Shortcoming | SpaceNote | ThreadsNote | RunNote


def render(value: Note) -> str:
    """``value`` in words, as the log and ``TuneResult.notes`` say it."""
    # One case per type, every sentence in this module, a function a family; mypy checks
    # (through _not_a_note) that no type is left without one.
    if isinstance(value, StopReason):
        return _stop_reason(value)
    if isinstance(value, Shortcoming):
        return _shortcoming(value)
    if isinstance(value, SpaceNote):
        return _space_note(value)
    if isinstance(value, ThreadsNote):
        return _threads_note(value)
    return _run_note(value)


def _stop_reason(value: StopReason) -> str:
    match value:
        case StepBound(at_baseline=True):
            return (
                f"the loop is bound by its step already with num_workers=0: it waits for "
                f"data {value.wait:.1%} of the time, so no setting can make it faster; nothing "
                "was searched"
            )
        case StepBound():
            return (
                f"the loop is bound by its step: with trial {value.trial}'s setting it "
                f"waits for data {value.wait:.1%} of the time, so no setting can make it "
                f"faster; the search stopped after {value.searched} trials"
            )
        case TrialCap():
            return f"n_trials={value.n} search trials were run"
        case SearchShareSpent():
            return "the search's share of the time budget is spent"
        case NoGain():
            return f"no gain in the last {value.patience} trials: the search stops"
        case NothingNewToPropose():
            return (
                f"the sampler's last {value.n} proposals were all known to fail: nothing new "
                "is left to search"
            )
        case NothingToMeasureAgain():
            return "nothing to measure again"
        case RunoffDone():
            return f"the runoff's {value.rounds} round(s) are done"
        case NoTimeForRunoff():
            return "no time left for another runoff trial"
        case _:
            return _not_a_note(value)


def _shortcoming(value: Shortcoming) -> str:
    match value:
        case BaselineUncertain():
            return (
                f"the baseline (num_workers=0) timed {value.batches} batches before its time "
                "ran out, too few to tell its rate's error: the speedup against it is "
                "uncertain; a larger time_budget measures it properly"
            )
        case SearchDidNotRun():
            return (
                f"the search did not run: the checks and the baseline left "
                f"{value.seconds:.1f} s of the {value.budget:.0f} s budget, too little for a "
                "trial; these are the defaults. Tune with a larger time_budget"
            )
        case NoWorkerSettingMeasured():
            counts = ", ".join(f"{n} {state}" for state, n in value.counts)
            return (
                f"no setting with workers was measured to the end ({counts}): these are the "
                "defaults, not a tuned setting; the failures say why"
            )
        case _:
            return _not_a_note(value)


def _space_note(value: SpaceNote) -> str:
    match value:
        case WorkersCappedAtEpoch():
            return (
                f"num_workers searched up to {value.batches}: an epoch has only "
                f"{value.batches} batches."
            )
        case WorkersCappedAtStartup():
            return (
                f"num_workers searched up to {value.workers}: starting a worker takes "
                f"{value.seconds:.1f} s here ({value.start_method}), and more workers would "
                f"spend more of the {value.time_budget:.0f} s budget starting than measuring; "
                "a larger time_budget lets more be measured."
            )
        case PinMemoryAskedForInVain():
            return "pin_memory=True was asked for, but there is no accelerator here."
        case NoAccelerator():
            return "pin_memory fixed to False: this machine has no accelerator."
        case BatchedFetchSearched():
            return (
                "batched_fetch searched: dataset[list of indices] gives the same batches as "
                "loading the items one by one and collating them."
            )
        case ProcessesOnly():
            return f"worker_kind fixed to processes: {value.problem}."
        case ThreadsSearched():
            return (
                "worker_kind searched: the dataset gave the same batches read from several "
                "threads as from one, so thread workers were measured too."
            )
        case _:
            return _not_a_note(value)


def _threads_note(value: ThreadsNote) -> str:
    match value:
        case StepThreadsSearched():
            return (
                f"step_threads searched from {value.low} to {value.high}: the step works on "
                f"the CPU (its thread busy {value.own_share:.0%} of the step, "
                f"{value.step_cpus:.1f} CPUs busy in all), on the cores the workers load on."
            )
        case StepThreadsLeft(accelerator=str()):
            return (
                f"step_threads left as they are ({value.threads} torch threads): the step "
                f"runs on {value.accelerator} (pass SearchSpace(step_threads=(1, N)) to "
                "search them for a step that also works on the CPU)."
            )
        case StepThreadsLeft(work_share=float()):
            return (
                f"step_threads left as they are ({value.threads} torch threads): the step "
                f"does {value.work_share:.0%} of the CPU work per batch, too little for "
                "its threads to matter."
            )
        case StepThreadsLeft():
            return (
                f"step_threads left as they are ({value.threads} torch threads): the step "
                f"waits (its thread was on the CPU {value.own_share:.0%} of the step), so "
                "its threads do not compete with the workers."
            )
        case WorkersCappedAtCores():
            return (
                f"num_workers searched up to {value.cpus}: loading and the step are both "
                f"CPU work, and more workers than the {value.cpus} CPUs would only take "
                "turns with the step's threads."
            )
        case StepThreadsToApply():
            left = max(0, value.usable_cpus - value.threads)
            workers = f"{value.workers} worker{'s' if value.workers != 1 else ''}"
            return (
                f"step_threads={value.threads}: the tuned settings train on {value.threads} "
                f"torch thread{'s' if value.threads != 1 else ''} (this process had "
                f"{value.before}), leaving {left} of {value.usable_cpus} CPUs to {workers}. "
                "No DataLoader can carry a setting of the training process: call "
                "result.apply_threads() before training (make_loader() does not)."
            )
        case _:
            return _not_a_note(value)


def _run_note(value: RunNote) -> str:
    match value:
        case TunedJointly():
            nodes = f" on {value.nodes} nodes" if value.nodes > 1 else ""
            return (
                f"tuned jointly by {value.world_size} ranks{nodes} ({value.local_world_size} "
                f"per node), each with {value.usable_cpus} of its node's CPUs: figures are "
                "samples per second of the slowest rank"
            )
        case Interrupted():
            return (
                f"interrupted ({value.by}): these settings are the best of the trials that "
                "finished; tune again for a complete search"
            )
        case BudgetGivenBack():
            # The step-bound note itself comes before this one, in full.
            ended = (
                "no setting can beat the step (see above)"
                if isinstance(value.ended, StepBound)
                else render(value.ended)
            )
            return (
                f"done in {value.elapsed:.0f} s of the {value.budget:.0f} s budget, the rest "
                f"given back: {ended}, and {render(value.stopped)}"
            )
        case Resumed():
            return (
                f"resumed from storage: {value.count} trials of earlier runs on the same "
                "problem were counted in the choice"
            )
        case _:
            return _not_a_note(value)


def _not_a_note(value: NoReturn) -> NoReturn:
    """Unreachable: mypy checks that :func:`render` has a case for every type."""
    raise TypeError(f"not a note or a reason: {value!r}")
