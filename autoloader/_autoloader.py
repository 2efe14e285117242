"""``AutoLoader``: a DataLoader that tunes its own settings in the first minutes of the
real training run.

NOTE [ Tuning in the training loop ]
``tune()`` measures settings in a run of its own before training. ``AutoLoader`` runs
the same search (the same :class:`~autoloader.search.Policy`, asked and told through the
same :class:`~autoloader.search.Driver` and Optuna study) inside the training loop: the
epoch's batches are loaded by one setting after another, each a trial, and a trial's
rate is the loop's own, the time between two of its ``next()`` calls being the real
step on the real device (:class:`~autoloader.measure._live.LiveTrial`).

- **The same batches.** Each epoch draws from the user's generator, and its sampler,
  exactly what ``DataLoader`` draws (the workers' base seed, then the sampler's order),
  and the trials' loaders take turns at that epoch's batches (``NOTE [ Every batch
  once ]``): the loop gets DataLoader's batches in DataLoader's order, whatever the
  switches. The trials' loaders seed their workers from that base seed, through a
  generator of their own: a worker's random augmentation differs from DataLoader's, as
  it does between any two worker counts.
- **Faults stay out of the loop.** A trial that crashes, hangs or passes the memory
  budget is stopped; the batches it had not delivered are loaded again by the last
  setting that completed, and the failure is recorded as in ``tune()``. Only an error
  that the baseline (``num_workers=0``, in this process) raises too reaches the loop,
  as DataLoader would raise it.
- **The end.** Once the policy stops, the chosen setting loads the rest of training
  (its workers persistent across epochs where it chose so), the process keeps the
  tuned ``step_threads``, and the result is saved at ``path`` with its problem's
  identity: a later run of the same problem on the same machine reads it and tunes
  nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from autoloader._exceptions import AllSettingsFailedError, BaselineError, InvalidInputError
from autoloader._problem import Problem, agree, check_arguments
from autoloader._reuse import reused
from autoloader._tune import (
    check_before_search,
    notes_of,
    open_study,
    policy_of,
    result_of,
    save_result,
)
from autoloader.checks._environment import world
from autoloader.distributed._joint import job_outcome
from autoloader.distributed._ranks import Ranks
from autoloader.loader._factory import dataloader_kwargs, merge_loader_kwargs, new_loader
from autoloader.loader._feed import EpochBatches, Feed
from autoloader.loader._params import BASELINE_PARAMS, Params, normalize_params
from autoloader.loader._step_threads import set_step_threads
from autoloader.loader._torch_compat import exiting
from autoloader.measure._deadlines import Deadlines
from autoloader.measure._errors import TrialError
from autoloader.measure._live import LiveTrial, TrialEnded, release
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.results._record import TrialRecord, record_of
from autoloader.results._report import describe, report
from autoloader.results._result import TuneResult, in_memory_kwargs
from autoloader.search import Completed, Driver, Policy, Proposal
from autoloader.search._driver import quiet_optuna
from autoloader.search._objective import trial_seconds
from autoloader.search._space import SearchSpace

_logger = logging.getLogger("autoloader")

_T_co = TypeVar("_T_co", covariant=True)

# DataLoader's arguments that AutoLoader chooses, with the value that leaves them to it.
_TUNED_ARGUMENTS = {
    "num_workers": 0,
    "prefetch_factor": None,
    "persistent_workers": False,
    "pin_memory": False,
}


class TrainingLoop:
    """What stands for the step in an AutoLoader's problem: the user's own loop, named
    by the script that runs it (a result file is reused by the same script only)."""

    def __init__(self) -> None:
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        self.__qualname__ = f"training loop of {Path(script).name if script else 'an interpreter'}"

    def __call__(self, batch: Any) -> None:
        raise NotImplementedError("the training loop is the user's own")  # never called


class AutoLoader(DataLoader[_T_co]):
    """A ``DataLoader`` that finds its fastest safe settings while training runs.

    Takes DataLoader's arguments and is used as one (``for batch in loader``), but
    chooses ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and
    ``pin_memory`` itself (see ``NOTE [ Tuning in the training loop ]``): the first
    ``time_budget`` seconds of training load the batches with one setting after another,
    proposed by the same search as :func:`autoloader.tune`, measured by the loop's own
    pace; then the best loads the rest. Every epoch yields exactly the batches, in the
    order, that ``DataLoader`` with the same arguments and generator yields.

    Args:
        dataset, batch_size, shuffle, sampler, collate_fn, drop_last, timeout,
            worker_init_fn, multiprocessing_context, generator, pin_memory_device: as
            DataLoader's, kept in every setting.
        path (str or path, optional): a JSON file that keeps the tuned settings. A run
            that finds there the result of the same problem (dataset type and length,
            batch size, search space, loader options, device, the training script) on
            this machine starts with it and tunes nothing; otherwise it tunes and saves
            the result there, saying why it could not reuse it. (default: ``None``)
        time_budget (float, optional): seconds of training the search may take, from the
            first batch; ``None`` means 60. (default: ``None``)
        n_trials, memory_budget, search_space, seed: as :func:`autoloader.tune`'s.
        device (str or torch.device, optional): the device the loop moves batches to;
            it tells the search whether ``pin_memory`` can help and whether the step
            trains on the CPU (then the process's torch threads are searched too).
            AutoLoader does not move batches. (default: ``None``)
        verbose (bool, optional): print one line to stderr when tuning ends, with what
            it chose. It is logged (``autoloader`` logger, INFO) either way.
            (default: ``True``)

    Attributes:
        result (TuneResult or None): the tuned settings, every trial and the notes, once
            tuning ended (or was read from ``path``).

    Raises:
        InvalidInputError: before any work, for an argument that is wrong, a tuned
            argument given (``num_workers=4``: pass a search space instead), a
            ``batch_sampler``, ``batch_size=None``, ``in_order=False`` or an
            ``IterableDataset``.
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        path: str | os.PathLike[str] | None = None,
        time_budget: float | None = None,
        n_trials: int | None = None,
        memory_budget: int | str | None = None,
        search_space: SearchSpace | Mapping[str, Any] | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        verbose: bool = True,
    ) -> None:
        given = {
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
            "pin_memory": pin_memory,
        }
        _check_supported(dataset, batch_size, batch_sampler, in_order, given)
        fixed: dict[str, Any] = {
            name: value
            for name, value, default in (
                ("shuffle", shuffle, None),
                ("sampler", sampler, None),
                ("collate_fn", collate_fn, None),
                ("drop_last", drop_last, False),
                ("timeout", timeout, 0),
                ("worker_init_fn", worker_init_fn, None),
                ("multiprocessing_context", multiprocessing_context, None),
                ("generator", generator, None),
                ("pin_memory_device", pin_memory_device, ""),
            )
            if value is not default and value != default
        }
        assert isinstance(batch_size, int)
        arguments: dict[str, Any] = {
            "batch_size": batch_size,
            "time_budget": time_budget,
            "n_trials": n_trials,
            "memory_budget": memory_budget,
            "search_space": search_space,
            "loader_kwargs": fixed,
            "device": device,
            "seed": seed,
            "storage": None,
            "show_progress": False,
            "isolation": "in-process",
            "restore": None,
            "path": path,
        }
        step = TrainingLoop()
        problem = check_arguments(None, dataset, step, **arguments)
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            generator=generator,
            pin_memory_device=pin_memory_device,
        )
        self.path = problem.path
        self.time_budget = problem.budget
        self.n_trials = n_trials
        self.memory_budget = memory_budget
        self.search_space = search_space
        self.device = device
        self.seed = seed
        self.verbose = verbose
        self._context = multiprocessing_context
        self._tuning = _Tuning(
            self, problem, lambda ranks: check_arguments(ranks, dataset, step, **arguments)
        )
        # NOTE [ Nothing outlives the loop ]: the epoch under way, held by the loop alone.
        self._epoch: weakref.ref[_Epoch] | None = None
        weakref.finalize(self, self._tuning.release)

    @property
    def result(self) -> TuneResult | None:
        return self._tuning.result

    @property
    def tuned(self) -> bool:
        """Whether the settings are chosen (tuning ended, or was read from ``path``)."""
        return self._tuning.result is not None

    @property
    def history(self) -> list[TrialRecord]:
        """Every trial so far, as :attr:`TuneResult.trials` records them."""
        if self._tuning.result is not None:
            return list(self._tuning.result.trials)
        driver = self._tuning.driver
        return [] if driver is None else [record_of(trial) for trial in driver.history]

    @property
    def setting(self) -> Params | None:
        """The setting loading the current epoch's batches now (a trial's, while it
        tunes), ``None`` between epochs."""
        epoch = self._current_epoch()
        trial = None if epoch is None else epoch.trial
        return None if trial is None else dict(trial.params)

    @property
    def failures(self) -> list[str]:
        """What went wrong in a setting and was kept from the loop, in order."""
        return list(self._tuning.failures)

    def report(self) -> str:
        """The tuning run's report (:func:`autoloader.report`), or where it stands."""
        if self._tuning.result is not None:
            return report(self._tuning.result)
        return (
            f"AutoLoader: tuning, {len(self.history)} trials so far; the report comes once it ends."
        )

    def close(self) -> None:
        """Stop the workers now: those of an epoch left unfinished, and the chosen
        setting's persistent ones (a later epoch starts new ones). An epoch the loop
        dropped, the loader's garbage collection and the interpreter's exit stop them
        too (``NOTE [ Nothing outlives the loop ]``)."""
        epoch, self._epoch = self._current_epoch(), None
        with contextlib.ExitStack() as stack:
            stack.callback(self._tuning.release)
            if epoch is not None:
                stack.callback(epoch.close)
            self._tuning.settle()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._tuning.settle()
        previous = self._current_epoch()
        if previous is not None:
            previous.close()  # the loop left the last epoch before its end
        # What DataLoader's iterator draws, in its order: the sampler's iterator, then
        # the base seed of the workers, from the user's generator.
        indices = iter(self._index_sampler)
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        epoch = _Epoch(self, EpochBatches(indices), seed)
        self._epoch = weakref.ref(epoch)
        return epoch

    def _current_epoch(self) -> _Epoch | None:
        return None if self._epoch is None else self._epoch()


def _check_supported(
    dataset: object,
    batch_size: int | None,
    batch_sampler: object,
    in_order: bool,
    given: Mapping[str, Any],
) -> None:
    """:class:`InvalidInputError` for what AutoLoader does not take."""
    for name, value in given.items():
        if value != _TUNED_ARGUMENTS[name]:
            raise InvalidInputError(
                f"AutoLoader chooses {name} itself, but got {name}={value!r}. Remove it; to "
                f"search only some values pass search_space={{{name!r}: ...}}, or use a "
                "DataLoader with your own setting."
            )
    if isinstance(dataset, IterableDataset):
        raise InvalidInputError(
            "AutoLoader loads map-style datasets: it hands each setting the epoch's "
            "batches of indices, which an IterableDataset does not have. Use "
            "autoloader.tune() and result.make_loader() for it."
        )
    if batch_sampler is not None:
        raise InvalidInputError(
            "AutoLoader takes batch_size and a per-item sampler, not a batch_sampler."
        )
    if batch_size is None:
        raise InvalidInputError(
            "AutoLoader needs a batch_size: it times the loop in samples per second of "
            "batches (batch_size=None, items one at a time, is not supported)."
        )
    if in_order is not True:
        raise InvalidInputError(
            "AutoLoader delivers batches in the sampler's order (in_order=True): out of "
            "order, a setting that fails could not say which batches it had delivered."
        )


# NOTE [ Nothing outlives the loop ]
# A trial holds a thread (the memory watch), the SIGCHLD and SIGALRM handlers, and its
# loader's workers. Left running after the loop stopped using them, the watch would
# kill processes of the user's long after (it acts only on the trial's workers, but a
# stale trial is nobody's to judge). So the loop alone holds the epoch: the loader keeps
# a weak reference to it, and the epoch holds the loader. When the loop drops it (a
# ``break``, an exception, Ctrl-C), its finalizer ends the trial under way where it
# stands and stops all it holds (``LiveTrial.close``), at once in CPython; the study is
# told how the trial went at the loader's next epoch or ``close()``, in the loop's own
# code, not in a finalizer (under torchrun that takes a collective). The search holds
# the loader by a weak reference too, so a loader nobody holds is collected at once,
# and its finalizer stops the chosen setting's persistent workers. Both finalizers run
# at the interpreter's exit too, where the workers are killed: DataLoader's own
# shutdown does nothing then. A finalizer the garbage collector runs in another thread
# stops the threads and the workers; the handlers, which only the main thread can
# set, are put back by the next trial there (``NOTE [ Handlers put back ]``).


@dataclass(slots=True)
class _Current:
    """The trial under way in an epoch: what its finalizer stops."""

    trial: LiveTrial | None = None


class _Epoch(Iterator[Any]):
    """One pass over an AutoLoader: each batch from the trial under way, the next trial
    started where one ends."""

    def __init__(self, owner: AutoLoader[Any], batches: EpochBatches, seed: int) -> None:
        self.owner = owner  # NOTE [ Nothing outlives the loop ]
        self.tuning = owner._tuning
        self.batches = batches
        self.seed = seed
        self.current = _Current()
        self.done = False
        weakref.finalize(self, _abandon, self.tuning, self.current)

    @property
    def trial(self) -> LiveTrial | None:
        return self.current.trial

    def __iter__(self) -> _Epoch:
        return self

    def __len__(self) -> int:
        return len(self.owner)

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        while True:
            trial = self.current.trial
            if trial is None:
                trial = self.current.trial = self.tuning.start_trial(self.batches, self.seed)
            try:
                return trial.next()
            except TrialEnded:
                self._end_trial()
            except StopIteration:
                self.done = True
                self._end_trial()
                raise

    def _end_trial(self) -> None:
        trial, self.current.trial = self.current.trial, None
        assert trial is not None
        trial.end()
        undelivered = trial.feed.in_flight
        trial.close()
        self.tuning.trial_ended(trial, undelivered)

    def close(self) -> None:
        """The loop left this epoch: end its trial where it stands."""
        self.done = True
        if self.current.trial is not None:
            self._end_trial()


def _abandon(tuning: _Tuning, current: _Current) -> None:
    """The loop dropped an epoch: end its trial where it stands and stop all it holds;
    the study is told at the loader's next epoch (``NOTE [ Nothing outlives the loop ]``)."""
    trial, current.trial = current.trial, None
    if trial is None:
        return
    try:
        trial.end()
        undelivered = trial.feed.in_flight
        trial.close(kill=exiting())
    except Exception:
        _logger.warning("AutoLoader: stopping an abandoned epoch's trial failed", exc_info=True)
        return
    tuning.abandoned.append((trial, undelivered))


class _Tuning:
    """The search of one AutoLoader, driven by the loop: which setting loads next, and
    what each trial's end means (``NOTE [ Tuning in the training loop ]``)."""

    def __init__(
        self,
        owner: AutoLoader[Any],
        problem: Problem,
        problem_of: Callable[[Ranks], Problem],
    ) -> None:
        self._owner = weakref.ref(owner)  # NOTE [ Nothing outlives the loop ]
        self.problem = problem
        self.problem_of = problem_of  # the problem again, as one rank of a torchrun job
        self.ranks: Ranks | None = None
        self.segment: _Segment | None = None  # under torchrun: the trial under way
        self.pace: float | None = None  # rank 0: seconds per batch of the last trial
        self.fatal: BaseException | None = None  # rank 0: to raise on every rank
        self.started: float | None = None
        self.policy: Policy | None = None
        self.driver: Driver | None = None
        self.facts: dict[str, Any] = {}
        self.space_notes: list[Any] = []
        self.threads = torch.get_num_threads()
        self.result: TuneResult | None = None
        self.chosen: Params | None = None
        self.last_good: Params = BASELINE_PARAMS  # what loads a failed trial's batches
        self.redo = 0  # batches a failed setting gave back, for last_good to load
        self.proposal: Proposal | None = None
        self.trial_threads: int | None = None  # the threads before a trial set them
        self.failures: list[str] = []
        # The chosen setting's loader, kept across epochs where its workers persist.
        self.kept: tuple[DataLoader[Any], Feed] | None = None
        # Trials of epochs the loop dropped, stopped, and the batches they had not
        # delivered: the study is told at the next epoch (NOTE [ Nothing outlives the loop ]).
        self.abandoned: list[tuple[LiveTrial, int]] = []

    @property
    def owner(self) -> AutoLoader[Any]:
        """The AutoLoader: alive while the loop uses it, through its epoch."""
        owner = self._owner()
        assert owner is not None, "an AutoLoader's search outlived it"
        return owner

    def settle(self) -> None:
        """Tell the study how the trials of epochs the loop dropped went."""
        while self.abandoned:
            trial, undelivered = self.abandoned.pop(0)
            self.trial_ended(trial, undelivered)

    # Starting a trial ------------------------------------------------------------------

    def start_trial(self, batches: EpochBatches, seed: int) -> LiveTrial:
        if self.started is None:
            self._begin()
        if self.redo:
            params = self.last_good
            return self._trial(
                params, batches, seed, limit=self.redo, deadlines=self._deadlines(params)
            )
        if self.chosen is None and self.ranks is None and self._too_few_left(batches):
            # NOTE [ An epoch's tail ]: the last good setting loads it, unmeasured.
            self.redo = len(self.owner) - batches.taken
            return self._trial(
                self.last_good,
                batches,
                seed,
                limit=self.redo,
                deadlines=self._deadlines(self.last_good),
            )
        if self.chosen is None:
            plan = self._plan() if self.ranks is None else self._joint_plan()
            if plan is not None:
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
        assert self.chosen is not None
        return self._serve(self.chosen, batches, seed)

    # NOTE [ An epoch's tail ]
    # A trial ends with its epoch: cut short there, before two timing windows, it is
    # pruned as too short and its time is lost to the search. So where the batches left
    # in the epoch would take less than half a trial's time at the last trial's pace,
    # no trial starts: the last good setting loads them, and the next trial starts with
    # the next epoch. Not where a whole epoch is that short (every trial would wait),
    # nor before the baseline, nor under torchrun, whose trials have a length in batches.

    def _too_few_left(self, batches: EpochBatches) -> bool:
        if self.pace is None or self.driver is None:
            return False
        try:
            length = len(self.owner)
        except TypeError:
            return False
        wanted = 0.5 * trial_seconds(self.problem.budget)
        left = length - batches.taken
        return left > 0 and left * self.pace < wanted <= length * self.pace

    def _plan(self) -> _Plan | None:
        """The next trial, alone: the driver's proposal; ``None`` once tuning ended."""
        self.proposal = self._propose()
        if self.proposal is None:
            self._take(self._conclude(), reused_from=None)
            return None
        spec, driver = self.proposal.spec, self.driver
        assert driver is not None
        return _Plan(
            spec.params,
            spec.deadlines,
            max_seconds=spec.max_seconds,
            on_window=lambda window, measured: driver.vote(spec, window, measured),
        )

    def _propose(self) -> Proposal | None:
        assert self.driver is not None
        try:
            with quiet_optuna():
                return self.driver.propose()
        except AllSettingsFailedError as error:  # the baseline is left: it completed
            self.failures.append(str(error))
            _logger.warning("AutoLoader: %s", error)
            return None

    # NOTE [ Joint segments ]
    # Under torchrun every rank switches settings at the same batch: rank 0 proposes each
    # trial with a length in batches (its time over rank 0's last pace; the first, the
    # baseline, _FIRST_SEGMENT), the same on every rank, which loads exactly that many
    # batches of its epoch in the trial, a failed setting's share by the last good one.
    # At the trial's end (or its epoch's, at the same batch on every rank when their
    # samplers give them epochs of one length, as DistributedSampler does), the ranks
    # gather how it went, and rank 0 tells the study the job's figures: the slowest
    # rank's, or the failure, as in tune() (job_outcome). Two exchanges a trial, none
    # within one, and none once tuning ended. Both come between the user's steps, where a
    # rank may spend minutes alone (evaluating, checkpointing between epochs): they wait
    # as long as the job's own collectives (NOTE [ How long a rank waits ]).

    def _joint_plan(self) -> _Plan | None:
        """The next trial, decided by rank 0 and the same on every rank; ``None`` once
        tuning ended (every rank then trains with rank 0's result)."""
        ranks = self.ranks
        assert ranks is not None
        message: Any = None
        if ranks.drives:
            if self.fatal is not None:
                message = ("error", self.fatal)
            else:
                self.proposal = self._propose()
                if self.proposal is None:
                    result = self._conclude()
                    message = ("done", dataclasses.replace(result, _in_memory_kwargs={}))
                else:
                    spec = self.proposal.spec
                    batches = (
                        _FIRST_SEGMENT
                        if self.pace is None
                        else max(_MIN_SEGMENT, math.ceil(spec.max_seconds / self.pace))
                    )
                    message = ("trial", spec.params, spec.deadlines, batches, self.last_good)
        message = ranks.broadcast(message, during="deciding AutoLoader's next trial")
        kind = message[0]
        if kind == "error":
            raise message[1]
        if kind == "done":
            result = dataclasses.replace(
                message[1], _in_memory_kwargs=in_memory_kwargs(self.problem.fixed)
            )
            ranks.close()
            self.ranks = None
            self._take(result, reused_from=None)
            return None
        _, params, deadlines, batches, self.last_good = message
        self.segment = _Segment(params, batches)
        return _Plan(params, deadlines, batches=batches, max_seconds=math.inf)

    def _begin(self) -> None:
        """At the first batch: the saved result, or the checks and the search's start."""
        self.started = perf_counter()
        self.ranks = ranks = Ranks.join()
        if ranks is not None:
            # The machine as this rank's job sees it, and the same problem on every rank.
            self.problem = agree(ranks, self.problem_of(ranks))
        problem = self.problem
        found = reused(problem, ranks)
        if found is not None:
            if ranks is not None:
                ranks.close()
                self.ranks = None
            self._take(found, reused_from=problem.path)
            return
        if ranks is not None and not ranks.drives:
            return  # rank 0 runs the checks and the search
        space, self.space_notes, self.facts = check_before_search(problem)
        # In the training loop the baseline's pace is training's: measured once.
        self.policy = dataclasses.replace(
            policy_of(problem, space, self.facts), runoff_baseline=False
        )
        with quiet_optuna():
            self.driver = Driver(
                self.policy,
                None,
                open_study(problem, space),
                deadline=self.started + problem.budget,
                on_trial=lambda trial: _logger.info("%s", describe(record_of(trial))),
            )
            self.driver.begin()

    def _trial(
        self,
        params: Params,
        batches: EpochBatches,
        seed: int,
        *,
        limit: int | None = None,
        max_seconds: float | None = None,
        deadlines: Deadlines | None = None,
        on_window: Any = None,
    ) -> LiveTrial:
        feed = Feed(batches, limit=limit)
        ranks = self.ranks
        share = 1 if ranks is None else ranks.local_world_size  # the node's, in equal shares
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
        """The chosen setting, for the rest of training: one loader kept across epochs
        where its workers persist."""
        persistent = bool(params.get("persistent_workers"))
        if persistent and self.kept is not None:
            loader, feed = self.kept
            feed.point_at(batches)
        else:
            feed = Feed(batches)
            loader = self._loader(params, feed, seed)
            if persistent:
                self.kept = (loader, feed)
        return LiveTrial(
            loader,
            feed,
            params,
            batch_size=self.problem.batch_size,
            memory_budget=None,
            max_seconds=None,
            deadlines=self._deadlines(params),
            keep_workers=persistent,
        )

    def _deadlines(self, params: Params) -> Deadlines | None:
        """How long a batch may take to load with ``params`` before it counts as hung,
        from the search's baseline; ``None`` (no limit, as DataLoader) with no search
        (settings read from ``path``)."""
        if self.policy is None or self.driver is None:
            return None
        return self.policy.deadlines(params, self.driver.history)

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
        """Stop the kept loader's persistent workers."""
        if self.kept is not None:
            loader, _ = self.kept
            self.kept = None
            release(loader)

    # Ending a trial --------------------------------------------------------------------

    def trial_ended(self, trial: LiveTrial, undelivered: int) -> None:
        """Record how ``trial`` ended; after a fault, its ``undelivered`` batches are
        loaded next by the last setting that completed (under torchrun, the rest of the
        trial's batches: ``NOTE [ Joint segments ]``).

        Raises:
            The dataset's own error, where the baseline raises it too.
        """
        outcome = trial.outcome
        failed = isinstance(outcome, (TrialError, MemoryBudgetExceeded))
        if self.redo and trial.feed.limit is not None and trial.params is self.last_good:
            if failed:  # the last good setting failed on a failed setting's batches
                self._redo_failed(trial.params, outcome)  # type: ignore[arg-type]
            else:
                self.redo = 0
                if self.segment is not None:
                    self._end_segment()
            return
        segment = self.segment
        if segment is not None:
            _set_threads(self.trial_threads)
            self._keep_pace(trial)
            segment.outcome = outcome
            if failed:
                self._record_failure(segment.params, outcome)  # type: ignore[arg-type]
                # The trial's other batches, by the last good setting, before the exchange.
                self.redo = segment.batches - trial.feed.delivered_count
                if self.redo > 0:
                    return
                self.redo = 0
            self._end_segment()
            return
        proposal, self.proposal = self.proposal, None
        if proposal is not None:
            _set_threads(self.trial_threads)
            self._keep_pace(trial)
            self._tell(proposal, trial, outcome)  # type: ignore[arg-type]
        elif failed:
            self._chosen_failed(trial.params, outcome)  # type: ignore[arg-type]
        if failed:
            self.redo = undelivered

    def _keep_pace(self, trial: LiveTrial) -> None:
        """The loop's seconds per batch in ``trial``: under torchrun, rank 0's sets the
        next trial's length (``NOTE [ Joint segments ]``); alone, it tells whether an
        epoch's tail is worth a trial (``NOTE [ An epoch's tail ]``)."""
        if trial.feed.delivered_count:
            self.pace = (perf_counter() - trial.started) / trial.feed.delivered_count

    def _end_segment(self) -> None:
        """This rank's trial has loaded its batches: gather how it went on every rank;
        rank 0 tells the study the job's outcome (``NOTE [ Joint segments ]``)."""
        segment, ranks = self.segment, self.ranks
        assert segment is not None and ranks is not None
        self.segment = None
        everyone = ranks.gather(segment.outcome, during="ending AutoLoader's trial")
        proposal, self.proposal = self.proposal, None
        if not ranks.drives or proposal is None:
            return
        driver = self.driver
        assert driver is not None
        with quiet_optuna():
            try:
                measured = job_outcome(everyone, ranks.hosts)
            except (TrialError, MemoryBudgetExceeded) as error:
                try:
                    told = driver.failure(proposal.spec, error)
                except BaselineError:
                    self.fatal = _users_error(error)
                    return
            else:
                told = driver.outcome(proposal.spec, measured, voted=False)
            driver.finish(proposal, told)
        if isinstance(told, Completed):
            self.last_good = proposal.spec.params

    def _record_failure(self, params: Params, error: TrialError | MemoryBudgetExceeded) -> None:
        self.failures.append(f"{_describe(params)}: {error}")
        _logger.warning(
            "AutoLoader: the setting %s failed (%s); its batches are loaded again by %s, "
            "and tuning goes on",
            _describe(params),
            error,
            _describe(self.last_good),
        )

    def _tell(
        self,
        proposal: Proposal,
        trial: LiveTrial,
        outcome: Measurement | TrialError | MemoryBudgetExceeded,
    ) -> None:
        driver, spec = self.driver, proposal.spec
        assert driver is not None
        with quiet_optuna():
            if isinstance(outcome, Measurement):
                told = driver.outcome(spec, outcome, voted=trial.voted)
            else:
                try:
                    told = driver.failure(spec, outcome)
                except BaselineError:
                    raise _users_error(outcome) from None
                self._record_failure(spec.params, outcome)
            driver.finish(proposal, told)
        if isinstance(told, Completed):
            self.last_good = spec.params

    def _redo_failed(self, params: Params, error: TrialError | MemoryBudgetExceeded) -> None:
        """The last good setting failed too on a failed setting's batches: the baseline
        loads them, or, where the baseline failed, the error is the dataset's."""
        if params == BASELINE_PARAMS:
            raise _users_error(error)
        self.failures.append(f"{_describe(params)} (loading a failed setting's batches): {error}")
        self.last_good = BASELINE_PARAMS

    def _chosen_failed(self, params: Params, error: TrialError | MemoryBudgetExceeded) -> None:
        """The chosen setting failed in training: the last good other setting, or the
        baseline, loads the rest."""
        if params == BASELINE_PARAMS:
            raise _users_error(error)
        self.failures.append(f"{_describe(params)} (chosen, in training): {error}")
        fallback = self.last_good if self.last_good != params else BASELINE_PARAMS
        _logger.warning(
            "AutoLoader: the chosen setting %s failed in training (%s); %s loads the rest",
            _describe(params),
            error,
            _describe(fallback),
        )
        self.chosen, self.last_good, self.kept = fallback, BASELINE_PARAMS, None

    # The end of tuning -----------------------------------------------------------------

    def _conclude(self) -> TuneResult:
        """The policy stopped: the result, saved."""
        driver, policy, problem = self.driver, self.policy, self.problem
        assert driver is not None and policy is not None and self.started is not None
        choice = policy.choose(driver.history)
        notes = notes_of(
            problem,
            self.ranks,
            self.space_notes,
            policy,
            driver,
            choice,
            False,
            self.started,
            self.threads,
        )
        records = [record_of(trial) for trial in driver.history]
        result = result_of(problem, choice, records, notes, self.facts, False, self.started)
        if problem.path is not None:
            save_result(result, problem.path)
        return result

    def _take(self, result: TuneResult, *, reused_from: Path | None) -> None:
        """Train with ``result``'s settings from here on, and say so."""
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
                f"AutoLoader: reusing {_describe(self.chosen)} from {reused_from}, tuned for "
                f"this problem on this machine ({result.speedup:.2f}x the defaults); "
                "nothing to tune"
            )
        else:
            assert self.started is not None
            saved = f"; saved to {self.problem.path}" if self.problem.path is not None else ""
            line = (
                f"AutoLoader: tuned in {perf_counter() - self.started:.0f} s of training, "
                f"{len(result.trials)} trials: {_describe(self.chosen)}, "
                f"{result.speedup:.2f}x the defaults{saved}"
            )
        _logger.info("%s", line)
        if self.owner.verbose and world()[0] == 0:
            print(line, file=sys.stderr, flush=True)


# NOTE [ Joint segments ]: the first trial's length in batches, before any pace is
# known, and the shortest.
_FIRST_SEGMENT = 16
_MIN_SEGMENT = 8


@dataclass(frozen=True, slots=True)
class _Plan:
    """A trial to run: its setting, hang deadlines, and its end: ``batches`` (under
    torchrun) or ``max_seconds`` and the windows' vote (``on_window``)."""

    params: Params
    deadlines: Deadlines | None
    batches: int | None = None
    max_seconds: float | None = None
    on_window: WindowCallback | None = None


@dataclass(slots=True)
class _Segment:
    """Under torchrun, the trial under way: its setting, its length in batches, and how
    it went on this rank (``NOTE [ Joint segments ]``)."""

    params: Params
    batches: int
    outcome: Measurement | TrialError | MemoryBudgetExceeded | None = None


def _set_threads(threads: int | None) -> int | None:
    """Set this process's torch threads to ``threads`` (``None``: leave them); the count
    they had, to put back, or ``None``."""
    return None if threads is None else set_step_threads(threads)


def _users_error(error: TrialError | MemoryBudgetExceeded) -> BaseException:
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


def _describe(params: Mapping[str, Any]) -> str:
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
