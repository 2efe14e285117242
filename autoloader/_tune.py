"""``tune()``: check the arguments, run the search, and return the tuned settings.

``tune()`` is a pipeline of named steps::

    check_arguments         the arguments, checked before anything runs, as a Problem
    agree                   under torchrun: every rank was given the same problem
                            (both in _problem.py)
    reused                  a saved result of the same problem (_reuse.py),
    checked                 trusted once a short trial of its setting finds the
                            loop waiting for data as when tuned (_reuse_check.py)
    _trial_runner           what measures one setting in this process; under torchrun
                            every rank measures each trial, _lead driving the study
                            and follow() on the other ranks
    _search                 the rest, on the rank that drives the study, through the
                            run's RunSession (_session.py), which AutoLoader drives too:
      check()               the checks that read items, and the space they leave
      open()                the policy, the study and the driver
      run()                 the driver's trials, until the policy stops them, Ctrl-C or
                            SIGTERM (NOTE [ SIGTERM while tuning ], in _sigterm.py)
      conclude()            the TuneResult, its notes rendered to words once
    save()                  the result at ``path``
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from time import perf_counter
from typing import Any

import optuna
import torch
from torch.utils.data import Dataset

from autoloader._exceptions import InvalidInputError, RankError
from autoloader._preserve import Restorable, preserved
from autoloader._problem import (
    Problem,
    TuneArguments,
    agree,
    check_arguments,
    check_main_thread,
)
from autoloader._reuse import reused
from autoloader._reuse_check import checked
from autoloader._session import RunSession
from autoloader._sigterm import Sigterm, sigterm_while_tuning
from autoloader.checks import Isolation, checks_seconds
from autoloader.distributed import JointRunner, Ranks, follow, spare_batch
from autoloader.loader import BASELINE_PARAMS, build_loader, kept_threads, merge_loader_kwargs
from autoloader.measure import Runner, SubprocessRunner, TrialRunner, format_bytes
from autoloader.results import Progress, TuneResult, in_memory_kwargs
from autoloader.search import SearchSpace, quiet_optuna, remember_ctrl_c

_logger = logging.getLogger(__name__)

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
            ``"subprocess"`` runs each trial in a fresh process of its own, forked
            from a helper the run spawns once (a trial's process costs about 0.2 s on
            Linux; spawned afresh elsewhere, about 2 s to import torch), so that even a
            crash of the trial's main process (native code, the OOM killer) is recorded
            and the run goes on; the dataset, step_fn and loader_kwargs must pickle, and a
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
            the batch size, the search space, the fixed loader options, the device,
            the fingerprints of the dataset's and the step's code) measured on this
            machine, one short trial of its setting checks its rate (``NOTE [ A
            reused setting checked ]``), and where it holds that result is returned,
            nothing searched; otherwise the run tunes, logs why it could not reuse the
            file, and saves the result there (under torchrun, global rank 0 reads and
            writes it). (default: ``None``)

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
        IsolationError: under ``isolation="subprocess"``, the first trial's process,
            or the helper that forks them, died before it could load the dataset.
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
    # tune()'s keyword arguments, each passed on (tests/test_signatures.py ties the two).
    arguments = TuneArguments(
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
    check_main_thread("tune()")
    # Under torchrun every rank calls tune(): they tune together (see distributed/_joint.py).
    ranks = Ranks.join()
    try:
        # The random number generators, and this process's threads (step_threads).
        with sigterm_while_tuning(ranks) as sigterm, preserved(), kept_threads():
            problem = check_arguments(ranks, dataset, step_fn, arguments)
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
    if found is not None and ranks is not None:
        return found  # NOTE [ A reused setting checked ]: unchecked under torchrun
    if found is not None:
        assert problem.path is not None
        with _runner(problem) as runner:
            found = checked(found, runner, budget=problem.budget, path=problem.path)
        if found is not None:
            return found
    session = RunSession(problem, ranks, started=started, interruption=sigterm.interruption)
    result = _tuned(session)
    sigterm.hold()  # NOTE [ SIGTERM while tuning ]: a SIGTERM now waits for the file
    session.save(result)
    if sigterm.interruption.by == "SIGTERM":
        _logger.log(
            logging.INFO if problem.path is None else logging.WARNING,
            "stopped by SIGTERM after %d finished trials%s; SIGTERM goes on to the handler "
            "that was there before tune()",
            sum(trial.kind != "interrupted" for trial in result.trials),
            "" if problem.path is None else f", saved to {problem.path}",
        )
    return result


def _tuned(session: RunSession) -> TuneResult:
    """The search, in this process alone or as one of the ranks."""
    problem, ranks = session.problem, session.ranks
    if ranks is None:
        with _runner(problem) as runner:
            return _search(session, runner)
    in_process = _trial_runner(problem, ranks)
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
        # Ctrl-C noted as on rank 0 (remember_ctrl_c), and looked at where it looks.
        with remember_ctrl_c(session.interruption):
            found: TuneResult = follow(
                in_process, ranks, spare=spare, stop_if_interrupted=session.stop_if_interrupted
            )
        return dataclasses.replace(found, _in_memory_kwargs=in_memory_kwargs(problem.fixed))
    return _lead(session, JointRunner(in_process, ranks, spare=spare))


@contextlib.contextmanager
def _runner(problem: Problem) -> Iterator[Runner]:
    """What measures one setting, for this process alone; under isolation, the helper
    that starts each trial's process ends with the block."""
    in_process = _trial_runner(problem, None)
    if problem.isolation != "subprocess":
        yield in_process
        return
    with SubprocessRunner(in_process) as isolated:
        yield isolated


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


def _lead(session: RunSession, joint: JointRunner) -> TuneResult:
    """As the rank that drives the study: search with every rank measuring each trial,
    then send the others the result, or the error."""
    try:
        result = _search(session, joint)
    except (RankError, KeyboardInterrupt):
        raise  # the other ranks stop with their own RankError
    except Exception as error:
        joint.finish(error=error)
        raise
    joint.finish(result=dataclasses.replace(result, _in_memory_kwargs={}))
    return result


def _search(session: RunSession, runner: Runner) -> TuneResult:
    """The checks before the search, the search, and the result it comes to."""
    problem = session.problem
    space = session.check()
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
        session.open(runner, on_record=progress.trial_done)
        partial = session.run()
        return session.conclude(partial=partial)
