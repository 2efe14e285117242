"""One tuning run's life, for both entry points: :class:`RunSession`.

``tune()`` and ``AutoLoader`` run the same search: the checks before it, the policy over
the space they leave, the Optuna study of the problem and the driver that asks and tells
it, the clock, the notes, the result and its file. A session owns all of it; the two
entry points differ only in who owns the loop, as Optuna's ``study.optimize()`` and its
``study.ask()`` / ``study.tell()`` do. Its methods, in the order they are called::

    RunSession(problem, ranks, started=..., interruption=...)
    check()                the checks that read items, and the space they leave
    open(runner, ...)      the policy, the study of this problem, the driver
    then either            tune(): its loop
      run()                the driver's trials until the policy stops, Ctrl-C or
                           SIGTERM (NOTE [ SIGTERM while tuning ], in _sigterm.py)
    or, trial by trial     AutoLoader, in the user's training loop
      ask()                the next trial, or None once the policy stops
      vote()               at each timing window: whether the trial should stop
      judge(), tell()      what happened, as a typed outcome; told to the study
      checkpoint()         mid-run: the trials so far, which resume() takes
                           after open() in a run resumed from a checkpoint
    conclude(partial=...)  the result: the choice, every trial, the notes in words once
    save(result)           at ``problem.path``, or a warning
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any

import optuna
import torch

from autoloader._exceptions import StudyInUseError
from autoloader._problem import Problem
from autoloader.checks import Checks, checks_seconds
from autoloader.distributed import Ranks
from autoloader.measure import Deadlines, Measurement, MemoryBudgetExceeded, Runner, TrialError
from autoloader.results import (
    TrialRecord,
    TuneResult,
    describe,
    in_memory_kwargs,
    record_of,
    split_loader_kwargs,
)
from autoloader.search import (
    BudgetGivenBack,
    Choice,
    Driver,
    Interrupted,
    Interruption,
    Note,
    Outcome,
    Policy,
    Proposal,
    Resumed,
    SearchSpace,
    SpaceNote,
    Startup,
    Terminated,
    Trial,
    TrialSpec,
    TunedJointly,
    quiet_optuna,
    remember_ctrl_c,
    render,
    resolve_space,
    study_name,
    trial_seconds,
)

_logger = logging.getLogger(__name__)

# A run that ends with more than this share of its budget left says why in its notes.
_GIVEN_BACK = 0.1


class RunSession:
    """One tuning run of ``problem``, from the checks before the search to the saved
    result, for this process alone (``ranks`` is ``None``) or on the rank of a torchrun
    job that drives the study.

    Args:
        problem: the run's arguments, checked (under torchrun, agreed between the ranks).
        ranks: the job's ranks under torchrun, else ``None``.
        started: ``perf_counter()`` time the run started: its budget counts from there.
        interruption: set by Ctrl-C or SIGTERM (``NOTE [ SIGTERM while tuning ]``);
            ``None`` where the loop is the user's and its Ctrl-C is theirs.
        threads: the process's torch threads before any trial set them (the user's);
            ``None``: as they are now.
    """

    def __init__(
        self,
        problem: Problem,
        ranks: Ranks | None,
        *,
        started: float,
        interruption: Interruption | None = None,
        threads: int | None = None,
    ) -> None:
        self.problem = problem
        self.ranks = ranks
        self.started = started
        self.interruption = interruption
        self.threads = torch.get_num_threads() if threads is None else threads
        self.space_notes: list[SpaceNote] = []
        self.facts: dict[str, Any] = {}
        self._space: SearchSpace | None = None
        self._named: list[SearchSpace] | None = None  # the spaces that may name the study
        self._driver: Driver | None = None
        # Where the study is AutoLoader's own, kept beside its path: the search goes on in
        # memory if another run holds it (NOTE [ An unfinished search kept ]).
        self.in_memory_if_taken: Path | None = None

    # The checks and the search's start -------------------------------------------------

    def check(self) -> SearchSpace:
        """The checks that read items and start processes, and the space they leave to
        search: only once every argument was checked, and out of the time budget (see
        NOTE [ Checks before the search ])."""
        problem = self.problem
        asked = problem.space
        checks = Checks(
            problem.dataset,
            problem.fixed,
            batch_size=problem.batch_size,
            seconds=checks_seconds(problem.budget),
            memory_budget=problem.memory_bytes,
            processes=asked.num_workers != (0, 0) and asked.worker_kind != ("threads",),
        )
        if asked.num_workers != (0, 0):  # with no workers, nothing can repeat
            checks.repeated_samples()
        batched_fetch_problem = (
            checks.batched_fetch_problem() if asked.batched_fetch != (False,) else None
        )
        threads_problem = checks.threads_problem() if asked.worker_kind != ("processes",) else None
        facts = checks.facts(problem.dataset_length, start_method=problem.start_method)
        resolve = functools.partial(
            resolve_space,
            asked,
            usable_cpus=problem.environment.usable_cpus,
            has_accelerator=problem.environment.accelerator is not None,
            batches_per_epoch=problem.batches_per_epoch,
            batched_fetch_problem=batched_fetch_problem,
            threads_problem=threads_problem,
        )
        space, notes = resolve(startup=_startup(problem, facts))
        # The spaces that may name the study (NOTE [ A study named by what stays ]).
        self._named = _named_spaces(
            resolve,
            {"batched_fetch_problem": batched_fetch_problem, "threads_problem": threads_problem},
            unfinished={
                "batched_fetch_problem": "batched_fetch" in checks.missing,
                "threads_problem": "threads" in checks.missing,
            },
        )
        for name, why in facts["missing"].items():
            _logger.warning("not checked before the search, %s: %s", name, why)
        self._space, self.space_notes, self.facts = space, notes, facts
        return space

    def open(
        self,
        runner: Runner | None,
        *,
        on_record: Callable[[TrialRecord], None] | None = None,
    ) -> None:
        """The policy, the study of this problem (an earlier run's, where the storage
        holds one) and the driver, once :meth:`check` left the space.

        Args:
            runner: measures each trial of :meth:`run`. ``None`` where the caller
                measures them itself in its training loop (:meth:`ask`, :meth:`tell`):
                the study's lease is taken now, and the baseline is measured once, its
                pace being training's, not again in the runoff.
            on_record: called with each trial's record, after it is logged.
        """
        problem, space, named = self.problem, self._space, self._named
        assert space is not None and named is not None, "check() comes first"
        policy = _policy(problem, space, self.facts)
        if runner is None:
            policy = dataclasses.replace(policy, runoff_baseline=False, in_training=True)

        def on_trial(trial: Trial) -> None:
            record = record_of(trial)
            _logger.info("%s", describe(record))
            if on_record is not None:
                on_record(record)

        with quiet_optuna():
            self._driver = Driver(
                policy,
                runner,
                _study(problem, named),
                deadline=self.started + problem.budget,
                on_trial=on_trial,
                interrupted=self.interruption,
            )
            if runner is None:
                # The lease is confirmed at the first trial's end, the training going on
                # meanwhile (NOTE [ The study's lease ]); under torchrun, every rank's.
                self._driver.begin(confirm_later=True)

    @property
    def driver(self) -> Driver:
        """The driver of the study, once :meth:`open` made it."""
        assert self._driver is not None, "open() comes first"
        return self._driver

    @property
    def history(self) -> list[Trial]:
        """Every trial so far, earlier runs' first; empty before :meth:`open`."""
        return [] if self._driver is None else self._driver.history

    def checkpoint(self) -> dict[str, Any]:
        """The trials this run finished, for :meth:`resume` in a run resumed from a
        checkpoint (``NOTE [ An AutoLoader's state ]``), in plain values."""
        return self.driver.checkpoint()

    def resume(self, state: Mapping[str, Any]) -> None:
        """Go on with the trials of :meth:`checkpoint`, after :meth:`open`: none is
        measured again.

        Raises:
            KeyError, TypeError, ValueError: ``state`` is not a checkpoint's.
        """
        with quiet_optuna():
            self.driver.resume(state)

    def stop_if_interrupted(self) -> None:
        """Raise the run's KeyboardInterrupt (or SIGTERM's ``Terminated``) where Ctrl-C or
        SIGTERM was noted, its own exception lost or not (a rank that follows rank 0's
        trials looks at it where the driver does)."""
        if self.interruption is not None:
            self.interruption.stop_if_set()

    # The loop: the driver's own (tune()), or the caller's, one trial at a time ------------

    def run(self) -> bool:
        """Run the driver's trials; whether Ctrl-C or SIGTERM cut them short (the result
        is partial)."""
        driver = self.driver
        try:
            with remember_ctrl_c(driver.interrupted):
                driver.run()
        except KeyboardInterrupt as error:
            # Under torchrun the other ranks stop too (torchrun ends the job): no
            # partial result for all to agree on; the storage keeps the trials.
            if not driver.has_baseline() or self.ranks is not None:
                raise
            # The trial under way has stopped and its workers are gone; what finished
            # before is still a measured answer.
            _logger.warning(
                "tuning interrupted (%s); returning the best of the finished trials",
                "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C",
            )
            return True
        return False

    def ask(self) -> Proposal | None:
        """The next trial to measure, or ``None`` once the policy stops.

        Raises:
            AllSettingsFailedError: every setting with workers failed so far.
        """
        with quiet_optuna():
            return self.driver.propose()

    def vote(self, spec: TrialSpec, window: int, measured: Measurement) -> bool:
        """Whether the trial should stop at this timing window (the policy's vote)."""
        return self.driver.vote(spec, window, measured)

    def judge(
        self,
        proposal: Proposal,
        happened: Measurement | TrialError | MemoryBudgetExceeded,
        *,
        voted: bool,
    ) -> Outcome:
        """What happened in ``proposal``'s trial, as its outcome (``voted``: the trial
        was stopped by :meth:`vote`); :meth:`tell` records it.

        Raises:
            BaselineError: the baseline failed: the fault is the dataset's or the step's.
        """
        driver = self.driver
        with quiet_optuna():
            if isinstance(happened, Measurement):
                return driver.outcome(proposal.spec, happened, voted=voted)
            return driver.failure(proposal.spec, happened)

    def tell(self, proposal: Proposal, outcome: Outcome) -> None:
        """Record ``proposal``'s trial with its ``outcome``.

        Raises:
            StudyInUseError: the study's lease, claimed as the search opened, is another
                run's (``NOTE [ The study's lease ]``), and the study is not one that
                :attr:`in_memory_if_taken` names: else the search starts again in memory.
        """
        try:
            with quiet_optuna():
                self.driver.finish(proposal, outcome)
        except StudyInUseError as error:
            self.search_in_memory(error)

    def search_in_memory(self, error: StudyInUseError) -> None:
        """Another run holds the study (``error``): where it is the one AutoLoader keeps
        beside its path (:attr:`in_memory_if_taken`), open the search again in memory,
        with a warning; else raise ``error``.

        Raises:
            StudyInUseError: ``error``, the study being the user's own.
        """
        kept, self.in_memory_if_taken = self.in_memory_if_taken, None
        if kept is None:
            raise error
        _logger.warning("AutoLoader: searching in memory, not in %s: %s", kept, error)
        self.problem = dataclasses.replace(self.problem, storage=None)
        self.open(None)

    def deadlines(self, params: Mapping[str, Any]) -> Deadlines | None:
        """How long a batch may take to load with ``params`` before it counts as hung,
        from the search's baseline; ``None`` (no limit) before :meth:`open`."""
        if self._driver is None:
            return None
        return self._driver.policy.deadlines(params, self._driver.history)

    # The end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Give the study's lease back, its heartbeat stopped, where :meth:`open` took
        it for a caller that measures the trials itself; safe to call more than once."""
        if self._driver is not None:
            self._driver.end()

    def conclude(self, *, partial: bool = False) -> TuneResult:
        """The result: the policy's choice, every trial, and the notes in words
        (``partial``: Ctrl-C or SIGTERM cut the trials short)."""
        driver = self.driver
        records = [record_of(trial) for trial in driver.history]
        choice = driver.policy.choose(driver.history)
        notes = self._notes(choice, partial)
        problem = self.problem
        saved, unsaved = split_loader_kwargs(problem.fixed)
        return TuneResult(
            params=choice.params,
            throughput=choice.throughput,
            baseline=choice.baseline,
            steady_throughput=choice.steady_throughput,
            steady_baseline=choice.steady_baseline,
            startup_seconds=choice.startup_seconds,
            startup_each_epoch=choice.startup_each_epoch,
            batch_size=problem.batch_size,
            trials=tuple(records),
            environment=problem.environment,
            tuning_seconds=perf_counter() - self.started,
            memory_budget=problem.memory_bytes,
            notes=tuple(render(note) for note in notes),
            partial=partial,
            fixed_loader_kwargs=saved,
            unsaved_loader_kwargs=unsaved,
            facts=self.facts,
            problem=problem.key(),
            _in_memory_kwargs=in_memory_kwargs(problem.fixed),
        )

    def _notes(self, choice: Choice, partial: bool) -> list[Note]:
        """What the user should know about the run, in the order the result lists it."""
        problem, driver = self.problem, self.driver
        policy, history = driver.policy, driver.history
        notes: list[Note] = [*self.space_notes]
        notes += policy.step_threads_notes(history, choice, threads=self.threads)
        ranks = self.ranks
        if ranks is not None:
            usable_cpus = problem.environment.usable_cpus
            notes.append(
                TunedJointly(ranks.world_size, ranks.local_world_size, usable_cpus, ranks.nodes)
            )
        if partial:
            by = driver.interrupted.by if driver.interrupted is not None else None
            notes.append(Interrupted(by or "Ctrl-C"))
        step_bound = policy.step_bound(history)
        if step_bound is not None:
            notes.append(step_bound)
        shortcomings = policy.shortcomings(history, search_seconds=driver.search_seconds)
        for shortcoming in [] if partial else shortcomings:
            _logger.warning("%s", render(shortcoming))
            notes.append(shortcoming)
        elapsed = perf_counter() - self.started
        ended, stopped = driver.search_ended, driver.stopped
        given_back = elapsed < (1 - _GIVEN_BACK) * problem.budget
        if not partial and given_back and ended is not None and stopped is not None:
            notes.append(BudgetGivenBack(elapsed, problem.budget, ended, stopped))
        resumed = sum(t.earlier for t in history)
        if resumed:
            notes.append(Resumed(resumed))
        return notes

    def save(self, result: TuneResult) -> None:
        """``result`` saved at ``problem.path`` (if given), or a warning: a file that
        cannot be written loses nothing of the run, which the caller gets back."""
        path = self.problem.path
        if path is None:
            return
        try:
            result.save(path)
        except (OSError, ValueError) as error:  # ValueError: a figure JSON cannot hold
            warnings.warn(
                f"autoloader could not save the result to {path}: {error}. The tuned "
                "settings are returned; save them with result.save(another_path).",
                stacklevel=4,  # tune()'s caller: save() < _tune() < tune() < the caller
            )


def _policy(problem: Problem, space: SearchSpace, facts: Mapping[str, Any]) -> Policy:
    """The search's rules for ``problem``, over the ``space`` and ``facts`` the checks
    before the search left."""
    return Policy(
        space=space,
        time_budget=problem.budget,
        batch_size=problem.batch_size,
        batches_per_epoch=problem.batches_per_epoch,
        n_trials=problem.n_trials,
        usable_cpus=problem.environment.usable_cpus,
        worker_start=facts.get("worker_start_seconds"),
        accelerator=_step_accelerator(problem),
        step_threads_asked=problem.space.step_threads != "auto",
        first=problem.first,
    )


def _step_accelerator(problem: Problem) -> str | None:
    """The accelerator the step runs on: the device batches go to, or, without one, the
    accelerator this process already uses (a model moved there before tuning), or
    ``None`` (see ``Policy.step_threads_left``)."""
    device = problem.device
    if device is not None:
        return None if device.type == "cpu" else str(device)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "cuda"
    return None


def _startup(problem: Problem, facts: dict[str, Any]) -> Startup | None:
    """Worker start-up as the checks measured it (``NOTE [ Worker start-up ]``)."""
    seconds = facts.get("worker_start_seconds")
    if seconds is None:
        return None
    return Startup(seconds, problem.start_method, problem.budget, trial_seconds(problem.budget))


# NOTE [ A study named by what stays ]
# A study is named by the problem and the machine (search/_study.py, name_of), its space
# among them: the space as the checks leave it, since a check that takes a choice away
# (batched fetch, thread workers) changes a categorical parameter, which Optuna refuses
# to vary within a study. But the cap that worker start-up puts on num_workers
# (NOTE [ Worker start-up ], in checks/_facts.py) moves with the time budget and with
# the machine's load at the check: AutoLoader's first run (a 60 s budget) and the next
# (4 s), both beside another test process, named two studies, and the next measured
# its baseline again instead of going on with the first's search. So the study is named
# by the space without that cap, an integer range Optuna lets vary, and the search
# keeps to the capped one; the earlier run's trials, measured, count as they were.
# A check that did not finish in its share of the checks' time (the threads check has
# 0.2 s of a 4 s budget's, 1.2 s of a 60 s one's: 24 reads of a remote item), or
# failed, takes its choice away from the run, as one that found the choice wrong for
# the dataset does; but it decided nothing, and the run's space is not the one an
# earlier run whose check finished named its study by. (So named, a second run on a
# study in use, beside a busy loop, was not refused once: most likely its threads check
# was cut short, and it tuned a study of its own.) Such a run goes on with the study the
# storage holds under any space the check could have left: as if it had passed, or
# found the choice wrong; a new study is named by the space the run searches. Its one
# choice left is not drawn (SearchSpace.suggest): Optuna refuses a categorical
# parameter whose choices change within a study. The earlier run's trials count as
# they were, its thread workers' among them: its check had passed.
def _named_spaces(
    resolve: Callable[..., tuple[SearchSpace, list[Any]]],
    problems: Mapping[str, str | None],
    *,
    unfinished: Mapping[str, bool],
) -> list[SearchSpace]:
    """The spaces that may name the study (``NOTE [ A study named by what stays ]``):
    the one the checks leave, without the start-up cap, then those that the checks
    which did not finish could have left had they passed."""
    open_checks = [name for name, problem in problems.items() if problem and unfinished[name]]
    spaces: list[SearchSpace] = []
    for passed in itertools.product((False, True), repeat=len(open_checks)):
        verdicts = {**problems, **{n: None for n, p in zip(open_checks, passed, strict=True) if p}}
        space = resolve(startup=None, **verdicts)[0]
        if space not in spaces:
            spaces.append(space)
    return spaces


def _study(problem: Problem, spaces: list[SearchSpace]) -> optuna.Study:
    """The study of this problem: an earlier run's, where the storage holds one named by
    one of ``spaces``; a new one named by the first (``NOTE [ A study named by what
    stays ]``)."""
    names = [
        study_name(
            problem.dataset,
            problem.step_fn,
            length=problem.dataset_length,
            batch_size=problem.batch_size,
            space=space,
            # The budget asked for: a default one moves with the memory free.
            memory_budget=None if problem.memory_budget is None else problem.memory_bytes,
            fixed_loader_kwargs=problem.fixed,
            environment=problem.environment,
            device=problem.device,
        )
        for space in spaces
    ]
    name = names[0]
    if len(names) > 1 and problem.storage is not None:
        stored = set(optuna.get_all_study_names(problem.storage))
        name = next((n for n in names if n in stored), name)
    return optuna.create_study(
        storage=problem.storage,
        study_name=name,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=problem.seed),
        load_if_exists=True,
    )
