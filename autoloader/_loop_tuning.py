"""AutoLoader's tuning, driven by the training loop: which setting loads the next batches,
and what each trial's end means (``NOTE [ Tuning in the training loop ]``, in
``_autoloader.py``), as a machine of named stages (``NOTE [ AutoLoader's tuning ]``).

While it searches, alone or under torchrun (chosen once, at the first batch), a
:class:`~autoloader._loop_search.Search` decides each trial (``_loop_search.py``), asking
and telling the run's :class:`~autoloader._session.RunSession`, the one ``tune()``
drives too.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from autoloader._exceptions import AllSettingsFailedError, AutoloaderError, StudyInUseError
from autoloader._loop_search import (
    Failure,
    JointSearch,
    Search,
    SoloSearch,
    describe_params,
    users_error,
)
from autoloader._preserve import preserved
from autoloader._problem import Problem, agree, workers_unpicklable
from autoloader._reuse import reused, study_beside
from autoloader._reuse_check import FirstBatchesCheck, first_batches_check
from autoloader._session import RunSession
from autoloader.checks import world
from autoloader.distributed import Ranks
from autoloader.loader import (
    BASELINE_PARAMS,
    EpochBatches,
    Feed,
    Params,
    dataloader_kwargs,
    merge_loader_kwargs,
    new_loader,
    normalize_params,
    set_step_threads,
)
from autoloader.measure import (
    Deadlines,
    LiveTrial,
    Measurement,
    MemoryBudgetExceeded,
    TrialError,
    WindowCallback,
    release,
)
from autoloader.results import TuneResult
from autoloader.search import Proposal, Trial, open_storage

_logger = logging.getLogger("autoloader")


class _Loader(Protocol):
    """What the tuning reads and sets of its AutoLoader."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    verbose: bool

    def __len__(self) -> int: ...


# NOTE [ AutoLoader's tuning ]
# The tuning is in one of four stages (Stage) and moves only where a trial starts or
# ends; each trial started is its stage's:
#
#              first batch                   the search ends (alone: the policy stops;
#   WAITING ─────────────────► SEARCHING ──── under torchrun: rank 0 says so) ───► TUNED
#      │                         │   ▲                                             │   ▲
#      │   a trial fails, giving │   │ those batches loaded            the chosen  │   │ those
#      │   batches back, or the  │   │ (under torchrun, then           setting     │   │ batches
#      │   epoch's tail is short ▼   │ the trial's exchange)           fails       ▼   │ loaded
#      │                       MAKING_UP                                         MAKING_UP
#      │
#      └─── first batch: a saved result of this problem (_reuse.py) ───────────────► TUNED
#                                                                                   │
#          SEARCHING ◄─── its first batches timed outside its band (_reuse_check.py) ┘
#
# - WAITING: nothing measured yet; the first batch starts the run (Ranks.join, the
#   saved result, the checks before the search, the study).
# - SEARCHING: each trial is the search's (_loop_search.py, chosen here once): alone,
#   the driver's proposal, ended by its time or its windows' vote; under torchrun,
#   rank 0's proposal as a segment of batches, the same on every rank (NOTE [ Joint
#   segments ]).
# - MAKING_UP: the last good setting (the last that completed; the baseline at first)
#   loads, unmeasured, the batches a failed setting gave back (under torchrun, the rest
#   of its segment) or an epoch's tail too short for a trial (NOTE [ An epoch's tail ]);
#   then the stage it came from goes on. Where the last good setting fails there too,
#   the baseline takes its place (MAKING_UP again); where the baseline fails, the error
#   is the dataset's and reaches the loop, as DataLoader would raise it.
# - TUNED: the chosen setting loads every batch, its loader kept across epochs where
#   its workers persist. Where it fails, the last good other setting is chosen, the
#   baseline making up the batches it gave back. A setting reused from a file has its
#   first batches timed (NOTE [ A reused setting checked ]): outside their band, the
#   search starts from there, as at a first batch with no file.


class Stage(enum.Enum):
    """Where AutoLoader's tuning stands (``NOTE [ AutoLoader's tuning ]``)."""

    WAITING = "waiting for the first batch"
    SEARCHING = "searching"
    MAKING_UP = "the last good setting loads batches given back"
    TUNED = "tuned"


class LoopTuning:
    """The search of one AutoLoader, driven by the loop (``NOTE [ AutoLoader's tuning ]``):
    :meth:`start_trial` at each trial's first batch, :meth:`trial_ended` at its end.

    Args:
        owner: the AutoLoader, held weakly (``NOTE [ Nothing outlives the loop ]``).
        problem: its arguments, checked.
        problem_of: the problem again, as one rank of a torchrun job.
        threads: the process's torch threads before tuning set them.
    """

    def __init__(
        self,
        owner: _Loader,
        problem: Problem,
        problem_of: Callable[[Ranks], Problem],
        *,
        threads: int,
    ) -> None:
        self._owner = weakref.ref(owner)
        self.problem = problem
        self.problem_of = problem_of
        self.threads = threads
        self.stage = Stage.WAITING
        self.search: Search | None = None  # chosen at the first batch
        self.started: float | None = None
        self.last_good: Params = BASELINE_PARAMS  # what loads a failed trial's batches
        self.makeup = 0  # MAKING_UP: batches for last_good to load
        self.after_makeup = Stage.SEARCHING  # and the stage that goes on then
        self.trial_threads: int | None = None  # the threads before a trial set them
        self.result: TuneResult | None = None  # TUNED: the result, and its setting
        self.chosen: Params | None = None
        self.failures: list[str] = []
        # The chosen setting's loader, kept across epochs where its workers persist.
        self.kept: tuple[DataLoader[Any], Feed] | None = None
        # Trials of epochs the loop dropped, stopped, and the batches they had not
        # delivered: the study is told at the next epoch (NOTE [ Nothing outlives the loop ]).
        self.abandoned: list[tuple[LiveTrial, int]] = []
        # TUNED with a reused setting: the check of its first batches, until it is done.
        self.check: FirstBatchesCheck | None = None

    @property
    def owner(self) -> _Loader:
        """The AutoLoader: alive while the loop uses it, through its epoch."""
        owner = self._owner()
        assert owner is not None, "an AutoLoader's search outlived it"
        return owner

    @property
    def history(self) -> list[Trial]:
        """The search's trials so far (none on a rank that does not drive it)."""
        return [] if self.search is None else self.search.history

    def settle(self) -> None:
        """Tell the study how the trials of epochs the loop dropped went."""
        while self.abandoned:
            trial, undelivered = self.abandoned.pop(0)
            self.trial_ended(trial, undelivered)

    # Starting a trial: the stage's own -------------------------------------------------

    def start_trial(self, batches: EpochBatches, seed: int) -> LiveTrial:
        if self.stage is Stage.WAITING:
            self._begin()
        if self.stage is Stage.SEARCHING:
            search = self.search
            assert search is not None
            if search.too_few_left(self, batches):
                # NOTE [ An epoch's tail ]: the last good setting loads it, unmeasured.
                self._make_up(len(self.owner) - batches.taken)
            else:
                plan = search.plan(self)
                if isinstance(plan, TuneResult):
                    self.take(plan, reused_from=None)
                else:
                    self.trial_threads = _set_threads(plan.params.get("step_threads"))
                    return self._trial(
                        plan.params,
                        batches,
                        seed,
                        limit=plan.batches,
                        max_seconds=plan.max_seconds,
                        deadlines=plan.deadlines,
                        on_window=plan.on_window,
                    )
        if self.stage is Stage.MAKING_UP:
            params = self.last_good
            return self._trial(
                params, batches, seed, limit=self.makeup, deadlines=self._deadlines(params)
            )
        assert self.stage is Stage.TUNED and self.chosen is not None
        return self._serve(self.chosen, batches, seed)

    def _begin(self) -> None:
        """WAITING, at the first batch: the saved result (TUNED), or the checks and the
        search's start (SEARCHING), alone or as one rank of a torchrun job."""
        self.started = perf_counter()
        ranks = Ranks.join()
        if ranks is not None:
            # The machine as this rank's job sees it, and the same problem on every rank.
            self.problem = agree(ranks, self.problem_of(ranks))
        problem = self.problem = _workers_only_where_picklable(self.problem)
        found = reused(problem, ranks)
        if found is not None:
            if ranks is not None:
                ranks.close()
            self.take(found, reused_from=problem.path)
            if ranks is None:  # NOTE [ A reused setting checked ]: unchecked under torchrun
                assert problem.path is not None
                self.check = first_batches_check(found, problem.path)
            return
        session = None
        if ranks is None or ranks.drives:  # rank 0 runs the checks and the search
            session = self._session(ranks)
        self.search = SoloSearch(session) if ranks is None else JointSearch(session, ranks)
        self.stage = Stage.SEARCHING

    def _session(self, ranks: Ranks | None) -> RunSession:
        """The search's run, its study kept beside ``path`` where there is one (``NOTE [
        An unfinished search kept ]``): an earlier run's unfinished study continued."""
        problem, started = self.problem, self.started
        assert started is not None, "the first batch starts the run"
        beside = None if problem.path is None else study_beside(problem.path)
        if beside is not None and problem.storage is None:
            try:
                problem = dataclasses.replace(problem, storage=open_storage(beside))
            except AutoloaderError as error:
                _logger.warning("AutoLoader: searching in memory, not in %s: %s", beside, error)
        session = RunSession(problem, ranks, started=started, threads=self.threads)
        # The checks load batches with loaders of their own, seeded from torch's
        # generator: the loop's sampler and workers draw from it as DataLoader's would.
        with preserved():
            session.check()
        try:
            session.open(None)
        except StudyInUseError as error:
            if problem is self.problem:
                raise  # the user's own storage: theirs to sort out
            _logger.warning("AutoLoader: searching in memory, not in %s: %s", beside, error)
            session.problem = dataclasses.replace(problem, storage=None)
            session.open(None)
        self.problem = session.problem
        return session

    def epoch_length(self) -> int | None:
        """Batches in an epoch of the AutoLoader, ``None`` where its sampler has no length."""
        try:
            return len(self.owner)
        except TypeError:
            return None

    def ask(self, session: RunSession) -> Proposal | None:
        """The search's next trial; ``None`` once it ended, where every setting with
        workers failed too (the baseline is left: it completed)."""
        try:
            return session.ask()
        except AllSettingsFailedError as error:
            self.failures.append(str(error))
            _logger.warning("AutoLoader: %s", error)
            return None

    def _trial(
        self,
        params: Params,
        batches: EpochBatches,
        seed: int,
        *,
        limit: int | None = None,
        max_seconds: float | None = None,
        deadlines: Deadlines | None = None,
        on_window: WindowCallback | None = None,
    ) -> LiveTrial:
        feed = Feed(batches, limit=limit)
        share = 1 if self.search is None else self.search.memory_share
        return LiveTrial(
            self._loader(params, feed, seed),
            feed,
            params,
            batch_size=self.problem.batch_size,
            memory_budget=self.problem.memory_bytes // share if max_seconds is not None else None,
            max_seconds=max_seconds,
            deadlines=deadlines,
            on_window=on_window,
        )

    def _serve(self, params: Params, batches: EpochBatches, seed: int) -> LiveTrial:
        """TUNED: the chosen setting, for the rest of training: one loader kept across
        epochs where its workers persist."""
        persistent = bool(params.get("persistent_workers"))
        if persistent and self.kept is not None:
            loader, feed = self.kept
            feed.point_at(batches)
        else:
            feed = Feed(batches)
            loader = self._loader(params, feed, seed)
            if persistent:
                self.kept = (loader, feed)
        check = self.check  # a reused setting's first batches are timed
        return LiveTrial(
            loader,
            feed,
            params,
            batch_size=self.problem.batch_size,
            memory_budget=None,
            max_seconds=None if check is None else math.inf,
            deadlines=self._deadlines(params),
            on_window=None if check is None else check.on_window,
            keep_workers=persistent,
        )

    def _deadlines(self, params: Params) -> Deadlines | None:
        """How long a batch may take to load with ``params`` before it counts as hung,
        from the search's baseline; ``None`` (no limit, as DataLoader) with no search
        (settings read from ``path``, or a rank that does not drive it)."""
        return None if self.search is None else self.search.deadlines(params)

    def _loader(self, params: Params, feed: Feed, seed: int) -> DataLoader[Any]:
        """A loader of ``params`` over the batches ``feed`` hands it, its workers seeded
        from the epoch's base seed."""
        options = merge_loader_kwargs(
            {**params, "batched_fetch": False},
            batch_size=self.problem.batch_size,
            fixed=self.problem.fixed,
        )
        kwargs = dataloader_kwargs(self.problem.dataset, options)
        for name in ("batch_size", "shuffle", "sampler", "drop_last"):
            kwargs.pop(name, None)
        kwargs["generator"] = torch.Generator().manual_seed(seed)
        if kwargs["num_workers"] == 0:
            kwargs["timeout"] = 0  # DataLoader takes a timeout with workers only
        if params.get("batched_fetch"):  # NOTE [ Batched fetch ]: each index a batch's
            kwargs.pop("collate_fn", None)
            kwargs.update(batch_size=None, sampler=feed)
        else:
            kwargs["batch_sampler"] = feed
        return new_loader(
            self.problem.dataset, kwargs, threads=params.get("worker_kind") == "threads"
        )

    def release(self) -> None:
        """Stop the kept loader's persistent workers, and give the study's lease back."""
        self._close_session()
        if self.kept is not None:
            loader, _ = self.kept
            self.kept = None
            release(loader)

    # Ending a trial: the stage's own ---------------------------------------------------

    def trial_ended(self, trial: LiveTrial, undelivered: int) -> None:
        """Record how ``trial``, the stage's, ended; after a fault, its ``undelivered``
        batches are made up next by the last setting that completed (under torchrun,
        the rest of the trial's batches: ``NOTE [ Joint segments ]``).

        Raises:
            The dataset's own error, where the baseline raises it too.
        """
        outcome = trial.outcome
        assert outcome is not None, "a trial ends with its outcome"
        failure = outcome if isinstance(outcome, (TrialError, MemoryBudgetExceeded)) else None
        if self.stage is Stage.MAKING_UP:
            if failure is not None:  # the last good setting failed on a failed one's batches
                self._makeup_failed(trial, failure)
                return
            self._made_up()
            return
        if self.stage is Stage.SEARCHING:
            assert self.search is not None
            _set_threads(self.trial_threads)
            self.search.keep_pace(trial)
            self._make_up(self.search.ended(self, trial, outcome, undelivered))
            return
        assert self.stage is Stage.TUNED
        if failure is not None:
            self.check = None
            self._chosen_failed(trial, failure)
            self._make_up(undelivered)
        elif self.check is not None and isinstance(outcome, Measurement):
            self._checked(self.check.verdict(outcome), undelivered)

    def _checked(self, holds: bool | None, undelivered: int) -> None:
        """TUNED, a reused setting's first batches timed (``NOTE [ A reused setting
        checked ]``): it holds (its result noting the check), or it is tuned again,
        SEARCHING from here as at a first batch with no result to reuse."""
        check = self.check
        if holds is None or check is None:
            return
        self.check = None
        if holds:
            self.result = check.noted()
            return
        if self.kept is not None:
            loader, _ = self.kept
            self.kept = None
            release(loader)
        self.result = self.chosen = None
        torch.set_num_threads(self.threads)
        self.started = perf_counter()
        self.search = SoloSearch(self._session(None))
        self.stage = Stage.SEARCHING
        self._make_up(undelivered)

    def _make_up(self, batches: int) -> None:
        """MAKING_UP ``batches`` with the last good setting (none: the stage goes on)."""
        if batches > 0:
            self.makeup, self.after_makeup, self.stage = batches, self.stage, Stage.MAKING_UP

    def record_failure(self, params: Params, error: Failure) -> None:
        self.failures.append(f"{describe_params(params)}: {error}")
        _logger.warning(
            "AutoLoader: the setting %s failed (%s); its batches are loaded again by %s, "
            "and tuning goes on",
            describe_params(params),
            error,
            describe_params(self.last_good),
        )

    def _made_up(self) -> None:
        """The batches to make up are loaded: the stage they came from goes on."""
        self.makeup, self.stage = 0, self.after_makeup
        if self.stage is Stage.SEARCHING:
            assert self.search is not None
            self.search.made_up(self)

    def _makeup_failed(self, trial: LiveTrial, error: Failure) -> None:
        """The last good setting failed too on a failed setting's batches: the baseline
        loads them, or, where the baseline failed, the error is the dataset's: it
        reaches the loop, its batch consumed, and the baseline loads the rest of them
        if the loop goes on."""
        params = trial.params
        if params == BASELINE_PARAMS:
            self.makeup -= trial.feed.delivered_count + 1
            if self.makeup <= 0:
                self._made_up()
            raise users_error(_consumed(trial, error))
        self.failures.append(
            f"{describe_params(params)} (loading a failed setting's batches): {error}"
        )
        self.last_good = BASELINE_PARAMS

    def _chosen_failed(self, trial: LiveTrial, error: Failure) -> None:
        """The chosen setting failed in training: the last good other setting, or the
        baseline, loads the rest; where the baseline failed, the error is the dataset's
        (its batch consumed)."""
        params = trial.params
        if params == BASELINE_PARAMS:
            raise users_error(_consumed(trial, error))
        self.failures.append(f"{describe_params(params)} (chosen, in training): {error}")
        fallback = self.last_good if self.last_good != params else BASELINE_PARAMS
        _logger.warning(
            "AutoLoader: the chosen setting %s failed in training (%s); %s loads the rest",
            describe_params(params),
            error,
            describe_params(fallback),
        )
        self.chosen, self.last_good, self.kept = fallback, BASELINE_PARAMS, None

    # The end of tuning -----------------------------------------------------------------

    def _close_session(self) -> None:
        session = None if self.search is None else self.search.session
        if session is not None:
            session.close()

    def take(self, result: TuneResult, *, reused_from: Path | None) -> None:
        """TUNED: train with ``result``'s settings from here on, and say so."""
        self._close_session()
        path = self.problem.path
        if reused_from is None and path is not None and path.exists() and not result.partial:
            # NOTE [ An unfinished search kept ]: the result holds every trial now.
            study_beside(path).unlink(missing_ok=True)
        self.stage = Stage.TUNED
        self.result = result
        self.chosen = normalize_params(result.params)
        threads = result.params.get("step_threads")
        if threads is not None:
            torch.set_num_threads(int(threads))
        owner = self.owner
        owner.num_workers = int(self.chosen["num_workers"])
        owner.prefetch_factor = self.chosen["prefetch_factor"]
        owner.pin_memory = bool(self.chosen["pin_memory"])
        if reused_from is not None:
            line = (
                f"AutoLoader: reusing {describe_params(self.chosen)} from {reused_from}, "
                f"tuned for this problem on this machine ({result.speedup:.2f}x the "
                "defaults)"
            )
        else:
            assert self.started is not None
            saved = f"; saved to {self.problem.path}" if self.problem.path is not None else ""
            line = (
                f"AutoLoader: tuned in {perf_counter() - self.started:.0f} s of training, "
                f"{len(result.trials)} trials: {describe_params(self.chosen)}, "
                f"{result.speedup:.2f}x the defaults{saved}"
            )
        _logger.info("%s", line)
        if owner.verbose and world()[0] == 0:
            print(line, file=sys.stderr, flush=True)


def _workers_only_where_picklable(problem: Problem) -> Problem:
    """``problem``, searched without workers where they could not be sent what they
    load (under spawn or forkserver): the loop goes on as DataLoader's would with
    ``num_workers=0``, which sends nothing, where a worker would fail."""
    why = workers_unpicklable(problem)
    if why is None or problem.space.num_workers == (0, 0):
        return problem
    _logger.warning("AutoLoader: tuning without workers: %s", why)
    return dataclasses.replace(problem, space=dataclasses.replace(problem.space, num_workers=0))


def _consumed(trial: LiveTrial, error: Failure) -> Failure:
    """``error``, where the baseline raised it: the batch that raised it consumed, as
    DataLoader consumes it, the loop going on with the next."""
    trial.feed.epoch.drop_failed()
    return error


def _set_threads(threads: int | None) -> int | None:
    """Set this process's torch threads to ``threads`` (``None``: leave them); the count
    they had, to put back, or ``None``."""
    return None if threads is None else set_step_threads(threads)
