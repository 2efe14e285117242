"""AutoLoader's tuning, driven by the training loop: which setting loads the next batches,
and what each trial's end means (``NOTE [ Tuning in the training loop ]``, in
``_autoloader.py``), as a machine of named stages (``NOTE [ AutoLoader's tuning ]``).

While it searches, alone or under torchrun (chosen once, at the first batch), a
:class:`~autoloader._loop_search.Search` decides each trial (``_loop_search.py``), asking
and telling the run's :class:`~autoloader._session.RunSession`, the one ``tune()``
drives too. Each trial's loader comes from :class:`~autoloader._loop_loaders.Loaders`;
once tuned, :class:`~autoloader._loop_retune.Retuning` watches for drift.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

import torch

from autoloader._drift import DriftWatch
from autoloader._exceptions import AllSettingsFailedError, InvalidInputError
from autoloader._loader_state import checked_tuning, searching_state, tuned_state
from autoloader._loop_loaders import (
    Loaders,
    set_threads,
    show_setting,
    workers_only_where_picklable,
)
from autoloader._loop_overlap import Overlap
from autoloader._loop_retune import Retuning
from autoloader._loop_reuse_check import FirstBatchesCheck, first_batches_check
from autoloader._loop_search import (
    Failure,
    JointSearch,
    Plan,
    Search,
    SoloSearch,
    describe_params,
    open_session,
    tuned_line,
    users_error,
)
from autoloader._loop_stages import Stage
from autoloader._problem import Problem, agree
from autoloader._reuse import reused, study_beside
from autoloader._session import RunSession
from autoloader.checks import world
from autoloader.distributed import Ranks
from autoloader.loader import BASELINE_PARAMS, EpochBatches, Params, normalize_params
from autoloader.loader._torch_compat import exiting
from autoloader.measure import Deadlines, LiveTrial, Measurement, MemoryBudgetExceeded, TrialError
from autoloader.results import TuneResult, in_memory_kwargs
from autoloader.search import Proposal, Trial

_logger = logging.getLogger("autoloader")


class _Loader(Protocol):
    """What the tuning reads and sets of its AutoLoader."""

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    verbose: bool

    def __len__(self) -> int: ...


class LoopTuning:
    """The search of one AutoLoader, driven by the loop (``NOTE [ AutoLoader's tuning ]``):
    :meth:`start_trial` at each trial's first batch, :meth:`trial_ended` at its end.

    Args:
        owner: the AutoLoader, held weakly (``NOTE [ Nothing outlives the loop ]``); its
            copies load through the same tuning (``NOTE [ A rebuilt AutoLoader ]``).
        problem: its arguments, checked.
        problem_of: the problem again, as one rank of a torchrun job.
        threads: the process's torch threads before tuning set them.
        retune: search again where loading drifted once tuned (``NOTE [ Drift ]``).
    """

    def __init__(
        self,
        owner: _Loader,
        problem: Problem,
        problem_of: Callable[[Ranks], Problem],
        *,
        threads: int,
        retune: bool = True,
    ) -> None:
        self._owner = weakref.ref(owner)
        # Every AutoLoader that loads through this tuning: its own and its copies
        # (NOTE [ A rebuilt AutoLoader ]), told the chosen setting; the count of those
        # alive, the kept loader's workers stopped once none is.
        self._views: weakref.WeakSet[Any] = weakref.WeakSet([owner])
        self._alive = 1
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
        # The epoch loading now (an Epoch of _loop_epoch.py, a layer above), this loader's
        # or a copy's (NOTE [ A rebuilt AutoLoader ]).
        self.epoch: weakref.ref[Any] | None = None
        # The trials' loaders, and the chosen setting's, kept across epochs.
        self.loaders = Loaders()
        # Trials of epochs the loop dropped, stopped, and the batches they had not
        # delivered: the study is told at the next epoch (NOTE [ Nothing outlives the loop ]).
        self.abandoned: list[tuple[LiveTrial, int]] = []
        # WAITING: where a checkpoint's state says the tuning stood (NOTE [ An
        # AutoLoader's state ]), taken up at the first batch.
        self.resumed: dict[str, Any] | None = None
        # The trial the last epoch ended in the middle of, for the next epoch to resume
        # (NOTE [ Live trials span epochs ]).
        self.carried: LiveTrial | None = None
        # TUNED with a reused setting: the check of its first batches, until it is done.
        self.check: FirstBatchesCheck | None = None
        # NOTE [ Drift ]: TUNED, the watch of the chosen setting's wait for data, and the
        # searches it starts.
        self.retuning = Retuning(retune=retune)
        # SEARCHING: the next trial, planned and its loader started while the one before
        # it drains (NOTE [ Overlapped start-up ]).
        self.overlap = Overlap(self.loaders)

    @property
    def retune(self) -> bool:
        return self.retuning.retune

    @property
    def drift(self) -> DriftWatch | None:
        return self.retuning.drift

    @property
    def researches(self) -> int:
        return self.retuning.researches

    @property
    def owner(self) -> _Loader:
        """The AutoLoader whose epoch the loop iterates (alive while the loop uses it,
        through its epoch), or, once it is gone, another that loads through this tuning."""
        owner = self._owner()
        if owner is None:
            owner = next(iter(self._views), None)
        assert owner is not None, "an AutoLoader's search outlived it"
        return owner

    def loads(self, owner: _Loader) -> None:
        """``owner``'s epoch starts: it is the loader whose batches the trials load (its
        length, its sampler's order)."""
        self._owner = weakref.ref(owner)

    def share(self, copy: _Loader) -> None:
        """``copy``, a copy of this tuning's AutoLoader (``NOTE [ A rebuilt AutoLoader ]``),
        loads through it from here on: the loader the loop iterates next."""
        self._views.add(copy)
        self._alive += 1
        self.loads(copy)
        if self.chosen is not None:
            show_setting(copy, self.chosen)

    def gone(self) -> None:
        """An AutoLoader of this tuning was collected: the last one stops the kept
        loader's persistent workers (``NOTE [ Nothing outlives the loop ]``)."""
        self._alive -= 1
        if self._alive == 0:
            self.release()

    @property
    def history(self) -> list[Trial]:
        """The search's trials so far (none on a rank that does not drive it)."""
        return [] if self.search is None else self.search.history

    def settle(self) -> None:
        """Tell the study how the trials of epochs the loop dropped went."""
        while self.abandoned:
            trial, undelivered = self.abandoned.pop(0)
            self.trial_ended(trial, undelivered)

    # A trial across epochs (NOTE [ Live trials span epochs ]) ---------------------------

    def carry(self, trial: LiveTrial) -> None:
        """The epoch ended in the middle of ``trial``: it waits for the next one."""
        assert self.carried is None, "one trial at a time"
        self.carried = trial

    def carry_on(self, batches: EpochBatches) -> LiveTrial | None:
        """The trial the last epoch ended in the middle of, now loading ``batches``, the
        next epoch's; ``None`` where there is none."""
        trial, self.carried = self.carried, None
        if trial is not None:
            trial.resume(batches)
        return trial

    def end_carried(self) -> None:
        """The loop is done with the loader: end the trial waiting for the next epoch
        where it stands, and tell the study how it went."""
        trial, self.carried = self.carried, None
        if trial is not None:
            trial.end()
            trial.close()
            self.trial_ended(trial, 0)

    # Starting a trial: the stage's own -------------------------------------------------

    def start_trial(self, batches: EpochBatches, seed: int) -> LiveTrial:
        if self.stage is Stage.WAITING:
            self._begin()
        if self.stage is Stage.SEARCHING:
            trial = self._next_in_search(batches, seed)
            if trial is not None:
                return trial
        if self.stage is Stage.MAKING_UP:
            params = self.last_good
            return self.loaders.trial(
                self.problem,
                params,
                batches,
                seed,
                limit=self.makeup,
                deadlines=self._deadlines(params),
            )
        assert self.stage is Stage.TUNED and self.chosen is not None
        return self._serving(self.chosen, batches, seed)

    def drains(self, trial: LiveTrial, batches: EpochBatches, seed: int) -> None:
        """``trial`` drains: the search's next trial may start now, alone
        (``NOTE [ Overlapped start-up ]``)."""
        if self.stage is Stage.SEARCHING and isinstance(self.search, SoloSearch):
            search, ahead = self.search, lambda plan: self._ahead(plan, batches, seed)
            self.overlap.start(self, search, trial, ahead)

    def _ahead(self, plan: Plan | TuneResult, batches: EpochBatches, seed: int) -> LiveTrial:
        if isinstance(plan, TuneResult):
            return self._serving(normalize_params(plan.params), batches, seed)
        return self._search_trial(plan, batches, seed)

    def _next_in_search(self, batches: EpochBatches, seed: int) -> LiveTrial | None:
        """SEARCHING: the search's next trial, its loader started ahead where the trial
        before it drained (``NOTE [ Overlapped start-up ]``); ``None`` where the search
        ended: TUNED from here."""
        search = self.search
        assert search is not None
        successor = self.overlap.take()
        plan = search.plan(self) if successor is None else successor.plan
        ahead = None if successor is None else successor.trial
        if isinstance(plan, TuneResult):
            self.take(plan, reused_from=None)
            if ahead is not None and ahead.params == self.chosen:
                ahead.on_batch = None if self.drift is None else self.drift.batch
                return ahead
            if ahead is not None:  # another kept (NOTE [ Drift ])
                ahead.close()
                self.loaders.release_kept()
            return None
        self.trial_threads = set_threads(plan.params.get("step_threads"))
        return ahead if ahead is not None else self._search_trial(plan, batches, seed)

    def _search_trial(self, plan: Plan, batches: EpochBatches, seed: int) -> LiveTrial:
        assert self.search is not None
        return self.loaders.trial(
            self.problem,
            plan.params,
            batches,
            seed,
            memory_share=self.search.memory_share,
            limit=plan.batches,
            max_seconds=plan.max_seconds,
            deadlines=plan.deadlines,
            on_window=plan.on_window,
        )

    def _serving(self, params: Params, batches: EpochBatches, seed: int) -> LiveTrial:
        return self.loaders.serve(
            self.problem,
            params,
            batches,
            seed,
            deadlines=self._deadlines(params),
            check=self.check,
            drift=self.drift,
        )

    def _begin(self) -> None:
        """WAITING, at the first batch: the saved result (TUNED), or the checks and the
        search's start (SEARCHING), alone or as one rank of a torchrun job; where a
        checkpoint's state was loaded, the tuning as it stood then."""
        resumed, self.resumed = self.resumed, None
        if resumed is not None and resumed["stage"] == "tuned":
            self._resume_tuned(resumed)
            return
        self.started = perf_counter()
        ranks = Ranks.join()
        if ranks is not None:
            # The machine as this rank's job sees it, and the same problem on every rank.
            self.problem = agree(ranks, self.problem_of(ranks))
        problem = workers_only_where_picklable(self.problem)
        # The epoch the loop iterates: a copy's (NOTE [ A rebuilt AutoLoader ]) may be a
        # rank's share of its original's.
        problem = self.problem = dataclasses.replace(problem, batches_per_epoch=self.epoch_length())
        # A search resumed goes on: a result saved since is not this run's.
        found = reused(problem, ranks) if resumed is None else None
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
            session = self._session(ranks, resumed)
        if resumed is not None:
            self.last_good = normalize_params(resumed["last_good"])
            self.failures = list(resumed["failures"])
        self.search = SoloSearch(session) if ranks is None else JointSearch(session, ranks)
        self.stage = Stage.SEARCHING

    def _session(self, ranks: Ranks | None, resumed: Mapping[str, Any] | None) -> RunSession:
        """The search's run (:func:`~autoloader._loop_search.open_session`), from the
        first batch or a checkpoint's ``resumed`` state; the budget counts from its start."""
        assert self.started is not None, "the first batch starts the run"
        session = open_session(
            self.problem, ranks, started=self.started, threads=self.threads, resumed=resumed
        )
        self.started, self.problem = session.started, session.problem
        return session

    def _resume_tuned(self, state: Mapping[str, Any]) -> None:
        """WAITING, at the first batch, from a checkpoint taken once tuned: TUNED, with
        the result and the setting that loaded the batches then."""
        self.started = perf_counter()
        result = TuneResult.from_dict(state["result"])
        result = dataclasses.replace(result, _in_memory_kwargs=in_memory_kwargs(self.problem.fixed))
        self.last_good = normalize_params(state["last_good"])
        self.failures = list(state["failures"])
        self.take(result, chosen=normalize_params(state["chosen"]))

    # Checkpoints (NOTE [ An AutoLoader's state ]) --------------------------------------

    def state(self) -> dict[str, Any]:
        """Where the tuning stands, in plain values: :meth:`resume` takes it up."""
        if self.stage is Stage.WAITING:
            return {"stage": "waiting"} if self.resumed is None else dict(self.resumed)
        # Making up a failed setting's batches, the stage it came from: the resumed run
        # loads them, its next batches, with that stage's setting.
        stage = self.after_makeup if self.stage is Stage.MAKING_UP else self.stage
        if stage is Stage.TUNED:
            assert self.result is not None and self.chosen is not None
            return tuned_state(self.result, self.chosen, self.last_good, self.failures)
        assert self.search is not None and self.started is not None
        session = self.search.session
        return searching_state(
            perf_counter() - self.started,
            None if session is None else session.checkpoint(),
            self.last_good,
            self.failures,
        )

    def resume(self, state: Mapping[str, Any]) -> None:
        """Take up :meth:`state` of a checkpoint at the first batch.

        Raises:
            InvalidInputError: the tuning has begun, or ``state`` is not a tuning's.
        """
        if self.stage is not Stage.WAITING:
            raise InvalidInputError(
                "AutoLoader.load_state_dict() comes before the loader's first batch, but "
                "this one has started tuning: load the state into a new AutoLoader of the "
                "same arguments."
            )
        self.resumed = checked_tuning(state)

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

    def _deadlines(self, params: Params) -> Deadlines | None:
        """How long a batch may take to load with ``params`` before it counts as hung,
        from the search's baseline; ``None`` (no limit, as DataLoader) with no search
        (settings read from ``path``, or a rank that does not drive it)."""
        return None if self.search is None else self.search.deadlines(params)

    def release(self) -> None:
        """Stop the kept loader's persistent workers and a trial waiting for the next
        epoch (unrecorded: the loader is being collected, or ``close()`` recorded it),
        and give the study's lease back."""
        trial, self.carried = self.carried, None
        if trial is not None:
            trial.end()
            trial.close(kill=exiting())
        self.overlap.drop(kill=exiting())
        if self.overlap.take() is not None and isinstance(self.search, SoloSearch):
            self.search.not_run()  # NOTE [ Overlapped start-up ]
        self._close_session()
        self.loaders.release_kept()

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
        successor = self.overlap.of(trial)
        if successor is not None:  # told as it drained (NOTE [ Overlapped start-up ])
            set_threads(self.trial_threads)
            if failure is not None:  # the setting failed: the successor was dropped
                self.last_good = successor.last_good
                self.record_failure(trial.params, failure)
                self._make_up(undelivered)
            return
        if self.stage is Stage.MAKING_UP:
            if failure is not None:  # the last good setting failed on a failed one's batches
                self._makeup_failed(trial, failure)
                return
            self._made_up()
            return
        if self.stage is Stage.SEARCHING:
            assert self.search is not None
            set_threads(self.trial_threads)
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
        elif trial.drifted:
            self._drifted(undelivered)

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
        self._search_again(undelivered)

    def _drifted(self, undelivered: int) -> None:
        """TUNED, the chosen setting's wait for data drifted (``NOTE [ Drift ]``): a
        search of a share of the budget, in a study of its own, SEARCHING from here."""
        assert self.chosen is not None and self.result is not None
        self.problem = self.retuning.start(self.problem, self.chosen, self.result)
        self.last_good = self.chosen  # it loads well, if slowly: it makes up faults
        self._search_again(undelivered)

    def _search_again(self, undelivered: int) -> None:
        """SEARCHING from here, TUNED no more, as at a first batch with no result."""
        self.loaders.release_kept()
        self.result = self.chosen = None
        self.loaders.choose_threads(None)
        torch.set_num_threads(self.threads)
        self.started = perf_counter()
        self.search = SoloSearch(self._session(None, None))
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
        self.chosen, self.last_good, self.loaders.kept = fallback, BASELINE_PARAMS, None

    # The end of tuning -----------------------------------------------------------------

    def _close_session(self) -> bool:
        """Whether this rank held the search's session (rank 0 under torchrun): closed."""
        session = None if self.search is None else self.search.session
        if session is not None:
            session.close()
        return session is not None

    def take(
        self, result: TuneResult, *, reused_from: Path | None = None, chosen: Params | None = None
    ) -> None:
        """TUNED: train with ``result``'s settings from here on (``chosen``: another, a
        checkpoint's, the chosen one having failed before it), and say so."""
        # Searched here, its lease given back first (another rank's removal came too soon).
        searched = self._close_session() and reused_from is None and chosen is None
        result, self.problem = self.retuning.taken(result, self.problem)
        path = self.problem.path
        if searched and path is not None and path.exists() and not result.partial:
            # NOTE [ An unfinished search kept ]: the result holds every trial now.
            study_beside(path).unlink(missing_ok=True)
        self.stage = Stage.TUNED
        self.result = result
        self.chosen = normalize_params(result.params) if chosen is None else chosen
        threads = result.params.get("step_threads")
        self.loaders.choose_threads(None if threads is None else int(threads))
        for view in list(self._views):
            show_setting(view, self.chosen)
        owner = self.owner
        line = tuned_line(
            result,
            self.chosen,
            resumed=chosen is not None,
            reused_from=reused_from,
            started=self.started,
            path=self.problem.path,
        )
        _logger.info("%s", line)
        if owner.verbose and world()[0] == 0:
            print(line, file=sys.stderr, flush=True)


def _consumed(trial: LiveTrial, error: Failure) -> Failure:
    """``error``, where the baseline raised it: the batch that raised it consumed, as
    DataLoader consumes it, the loop going on with the next."""
    trial.feed.epoch.drop_failed()
    return error
