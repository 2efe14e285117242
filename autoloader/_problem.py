"""What one call of :func:`autoloader.tune` asks for: its arguments as given
(:class:`TuneArguments`, which ``AutoLoader`` and the CLI build too), checked before
anything runs, and what they come to on this machine (:class:`Problem`); under torchrun,
the same problem agreed between the ranks (:func:`agree`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from torch.utils.data import Dataset

from autoloader._exceptions import InvalidInputError, ResultFileError
from autoloader._preserve import Restorable, check_restorable
from autoloader.checks import (
    Environment,
    Isolation,
    check_batch_size,
    check_dataset,
    check_isolation,
    check_loader_kwargs,
    check_n_trials,
    check_picklable,
    check_seconds,
    check_step_fn,
    count_batches,
    start_method,
    unpicklable,
)
from autoloader.distributed import Ranks, agree_on_arguments, node_memory_budget
from autoloader.measure import resolve_device, resolve_memory_budget
from autoloader.results import SCHEMA_VERSION, check_writable, read_result_json
from autoloader.search import (
    ProblemIdentity,
    SearchSpace,
    check_search_space,
    dataset_code,
    open_storage,
    step_code,
)

# Seconds a run may take where time_budget is not given: tune() and AutoLoader (None),
# the CLI and the Lightning and Transformers adapters all default to this one number.
DEFAULT_TIME_BUDGET = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneArguments:
    """:func:`tune`'s keyword arguments as given, with its defaults (its docstring says
    what each means): what ``tune()``, ``AutoLoader`` and the CLI hand to
    :func:`check_arguments`, written here once. ``tune()`` keeps its own signature, for
    users and their IDEs; ``tests/test_signatures.py`` ties the two, names, defaults
    and types, and the CLI's options named as these to their defaults."""

    batch_size: int
    time_budget: float | None = None
    n_trials: int | None = None
    memory_budget: int | str | None = None
    search_space: SearchSpace | Mapping[str, Any] | None = None
    loader_kwargs: Mapping[str, Any] | None = None
    device: str | torch.device | None = None
    seed: int = 0
    storage: str | os.PathLike[str] | optuna.storages.BaseStorage | None = None
    show_progress: bool = True
    isolation: Isolation = "in-process"
    restore: Sequence[Restorable] | Restorable | None = None
    path: str | os.PathLike[str] | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The arguments by name, as ``tune()`` takes them: the values themselves, not
        copies (``dataclasses.asdict`` would copy a sampler or a dataset)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class Problem:
    """What one call of :func:`tune` asks for: its arguments, checked, and what they
    come to on this machine."""

    dataset: Dataset[Any]
    step_fn: Callable[[Any], object]
    dataset_length: int | None
    batches_per_epoch: int | None
    batch_size: int
    budget: float
    n_trials: int | None
    seed: int
    space: SearchSpace  # as given: resolved only after the checks before the search
    fixed: dict[str, Any]
    device: torch.device | None
    storage: str | optuna.storages.BaseStorage | None
    environment: Environment
    start_method: str
    isolation: Isolation
    memory_budget: int | str | None  # as given
    memory_bytes: int  # the budget in bytes; under torchrun, the node's (see agree)
    show_progress: bool
    restore: tuple[Restorable, ...]
    path: Path | None = None  # where the result is kept, and reused from
    # Settings the search measures first (Policy.first): a search drift started's.
    first: tuple[dict[str, Any], ...] = ()

    def identity(self, *, budget_as_given: bool = False) -> ProblemIdentity:
        """What identifies this problem (see :class:`ProblemIdentity`): its study's name,
        the problem its result file keeps, what the ranks of a job agree on; with
        ``budget_as_given``, the memory budget as the call gave it (under torchrun the
        bytes are only known after :func:`agree`)."""
        return ProblemIdentity(
            dataset=self.dataset,
            step_fn=self.step_fn,
            length=self.dataset_length,
            batch_size=self.batch_size,
            space=self.space,
            # The budget asked for: a default one moves with the memory free.
            memory_budget=(
                self.memory_budget
                if budget_as_given or self.memory_budget is None
                else self.memory_bytes
            ),
            fixed_loader_kwargs=self.fixed,
            device=self.device,
            dataset_code=dataset_code(self.dataset),
            step_code=step_code(self.step_fn),
        )

    def key(self) -> dict[str, str]:
        """The problem by name, part by part: what a result file keeps, so that a later
        run reuses it only for the same problem (see :meth:`ProblemIdentity.parts`)."""
        return self.identity().parts()


# NOTE [ Main thread only ]
# Every wait of tune() and diagnose() on user code (a batch, a step, a check that reads
# items) ends at a deadline that SIGALRM enforces: it interrupts the main thread waiting
# for a batch, or running a dataset's read or a step that blocks. Python runs signal
# handlers in the main thread only, and a thread cannot be interrupted otherwise: from
# another thread such a wait would last forever, the code it ran in the baseline
# (num_workers=0) blocked in that very thread. So both refuse another thread before any
# work starts, rather than promise deadlines they cannot keep. AutoLoader runs in the
# user's own loop, where a blocked batch blocks it as a DataLoader's would.
def check_main_thread(caller: str) -> None:
    """Refuse a call from a thread other than the main one (``NOTE [ Main thread only ]``).

    Raises:
        InvalidInputError: this is not the main thread.
    """
    current = threading.current_thread()
    if current is threading.main_thread():
        return
    raise InvalidInputError(
        f"{caller} must be called from the main thread because its deadlines (a batch, a "
        "step or a check that hangs) are enforced by SIGALRM, which Python delivers to "
        f"the main thread only: from thread {current.name!r}, a dataset or step that "
        f"blocks would block it forever. Call {caller} from the main thread, or from a "
        "process of its own (multiprocessing) if it must run beside other work."
    )


def check_arguments(
    ranks: Ranks | None,
    dataset: Dataset[Any],
    step_fn: Callable[[Any], object],
    arguments: TuneArguments,
    *,
    check_pickling: bool = True,
) -> Problem:
    """:func:`tune`'s arguments, checked before anything runs. Under torchrun a rank's
    error is told to the others (see :func:`agree`), so that none waits for it.
    ``check_pickling=False`` leaves out whether workers can be sent the dataset (under
    spawn or forkserver): ``AutoLoader``, which starts workers only where its search
    tries them, asks it then (:func:`workers_unpicklable`)."""
    try:
        return _checked(ranks, dataset, step_fn, arguments, check_pickling=check_pickling)
    except Exception as error:
        if ranks is not None:
            agree_on_arguments(ranks, error=error, arguments=None)
        raise


def _checked(
    ranks: Ranks | None,
    dataset: Dataset[Any],
    step_fn: Callable[[Any], object],
    arguments: TuneArguments,
    *,
    check_pickling: bool,
) -> Problem:
    """The arguments checked one by one, in the order in which a wrong one is named
    (the first found is raised), and what they come to on this machine."""
    dataset_length = check_dataset(dataset)
    batch_size = check_batch_size(arguments.batch_size, dataset_length)
    step_fn = check_step_fn(step_fn)
    budget = check_seconds(
        "time_budget",
        DEFAULT_TIME_BUDGET if arguments.time_budget is None else arguments.time_budget,
        hint=" It is the seconds the whole tuning run may take.",
    )
    n_trials = check_n_trials(arguments.n_trials)
    space = check_search_space(arguments.search_space)
    fixed = check_loader_kwargs(arguments.loader_kwargs)
    device = resolve_device(arguments.device)
    # Only the rank that drives the study opens its storage.
    storage = open_storage(arguments.storage if ranks is None or ranks.drives else None)
    seed = arguments.seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidInputError(f"seed must be an int, but got {seed!r}.")
    batches_per_epoch = count_batches(dataset, batch_size, fixed)
    environment = Environment.current(
        world_size=ranks.world_size if ranks else 1,
        local_world_size=ranks.local_world_size if ranks else 1,
        nodes=ranks.nodes if ranks else 1,
        node_cpus=ranks.node_cpus if ranks else None,
    )
    method = start_method(fixed, environment.start_method)
    if check_pickling:
        check_picklable(_sent_to_workers(dataset, fixed), method)
    return Problem(
        dataset=dataset,
        step_fn=step_fn,
        dataset_length=dataset_length,
        batches_per_epoch=batches_per_epoch,
        batch_size=batch_size,
        budget=budget,
        n_trials=n_trials,
        seed=seed,
        space=space,
        fixed=fixed,
        device=device,
        storage=storage,
        environment=environment,
        start_method=method,
        # The rest checked here, in the order of the fields.
        isolation=_checked_isolation(arguments.isolation, ranks),
        memory_budget=arguments.memory_budget,
        memory_bytes=resolve_memory_budget(arguments.memory_budget) if ranks is None else 0,
        show_progress=arguments.show_progress,
        restore=check_restorable(arguments.restore),
        path=check_result_path(arguments.path, writes=ranks is None or ranks.rank == 0),
    )


def _sent_to_workers(dataset: Dataset[Any], fixed: Mapping[str, Any]) -> dict[str, object]:
    """What each worker process is sent, by name."""
    return {
        "dataset": dataset,
        "collate_fn": fixed.get("collate_fn"),
        "worker_init_fn": fixed.get("worker_init_fn"),
    }


def workers_unpicklable(problem: Problem) -> str | None:
    """What of ``problem`` a worker process could not be sent under its start method,
    in words, or ``None`` (see :func:`autoloader.checks.unpicklable`)."""
    return unpicklable(_sent_to_workers(problem.dataset, problem.fixed), problem.start_method)


def _checked_isolation(isolation: object, ranks: Ranks | None) -> Isolation:
    """``isolation``, checked, and refused where it cannot work: ``"subprocess"`` under
    torchrun."""
    checked = check_isolation(isolation)
    if ranks is not None and checked == "subprocess":
        raise InvalidInputError(
            'isolation="subprocess" does not work under torchrun: a trial\'s own '
            "process is not a rank of the job, and a step_fn with DDP collectives "
            'would wait there forever. Use isolation="in-process".'
        )
    return checked


# The parts of a problem's identity that each rank of a job may give its own: its
# dataset object (a rank's shard, a fault injected on one rank in a test), its step (and
# so their code's fingerprints), and
# the fixed loader options that hold objects (each rank's DistributedSampler). The job
# tunes one problem of one shape: the rest of the identity must be alike.
RANK_OWN_PARTS = frozenset(
    {"dataset", "step_fn", "fixed loader options", "dataset code", "step code"}
)


def shared_arguments(problem: Problem) -> tuple[Any, ...]:
    """What every rank of a job must give alike: the problem's identity but for
    ``RANK_OWN_PARTS`` (the device by its kind: each rank moves batches to its own,
    cuda:0, cuda:1...; the memory budget as given: :func:`agree` sizes it for the node
    after), and the run's own arguments."""
    parts = problem.identity(budget_as_given=True).parts()
    return (
        *(value for name, value in parts.items() if name not in RANK_OWN_PARTS),
        problem.batches_per_epoch, problem.budget, problem.n_trials, problem.seed,
        problem.isolation,
    )  # fmt: skip


def check_result_path(path: object, *, writes: bool) -> Path | None:
    """``path`` as a file path a result can be written to, or ``None``: refused before
    the first trial, not found after the budget, if it is a folder, holds a file that is
    not an autoloader result, or (where this process ``writes`` it: under torchrun rank
    0 alone) lies where no file can be created."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike):
        raise InvalidInputError(
            f"path must be a file path (str or os.PathLike), but got {type(path).__name__}."
        )
    result_path = Path(path)
    if result_path.is_dir():
        raise InvalidInputError(
            f"path {str(result_path)!r} is a directory; give the JSON file's path, "
            "e.g. path='loader.json'."
        )
    if result_path.exists():
        _check_replaceable(result_path)
    if writes:
        check_writable(result_path)
    return result_path


def _check_replaceable(path: Path) -> None:
    """Raise :class:`InvalidInputError` unless ``path`` holds a result autoloader may
    replace: a file of another kind (a mistyped path, a config file) is never
    overwritten, nor one a newer autoloader wrote. A result it cannot use (malformed,
    of another problem) is replaced by the run's."""
    try:  # not a regular file, or too large: refused, promptly (NOTE [ Reading a result file ])
        data = read_result_json(path)
    except ResultFileError:
        data = None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidInputError(
            f"path {str(path)!r} holds a file that is not an autoloader result; it "
            "would be overwritten. Give another path, or delete the file."
        )
    if version > SCHEMA_VERSION:
        raise InvalidInputError(
            f"path {str(path)!r} holds a result of schema version {version}, written by "
            f"a newer autoloader (this one writes {SCHEMA_VERSION}); it would be "
            "overwritten. Give another path, or upgrade autoloader."
        )


def agree(ranks: Ranks, problem: Problem) -> Problem:
    """Check that every rank of the job was given the same problem, and size the
    memory budget of the node's whole tree, every local rank's workers included."""
    agree_on_arguments(ranks, error=None, arguments=shared_arguments(problem))
    memory_bytes = node_memory_budget(ranks, problem.memory_budget)
    return dataclasses.replace(problem, memory_bytes=memory_bytes)
