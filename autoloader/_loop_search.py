"""AutoLoader's search while it is SEARCHING (``NOTE [ AutoLoader's tuning ]``, in
``_loop_tuning.py``), alone or under torchrun, chosen once at the first batch as
DataLoader chooses its single- or multi-process iterator: :class:`SoloSearch` or
:class:`JointSearch`, behind one interface (:class:`Search`). Both ask and tell the run's
:class:`~autoloader._session.RunSession`, the one ``tune()`` drives too; under torchrun
the ranks exchange typed messages (:class:`_NextSegment`, :class:`_Tuned`,
:class:`_Fatal`), as ``tune()``'s joint runner does (``distributed/_joint.py``). The
session is opened by :func:`open_session`, and the search's end said by :func:`tuned_line`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

from autoloader._exceptions import AutoloaderError, BaselineError, StudyInUseError
from autoloader._preserve import preserved
from autoloader._problem import Problem
from autoloader._reuse import study_beside
from autoloader._session import RunSession
from autoloader.distributed import Ranks, job_outcome
from autoloader.loader import Params
from autoloader.measure import (
    MIN_WINDOWS,
    Deadlines,
    LiveTrial,
    Measurement,
    MemoryBudgetExceeded,
    TrialError,
    WindowCallback,
    measurable_batches,
)
from autoloader.results import TuneResult, in_memory_kwargs
from autoloader.search import Completed, Proposal, Pruned, PruneKind, Trial, open_storage

_logger = logging.getLogger("autoloader")

Failure = TrialError | MemoryBudgetExceeded


class Tuning(Protocol):
    """What a search reads and sets of the tuning that drives it (``LoopTuning``)."""

    problem: Problem
    last_good: Params  # what loads a failed trial's batches

    def ask(self, session: RunSession) -> Proposal | None:
        """The session's next trial; ``None`` once the search ended."""

    def record_failure(self, params: Params, error: Failure) -> None:
        """``params`` failed in its trial with ``error``: say so, keep it in the list."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A search trial to run: its setting, hang deadlines, and its end: ``batches``
    (under torchrun) or ``max_seconds`` and the windows' vote (``on_window``)."""

    params: Params
    deadlines: Deadlines | None
    batches: int | None = None
    max_seconds: float | None = None
    on_window: WindowCallback | None = None


class Search(abc.ABC):
    """SEARCHING, alone or under torchrun, chosen once at the first batch: what the next
    trial is, and what a trial's end means. ``session`` is ``None`` on a rank that does
    not drive the study. The tuning calls :meth:`plan` at each trial's start;
    :meth:`keep_pace`, then :meth:`ended` at its end, and :meth:`made_up` once the
    batches it gave back are loaded."""

    memory_share = 1  # the trial's share of the memory budget's bytes: 1 / memory_share

    def __init__(self, session: RunSession | None) -> None:
        self.session = session
        self.pace: float | None = None  # seconds per batch of the last trial

    @property
    def history(self) -> list[Trial]:
        return [] if self.session is None else self.session.history

    def deadlines(self, params: Params) -> Deadlines | None:
        return None if self.session is None else self.session.deadlines(params)

    def keep_pace(self, trial: LiveTrial) -> None:
        """The loop's seconds per batch in ``trial``, the loop's own work between epochs
        left out (``NOTE [ Live trials span epochs ]``): under torchrun, rank 0's sets
        the next trial's length (``NOTE [ Joint segments ]``)."""
        if trial.feed.delivered_count:
            self.pace = (perf_counter() - trial.started) / trial.feed.delivered_count

    @abc.abstractmethod
    def plan(self, tuning: Tuning) -> Plan | TuneResult:
        """The next trial, or the result once the search ended."""

    @abc.abstractmethod
    def ended(
        self,
        tuning: Tuning,
        trial: LiveTrial,
        outcome: Measurement | Failure,
        undelivered: int,
    ) -> int:
        """Record how the search trial ``trial`` ended; the batches to make up."""

    @abc.abstractmethod
    def made_up(self, tuning: Tuning) -> None:
        """The batches a search trial gave back are loaded."""


class SoloSearch(Search):
    """The search alone: each trial the driver's proposal, ended by its time or the
    windows' vote, and told to the study at its end."""

    def __init__(self, session: RunSession | None) -> None:
        super().__init__(session)
        self.proposal: Proposal | None = None  # the trial under way

    def plan(self, tuning: Tuning) -> Plan | TuneResult:
        session = self.session
        assert session is not None
        self.proposal = proposal = tuning.ask(session)
        if proposal is None:
            result = session.conclude()
            session.save(result)
            return result
        spec = proposal.spec
        return Plan(
            spec.params,
            spec.deadlines,
            max_seconds=spec.max_seconds,
            on_window=lambda window, measured: session.vote(spec, window, measured),
        )

    def ended(
        self,
        tuning: Tuning,
        trial: LiveTrial,
        outcome: Measurement | Failure,
        undelivered: int,
    ) -> int:
        session, proposal = self.session, self.proposal
        assert session is not None and proposal is not None
        self.proposal = None
        if isinstance(outcome, Measurement):
            told = session.judge(proposal, outcome, voted=trial.voted)
        else:
            try:
                told = session.judge(proposal, outcome, voted=False)
            except BaselineError:
                trial.feed.epoch.drop_failed()
                # The dataset's own error, which every setting raises: the baseline's
                # rate up to it is the study's. A trial across epochs meets a bad item
                # in each (NOTE [ Live trials span epochs ]): told nothing, a baseline
                # would start again after each, and never end.
                measured = trial.measured()
                if measured.batches:
                    session.tell(proposal, session.judge(proposal, measured, voted=False))
                raise users_error(outcome) from None
            tuning.record_failure(proposal.spec.params, outcome)
        session.tell(proposal, told)
        if isinstance(told, Completed):
            tuning.last_good = proposal.spec.params
        return 0 if isinstance(outcome, Measurement) else undelivered

    def made_up(self, tuning: Tuning) -> None:
        """Nothing waits for them: the trial was told at its end."""

    def not_run(self) -> None:
        """The trial planned last never ran, the loader closed first (``NOTE [
        Overlapped start-up ]``, in ``_loop_overlap.py``): told so, not left running."""
        session, proposal, self.proposal = self.session, self.proposal, None
        if session is not None and proposal is not None:
            reason = "not run: the loader was closed before it started"
            # A lease found another run's as it is told (NOTE [ The study's lease ]):
            # nothing of this run's is left to search.
            with contextlib.suppress(StudyInUseError):
                session.tell(proposal, Pruned(PruneKind.TOO_SHORT, reason))


# NOTE [ Joint segments ]
# Under torchrun every rank switches settings at the same batch: rank 0 proposes each
# trial with a length in batches (its time over rank 0's last pace; the first, the
# baseline, the fewest it is measured in), the same on every rank, which loads exactly that many
# batches in the trial, a failed setting's share by the last good one. A segment
# spans epochs (NOTE [ Live trials span epochs ]): it counts its batches across them,
# so every rank ends it at the same batch whatever the epochs' length, and an epoch's
# end takes no exchange (the ranks' samplers must give them epochs of one length, as
# DistributedSampler does, for their steps to match). At the trial's end the ranks
# gather how it went, and rank 0 tells the study the job's figures: the slowest
# rank's, or the failure, as in tune() (job_outcome). Two exchanges a trial, none
# within one, and none once tuning ended. Both come between the user's steps, where a
# rank may spend minutes alone (evaluating, checkpointing between epochs): they wait
# as long as the job's own collectives (NOTE [ How long a rank waits ]). A segment's
# length is its trial's time over the pace the cost model expects of its setting from
# the baseline (NOTE [ Cost model ], Policy.batch_seconds; rank 0's last pace before
# the baseline is measured), and never shorter than the setting can be measured in: its
# whole start-up burst (a segment's warm-up has no end in time) and MIN_WINDOWS windows
# of a batch from each worker. Sized by the last trial's pace, a setting faster than
# the last one had too few batches and one slower too many: in a Lightning DDP fit of
# 12-batch epochs, after 1 worker's 0.11 s a batch, 4 workers x prefetch 2 were given
# 12 batches, 8 of them their warm-up, and were pruned as too short
# (benchmarks/ddp_short_epochs.py). The baseline, before any pace is known, gets the
# fewest batches it is measured in (MIN_WINDOWS windows of two batches): at 16, it took
# 1.7 s of that fit's 10 s budget at a thirteenth of the chosen setting's rate.


@dataclass(frozen=True, slots=True)
class _NextSegment:
    """Rank 0 to all: load the next ``batches`` batches with ``params``; a failed
    setting's share with ``last_good``."""

    params: Params
    deadlines: Deadlines | None
    batches: int
    last_good: Params


@dataclass(frozen=True, slots=True)
class _Tuned:
    """Rank 0 to all: tuning ended; train with ``result``."""

    result: TuneResult


@dataclass(frozen=True, slots=True)
class _Fatal:
    """Rank 0 to all: the baseline failed, or another run holds the study: raise
    ``error`` on every rank."""

    error: BaseException


@dataclass(slots=True)
class _Segment:
    """The trial under way: its setting, its length in batches, and how it went on this
    rank (``NOTE [ Joint segments ]``)."""

    params: Params
    batches: int
    outcome: Measurement | Failure | None = None


class JointSearch(Search):
    """The search under torchrun: each trial a segment of batches, the same on every
    rank (``NOTE [ Joint segments ]``); rank 0 holds the session."""

    def __init__(self, session: RunSession | None, ranks: Ranks) -> None:
        super().__init__(session)
        self.ranks = ranks
        self.memory_share = ranks.local_world_size  # the node's budget, in equal shares
        self.segment: _Segment | None = None  # the trial under way, until its exchange
        self.proposal: Proposal | None = None  # rank 0: the segment's
        self.fatal: BaseException | None = None  # rank 0: to raise on every rank

    def plan(self, tuning: Tuning) -> Plan | TuneResult:
        """The next trial, decided by rank 0 and the same on every rank; or, once the
        search ended, rank 0's result, on every rank."""
        ranks = self.ranks
        message = self._decide(tuning) if ranks.drives else None
        message = ranks.broadcast(message, during="deciding AutoLoader's next trial")
        if isinstance(message, _Fatal):
            raise message.error
        if isinstance(message, _Tuned):
            result = dataclasses.replace(
                message.result, _in_memory_kwargs=in_memory_kwargs(tuning.problem.fixed)
            )
            ranks.close()
            return result
        assert isinstance(message, _NextSegment)
        tuning.last_good = message.last_good
        self.segment = _Segment(message.params, message.batches)
        return Plan(
            message.params, message.deadlines, batches=message.batches, max_seconds=math.inf
        )

    def _decide(self, tuning: Tuning) -> _NextSegment | _Tuned | _Fatal:
        """Rank 0: what every rank does next."""
        session = self.session
        assert session is not None
        if self.fatal is not None:
            return _Fatal(self.fatal)
        self.proposal = proposal = tuning.ask(session)
        if proposal is None:
            result = session.conclude()
            session.save(result)
            return _Tuned(dataclasses.replace(result, _in_memory_kwargs={}))
        spec = proposal.spec
        expected = session.driver.policy.batch_seconds(spec.params, session.history)
        pace = self.pace if expected is None else expected
        timed = 0 if pace is None else math.ceil(spec.max_seconds / pace)
        batches = max(timed, measurable_batches(spec.params, MIN_WINDOWS))
        return _NextSegment(spec.params, spec.deadlines, batches, tuning.last_good)

    def ended(
        self,
        tuning: Tuning,
        trial: LiveTrial,
        outcome: Measurement | Failure,
        undelivered: int,
    ) -> int:
        segment = self.segment
        assert segment is not None
        segment.outcome = outcome
        if not isinstance(outcome, Measurement):
            tuning.record_failure(segment.params, outcome)
            # The trial's other batches, by the last good setting, before the exchange.
            rest = segment.batches - trial.feed.delivered_count
            if rest > 0:
                return rest
        self._exchange(tuning)
        return 0

    def made_up(self, tuning: Tuning) -> None:
        if self.segment is not None:
            self._exchange(tuning)

    def _exchange(self, tuning: Tuning) -> None:
        """This rank's trial has loaded its batches: gather how it went on every rank;
        rank 0 tells the study the job's outcome (``NOTE [ Joint segments ]``)."""
        segment, ranks = self.segment, self.ranks
        assert segment is not None
        self.segment = None
        everyone = ranks.gather(segment.outcome, during="ending AutoLoader's trial")
        proposal, self.proposal = self.proposal, None
        session = self.session
        if not ranks.drives or proposal is None or session is None:
            return
        happened: Measurement | Failure
        try:
            happened = job_outcome(everyone, ranks.hosts)
        except (TrialError, MemoryBudgetExceeded) as error:
            happened = error
        try:
            told = session.judge(proposal, happened, voted=False)
        except BaselineError:
            assert not isinstance(happened, Measurement)
            self.fatal = users_error(happened)
            return
        try:
            session.tell(proposal, told)
        except StudyInUseError as error:  # the user's own storage: refused on every rank
            self.fatal = error
            return
        if isinstance(told, Completed):
            tuning.last_good = proposal.spec.params


def open_session(
    problem: Problem,
    ranks: Ranks | None,
    *,
    started: float,
    threads: int,
    resumed: Mapping[str, Any] | None,
) -> RunSession:
    """The search's run of ``problem``, its checks passed and its study open: a
    checkpoint's, where one was loaded (``resumed``: its ``started`` then as long before
    as the budget spent); else its study kept beside ``path`` where there is one
    (``NOTE [ An unfinished search kept ]``), an earlier run's unfinished study continued
    (its ``problem`` the one it searches)."""
    given = problem
    beside = None if problem.path is None else study_beside(problem.path)
    if beside is not None and problem.storage is None and resumed is None:
        try:
            problem = dataclasses.replace(problem, storage=open_storage(beside))
        except AutoloaderError as error:
            _logger.warning("AutoLoader: searching in memory, not in %s: %s", beside, error)
    session = RunSession(problem, ranks, started=started, threads=threads)
    if problem is not given:
        session.in_memory_if_taken = beside
    # The checks read items here, which DataLoader would not: whatever they draw from
    # the random generators (torch's global one is the training's, and the sampler's
    # where the loader has no generator) is put back (NOTE [ An AutoLoader's state ]).
    with preserved():
        session.check()
    if resumed is not None:  # the budget spent before the checkpoint, not the checks
        session.started = perf_counter() - float(resumed["seconds"])
    try:
        session.open(None)
    except StudyInUseError as error:
        session.search_in_memory(error)  # the user's own storage: raised, theirs to sort out
    if resumed is not None and resumed["session"] is not None:
        session.resume(resumed["session"])
    return session


def users_error(error: Failure) -> BaseException:
    """What reaches the loop when the baseline fails too: the dataset's own error, as
    DataLoader would raise it; a memory overrun or a hang, said as one."""
    if isinstance(error, TrialError) and not isinstance(error.error, TimeoutError):
        cause = error.error
        if isinstance(cause, BaseException) and type(cause).__name__ != "TrialTimeout":
            return cause
    return BaselineError(
        f"AutoLoader: the batches fail to load even with num_workers=0 in this process "
        f"({error}); this is a fault in the dataset or collate_fn, not in a setting."
    )


def describe_params(params: Mapping[str, Any]) -> str:
    """A setting in a few words: ``4 workers (prefetch 2, persistent), pinned``."""
    workers = int(params.get("num_workers", 0))
    if not workers:
        words = "num_workers=0"
    else:
        kind = "threads" if params.get("worker_kind") == "threads" else "workers"
        extra = [f"prefetch {params.get('prefetch_factor')}"]
        if params.get("persistent_workers"):
            extra.append("persistent")
        if params.get("worker_threads") is not None:
            extra.append(f"{params['worker_threads']} native thread(s) each")
        words = f"{workers} {kind} ({', '.join(extra)})"
    if params.get("batched_fetch"):
        words += ", batched"
    if params.get("pin_memory"):
        words += ", pinned"
    if params.get("step_threads") is not None:
        words += f", step on {params['step_threads']} threads"
    return words


def tuned_line(
    result: TuneResult,
    chosen: Params,
    *,
    resumed: bool,
    reused_from: Path | None,
    started: float | None,
    path: Path | None,
) -> str:
    """The line that says tuning ended with ``chosen``, ``result``'s setting or, where
    ``resumed``, a checkpoint's: read from ``reused_from``, or searched since
    ``started`` and saved at ``path``."""
    if resumed:
        return (
            f"AutoLoader: resuming with {describe_params(chosen)}, tuned before the "
            f"checkpoint ({result.versus_defaults()}); nothing to tune"
        )
    if reused_from is not None:
        return (
            f"AutoLoader: reusing {describe_params(chosen)} from {reused_from}, "
            f"tuned for this problem on this machine ({result.versus_defaults()})"
        )
    assert started is not None
    saved = f"; saved to {path}" if path is not None else ""
    return (
        f"AutoLoader: tuned in {perf_counter() - started:.0f} s of training, "
        f"{len(result.trials)} trials: {describe_params(chosen)}, "
        f"{result.versus_defaults()}{saved}"
    )
