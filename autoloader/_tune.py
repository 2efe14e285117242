"""``tune()``: check the arguments, run the search, and return the tuned settings.

``tune()`` is a pipeline of named steps::

    check_arguments         the arguments, checked before anything runs, as a Problem
    agree                   under torchrun: every rank was given the same problem
                            (both in _problem.py)
    _trial_runner           what measures one setting in this process; under torchrun
                            every rank measures each trial, _lead driving the study
                            and follow() on the other ranks
    _search                 the rest, on the rank that drives the study:
      check_before_search  the checks that read items, and the space they leave
      _run                  the driver's trials, until the policy stops them, Ctrl-C or
                            SIGTERM (NOTE [ SIGTERM while tuning ], in _sigterm.py)
      _notes                what the user should know, typed (search/_reasons.py)
      _result               the TuneResult, its notes rendered to words once
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import optuna
import torch
from torch.utils.data import Dataset

from autoloader._exceptions import InvalidInputError, RankError
from autoloader._preserve import Restorable, preserved
from autoloader._problem import Problem, agree, check_arguments, check_main_thread
from autoloader._reuse import reused
from autoloader._sigterm import Sigterm, sigterm_while_tuning
from autoloader.checks._facts import Checks, checks_seconds
from autoloader.checks._validation import Isolation
from autoloader.distributed._joint import JointRunner, follow, spare_batch
from autoloader.distributed._ranks import Ranks
from autoloader.loader._factory import build_loader, merge_loader_kwargs
from autoloader.loader._params import BASELINE_PARAMS
from autoloader.loader._step_threads import kept_threads
from autoloader.measure._isolation import SubprocessRunner
from autoloader.measure._runner import Runner, TrialRunner
from autoloader.measure._units import format_bytes
from autoloader.results._progress import Progress
from autoloader.results._record import TrialRecord, record_of
from autoloader.results._report import describe
from autoloader.results._result import (
    TuneResult,
    in_memory_kwargs,
    split_loader_kwargs,
)
from autoloader.search import Choice, Driver, Policy, Trial
from autoloader.search._driver import Interruption, Terminated, quiet_optuna, remember_ctrl_c
from autoloader.search._objective import trial_seconds
from autoloader.search._reasons import (
    BudgetGivenBack,
    Interrupted,
    Note,
    Resumed,
    SpaceNote,
    TunedJointly,
    render,
)
from autoloader.search._space import SearchSpace, Startup, resolve_space
from autoloader.search._study import study_name

_logger = logging.getLogger(__name__)

# A run that ends with more than this share of its budget left says why in its notes.
_GIVEN_BACK = 0.1
# The memory budget of a rank that is not its node's first: that one watches them all.
_UNWATCHED = 1 << 62


def tune(
    dataset: Dataset[Any],
    step_fn: Callable[[Any], object],
    *,
    batch_size: int,
    time_budget: float | None = None,
    n_trials: int | None = None,
    memory_budget: int | str | None = None,
    search_space: SearchSpace | Mapping[str, Any] | None = None,
    loader_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    storage: str | os.PathLike[str] | optuna.storages.BaseStorage | None = None,
    show_progress: bool = True,
    isolation: Isolation = "in-process",
    restore: Sequence[Restorable] | Restorable | None = None,
    path: str | os.PathLike[str] | None = None,
) -> TuneResult:
    """Find the fastest DataLoader settings for ``dataset`` and ``step_fn`` on this machine.

    Runs the training loop (``next(loader)``, then ``step_fn(batch)``) with settings
    proposed by an Optuna study: first ``num_workers=0`` defaults as the baseline, then
    the search, then the closest candidates again, side by side. Settings are ranked by
    samples per second over a training epoch, worker start-up included.

    Args:
        dataset (Dataset): a map-style dataset with ``__len__``, or an
            ``IterableDataset`` that shards itself across workers with
            ``torch.utils.data.get_worker_info()`` (as DataLoader requires).
        step_fn (callable): one training step; receives a batch. Its return value is
            ignored.
        batch_size (int): samples per batch, as in training.
        time_budget (float, optional): seconds for the whole run, the checks made
            before the search included (a tenth of it, 1 to 20 s: copy-on-read, batched
            fetch, repeated randomness or samples; a check that overruns its share is
            reported missing and the run goes on). ``None`` means 60. (default: ``None``)
        n_trials (int, optional): cap on search trials; ``None`` means no cap.
            (default: ``None``)
        memory_budget (int or str, optional): bytes the process tree may use during a
            trial, e.g. ``"6GiB"``; a trial passing it is stopped and recorded
            PRUNED. ``None`` means what the tree uses now plus 80% of the memory
            available (cgroup limits respected). (default: ``None``)
        search_space (SearchSpace or dict, optional): ranges to search. (default: ``None``)
        loader_kwargs (dict, optional): DataLoader options kept in every trial and in
            the tuned loader: ``shuffle``, ``sampler``, ``collate_fn``, ``drop_last``,
            ``generator``, ``worker_init_fn``... (default: ``None``)
        device (str or torch.device, optional): if set, each batch is moved there before
            ``step_fn`` (``non_blocking`` when pinned) and the device is synchronised at
            the edges of each timing window. (default: ``None``)
        seed (int, optional): seed of the sampler. (default: ``0``)
        storage (str, path or optuna.storages.BaseStorage, optional): where the study
            is kept, so that a run killed mid-way resumes: a journal file path such as
            ``"tuning.log"``, or an Optuna URL such as ``"sqlite:///tuning.db"`` or a
            shared RDB. ``None`` keeps it in memory. (default: ``None``)
        show_progress (bool, optional): a progress bar on stderr when it is a terminal.
            (default: ``True``)
        isolation (str, optional): where trials run. ``"in-process"`` runs them here,
            under a watchdog that kills a trial's workers when it passes the memory
            budget or hangs; a ``step_fn`` holding a model on an accelerator keeps it.
            ``"subprocess"`` runs each trial in a freshly spawned process (about 1.5 s
            more per trial, to import torch and load the dataset), so that even a crash
            of the trial's main process (native code, the OOM killer) is recorded and
            the run goes on; the dataset, step_fn and loader_kwargs must pickle, and a
            script must guard its entry point with ``if __name__ == "__main__":``.
            (default: ``"in-process"``)
        restore (sequence, optional): what ``step_fn`` trains, put back as it was when
            ``tune()`` returns or raises: the model (every parameter, buffer, gradient
            and ``training`` flag, in place), the optimizer, LR schedulers, a
            ``GradScaler``, generators (see :func:`autoloader.preserved`). ``step_fn``
            runs for real, hundreds to thousands of optimizer steps: without this the
            model trains on during tuning. (default: ``None``)
        path (str or path, optional): a JSON file that keeps the result. If it holds
            the result of the same problem (the dataset's type and length, the step,
            the batch size, the search space, the fixed loader options, the device)
            measured on this machine, that result is returned and nothing is tuned;
            otherwise the run tunes, logs why it could not reuse the file, and saves
            the result there (under torchrun, global rank 0 reads and writes it).
            (default: ``None``)

    The global random number generators (torch's, NumPy's, Python's) are always
    restored: training after ``tune()`` draws the same numbers as without it. So is
    this process's torch thread count (``torch.get_num_threads()``), which trials set
    where they search ``step_threads`` (see ``NOTE [ Step threads ]``): the tuned value
    is applied by ``result.apply_threads()``.

    Returns:
        TuneResult: the tuned settings, throughput against the baseline, and every trial.

    Raises:
        InvalidInputError: an argument is wrong, or this is not the main thread (see
            ``NOTE [ Main thread only ]``); raised before any trial runs. Or the
            workers of an ``IterableDataset`` repeat each other's samples (it does not
            split its items with ``get_worker_info()``), found before the baseline.
        UnpicklableError: the start method pickles the dataset or collate_fn into
            workers, or ``isolation="subprocess"`` sends them and the step_fn to each
            trial's process, and they do not pickle.
        IsolationError: under ``isolation="subprocess"``, the first trial's process
            died before it could load the dataset.
        BaselineError: the ``num_workers=0`` baseline failed.
        AllSettingsFailedError: every setting with workers failed.
        KeyboardInterrupt: Ctrl-C before the baseline finished. Later, Ctrl-C stops the
            trial under way, kills its workers and returns the best of the finished
            trials with ``partial=True``.

    SIGTERM (how SLURM, Kubernetes and torchrun stop a job) stops the run as Ctrl-C does;
    the best of the finished trials is saved at ``path`` (``partial=True``: never reused
    as a complete result), then SIGTERM is delivered again to the handler that was there
    before ``tune()``: by default the process then ends by SIGTERM, as it would have
    without autoloader; a handler of your own runs, and if it returns, ``tune()``
    returns the partial result. See ``NOTE [ SIGTERM while tuning ]``.

    Example::

        result = autoloader.tune(dataset, train_step, batch_size=64, time_budget=120)
        result.save("best.json")
        loader = result.make_loader(dataset)
    """
    started = perf_counter()
    check_main_thread("tune()")
    # Under torchrun every rank calls tune(): they tune together (see distributed/_joint.py).
    ranks = Ranks.join()
    try:
        # The random number generators, and this process's threads (step_threads).
        with sigterm_while_tuning(ranks) as sigterm, preserved(), kept_threads():
            problem = check_arguments(
                ranks,
                dataset,
                step_fn,
                batch_size=batch_size,
                time_budget=time_budget,
                n_trials=n_trials,
                memory_budget=memory_budget,
                search_space=search_space,
                loader_kwargs=loader_kwargs,
                device=device,
                seed=seed,
                storage=storage,
                show_progress=show_progress,
                isolation=isolation,
                restore=restore,
                path=path,
            )
            with preserved(*problem.restore, rng=False):
                return _tune(ranks, started, problem, sigterm)
    finally:
        if ranks is not None:
            ranks.close()


def check_passed_through(
    tune_kwargs: Mapping[str, Any],
    *,
    caller: str,
    given: Mapping[str, str],
    refused: Mapping[str, str] | None = None,
) -> None:
    """:class:`InvalidInputError` for ``tune()`` arguments that a framework adapter
    (``caller``) cannot pass through: those it gives itself (``given``: name to the
    message's end), those that cannot work there (``refused``: name to the reason), and
    names :func:`tune` does not take. ``time_budget`` and ``path`` are the adapters' own."""
    known = set(inspect.signature(tune).parameters) - {"time_budget", "path"}
    for name in tune_kwargs:
        if name in given:
            raise InvalidInputError(f"{caller} takes {name!r} {given[name]}")
        if refused and name in refused:
            raise InvalidInputError(f"{caller} cannot pass {name!r}: {refused[name]}")
        if name not in known:
            raise InvalidInputError(
                f"{caller} got {name!r}, which autoloader.tune() does not take."
            )


def _tune(ranks: Ranks | None, started: float, problem: Problem, sigterm: Sigterm) -> TuneResult:
    """:func:`tune` once its arguments are checked, for this process alone (``ranks``
    is ``None``) or as one of the ranks of a torchrun job."""
    if ranks is not None:
        problem = agree(ranks, problem)
    found = reused(problem, ranks)
    if found is not None:
        return found
    result = _tuned(problem, ranks, started, sigterm.interruption)
    sigterm.hold()  # NOTE [ SIGTERM while tuning ]: a SIGTERM now waits for the file
    if problem.path is not None:
        save_result(result, problem.path)
    if sigterm.interruption.by == "SIGTERM":
        _logger.log(
            logging.INFO if problem.path is None else logging.WARNING,
            "stopped by SIGTERM after %d finished trials%s; SIGTERM goes on to the handler "
            "that was there before tune()",
            sum(trial.kind != "interrupted" for trial in result.trials),
            "" if problem.path is None else f", saved to {problem.path}",
        )
    return result


def save_result(result: TuneResult, path: Path) -> None:
    """``result`` saved at ``path``, or a warning: a file that cannot be written loses
    nothing of the run, which the caller gets back."""
    try:
        result.save(path)
    except (OSError, ValueError) as error:  # ValueError: a figure JSON cannot hold
        warnings.warn(
            f"autoloader could not save the result to {path}: {error}. The tuned "
            "settings are returned; save them with result.save(another_path).",
            stacklevel=4,  # tune()'s caller
        )


def _tuned(
    problem: Problem, ranks: Ranks | None, started: float, interruption: Interruption
) -> TuneResult:
    """The search, in this process alone or as one of the ranks; ``interruption`` notes
    Ctrl-C and SIGTERM."""
    in_process = _trial_runner(problem, ranks)
    if ranks is None:
        runner = SubprocessRunner(in_process) if problem.isolation == "subprocess" else in_process
        return _search(problem, runner, ranks, started, interruption)
    baseline_kwargs = merge_loader_kwargs(
        BASELINE_PARAMS, batch_size=problem.batch_size, fixed=problem.fixed
    )
    spare = spare_batch(
        ranks,
        lambda: in_process.first_batches(
            lambda: build_loader(problem.dataset, baseline_kwargs),
            1,
            seconds=checks_seconds(problem.budget),
        )[0],
    )
    if not ranks.drives:
        found: TuneResult = follow(in_process, ranks, spare=spare)
        return dataclasses.replace(found, _in_memory_kwargs=in_memory_kwargs(problem.fixed))
    return _lead(problem, JointRunner(in_process, ranks, spare=spare), ranks, started, interruption)


def _trial_runner(problem: Problem, ranks: Ranks | None) -> TrialRunner:
    """What measures one setting in this process."""
    return TrialRunner(
        problem.dataset,
        problem.step_fn,
        batch_size=problem.batch_size,
        # Each node's first rank watches the node's whole tree, every rank's workers,
        # and stops its own (NOTE [ Only the trial's own processes ]).
        memory_budget=(
            problem.memory_bytes if ranks is None or ranks.local_rank == 0 else _UNWATCHED
        ),
        memory_peers=ranks.node_pids[1:] if ranks is not None and ranks.local_rank == 0 else (),
        fixed_kwargs=problem.fixed,
        device=problem.device,
    )


def _lead(
    problem: Problem,
    joint: JointRunner,
    ranks: Ranks,
    started: float,
    interruption: Interruption,
) -> TuneResult:
    """As the rank that drives the study: search with every rank measuring each trial,
    then send the others the result, or the error."""
    try:
        result = _search(problem, joint, ranks, started, interruption)
    except (RankError, KeyboardInterrupt):
        raise  # the other ranks stop with their own RankError
    except Exception as error:
        joint.finish(error=error)
        raise
    joint.finish(result=dataclasses.replace(result, _in_memory_kwargs={}))
    return result


def _search(
    problem: Problem,
    runner: Runner,
    ranks: Ranks | None,
    started: float,
    interruption: Interruption,
) -> TuneResult:
    """The checks before the search, the search, and the result it comes to."""
    space, space_notes, facts = check_before_search(problem)
    threads = torch.get_num_threads()  # the user's, before any trial or step set them
    _logger.info(
        "tuning %s for %.0f s, memory budget %s, space %s",
        type(problem.dataset).__name__,
        problem.budget,
        format_bytes(problem.memory_bytes),
        space.as_dict(),
    )
    with (
        quiet_optuna(),
        Progress(time_budget=problem.budget, enabled=problem.show_progress) as progress,
    ):
        study = open_study(problem, space)
        policy = policy_of(problem, space, facts)

        def on_trial(trial: Trial) -> None:
            record = record_of(trial)
            _logger.info(describe(record))
            progress.trial_done(record)

        driver = Driver(
            policy,
            runner,
            study,
            deadline=started + problem.budget,
            on_trial=on_trial,
            interrupted=interruption,
        )
        partial = _run(driver, ranks)
        records = [record_of(trial) for trial in driver.history]
        choice = policy.choose(driver.history)
        notes = notes_of(
            problem, ranks, space_notes, policy, driver, choice, partial, started, threads
        )
    return result_of(problem, choice, records, notes, facts, partial, started)


def policy_of(problem: Problem, space: SearchSpace, facts: Mapping[str, Any]) -> Policy:
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
        accelerator=step_accelerator(problem),
        step_threads_asked=problem.space.step_threads != "auto",
    )


def step_accelerator(problem: Problem) -> str | None:
    """The accelerator the step runs on: the device batches go to, or, without one, the
    accelerator this process already uses (a model moved there before ``tune()``), or
    ``None`` (see ``Policy.step_threads_left``)."""
    device = problem.device
    if device is not None:
        return None if device.type == "cpu" else str(device)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "cuda"
    return None


def check_before_search(problem: Problem) -> tuple[SearchSpace, list[SpaceNote], dict[str, Any]]:
    """The checks that read items and start processes, and the space they leave to
    search: only once every argument was checked, and out of the time budget (see
    NOTE [ Checks before the search ])."""
    checks = Checks(
        problem.dataset,
        problem.fixed,
        batch_size=problem.batch_size,
        seconds=checks_seconds(problem.budget),
        memory_budget=problem.memory_bytes,
    )
    asked = problem.space
    if asked.num_workers != (0, 0):  # with no workers, nothing can repeat
        checks.repeated_samples()
    batched_fetch_problem = (
        checks.batched_fetch_problem() if asked.batched_fetch != (False,) else None
    )
    threads_problem = checks.threads_problem() if asked.worker_kind != ("processes",) else None
    facts = checks.facts(
        problem.dataset_length,
        start_method=problem.start_method,
        processes=asked.num_workers != (0, 0) and asked.worker_kind != ("threads",),
    )
    space, notes = resolve_space(
        asked,
        usable_cpus=problem.environment.usable_cpus,
        has_accelerator=problem.environment.accelerator is not None,
        batches_per_epoch=problem.batches_per_epoch,
        batched_fetch_problem=batched_fetch_problem,
        threads_problem=threads_problem,
        startup=_startup(problem, facts),
    )
    for name, why in facts["missing"].items():
        _logger.warning("not checked before the search, %s: %s", name, why)
    return space, notes, facts


def _startup(problem: Problem, facts: dict[str, Any]) -> Startup | None:
    """Worker start-up as the checks measured it (``NOTE [ Worker start-up ]``)."""
    seconds = facts.get("worker_start_seconds")
    if seconds is None:
        return None
    return Startup(seconds, problem.start_method, problem.budget, trial_seconds(problem.budget))


def open_study(problem: Problem, space: SearchSpace) -> optuna.Study:
    """The study of this problem: an earlier run's, where the storage holds one."""
    return optuna.create_study(
        storage=problem.storage,
        study_name=study_name(
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
        ),
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=problem.seed),
        load_if_exists=True,
    )


def _run(driver: Driver, ranks: Ranks | None) -> bool:
    """Run the driver's trials; whether Ctrl-C or SIGTERM cut them short (the result is
    partial)."""
    try:
        with remember_ctrl_c(driver.interrupted):
            driver.run()
    except KeyboardInterrupt as error:
        # Under torchrun the other ranks stop too (torchrun ends the job): no
        # partial result for all to agree on; the storage keeps the trials.
        if not driver.has_baseline() or ranks is not None:
            raise
        # The trial under way has stopped and its workers are gone; what finished
        # before is still a measured answer.
        _logger.warning(
            "tuning interrupted (%s); returning the best of the finished trials",
            "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C",
        )
        return True
    return False


def notes_of(
    problem: Problem,
    ranks: Ranks | None,
    space_notes: list[SpaceNote],
    policy: Policy,
    driver: Driver,
    choice: Choice,
    partial: bool,
    started: float,
    threads: int,
) -> list[Note]:
    """What the user should know about the run, in the order the result lists it;
    ``threads``: the process's torch threads before the trials."""
    notes: list[Note] = [*space_notes]
    notes += policy.step_threads_notes(driver.history, choice, threads=threads)
    if ranks is not None:
        usable_cpus = problem.environment.usable_cpus
        notes.append(
            TunedJointly(ranks.world_size, ranks.local_world_size, usable_cpus, ranks.nodes)
        )
    if partial:
        by = driver.interrupted.by if driver.interrupted is not None else None
        notes.append(Interrupted(by or "Ctrl-C"))
    step_bound = policy.step_bound(driver.history)
    if step_bound is not None:
        notes.append(step_bound)
    shortcomings = policy.shortcomings(driver.history, search_seconds=driver.search_seconds)
    for shortcoming in [] if partial else shortcomings:
        _logger.warning("%s", render(shortcoming))
        notes.append(shortcoming)
    elapsed = perf_counter() - started
    ended, stopped = driver.search_ended, driver.stopped
    given_back = elapsed < (1 - _GIVEN_BACK) * problem.budget
    if not partial and given_back and ended is not None and stopped is not None:
        notes.append(BudgetGivenBack(elapsed, problem.budget, ended, stopped))
    resumed = sum(t.earlier for t in driver.history)
    if resumed:
        notes.append(Resumed(resumed))
    return notes


def result_of(
    problem: Problem,
    choice: Choice,
    records: list[TrialRecord],
    notes: list[Note],
    facts: dict[str, Any],
    partial: bool,
    started: float,
) -> TuneResult:
    """The result: the choice, every trial, and the notes in words."""
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
        tuning_seconds=perf_counter() - started,
        memory_budget=problem.memory_bytes,
        notes=tuple(render(note) for note in notes),
        partial=partial,
        fixed_loader_kwargs=saved,
        unsaved_loader_kwargs=unsaved,
        facts=facts,
        problem=problem.key(),
        _in_memory_kwargs=in_memory_kwargs(problem.fixed),
    )
