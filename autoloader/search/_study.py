"""The study's identity (one name per tuning problem) and its storage."""

from __future__ import annotations

import hashlib
import os
import socket
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from torch.utils.data import (
    Dataset,
)

from autoloader._exceptions import InvalidInputError
from autoloader.checks._environment import Environment
from autoloader.search._space import SearchSpace


def study_name(
    dataset: Dataset[Any],
    step_fn: Callable[[Any], object],
    *,
    length: int | None,
    batch_size: int,
    space: SearchSpace,
    memory_budget: int | None,
    fixed_loader_kwargs: Mapping[str, Any],
    environment: Environment,
    device: torch.device | None,
) -> str:
    """A name that is the same for the same tuning problem, so a stored study resumes,
    and differs wherever a trial's outcome could: the dataset, the step, the batch size,
    the space, the memory budget (a setting pruned under 4 GiB may fit in 64), the
    fixed loader options, the device and the machine. A study shared by different
    problems would choose among trials that do not compare.

    The machine is this host, alone or on one node. A job of several nodes is named by
    its shape (ranks, ranks per node, nodes) and its nodes' kind, not by a host: a
    scheduler gives each job whichever nodes are free, and the next job of the same
    shape on nodes of the same kind resumes the study (``docs/multi_node.md``)."""
    host = socket.gethostname() if environment.nodes == 1 else f"{environment.nodes} nodes"
    machine = (
        environment.cpu_count,
        environment.usable_cpus,
        environment.memory_total,
        environment.torch_version,
        environment.accelerator,
        host,
        environment.world_size,
        environment.local_world_size,
    )
    fixed = sorted((name, _identity(value)) for name, value in fixed_loader_kwargs.items())
    problem = "|".join(
        map(
            str,
            (
                _identity(dataset),
                length,
                _identity(step_fn),
                batch_size,
                space.as_dict(),
                memory_budget,
                fixed,
                device,
                machine,
            ),
        )
    )
    digest = hashlib.sha256(problem.encode()).hexdigest()[:12]
    return f"autoloader-{type(dataset).__name__}-{digest}"


def problem_key(
    dataset: Dataset[Any],
    step_fn: Callable[[Any], object],
    *,
    length: int | None,
    batch_size: int,
    space: SearchSpace,
    memory_budget: int | None,
    fixed_loader_kwargs: Mapping[str, Any],
    device: torch.device | None,
) -> dict[str, str]:
    """The tuning problem by name, part by part, as a result file keeps it: a later run
    reuses the file's settings only where every part is the same (and the machine, which
    the file's environment tells), and names the parts that differ where not. The
    dataset, the step and objects among the fixed loader options are named by their
    type or function, as in :func:`study_name`."""
    fixed = sorted((name, _identity(value)) for name, value in fixed_loader_kwargs.items())
    return {
        "dataset": _identity(dataset),
        "dataset length": str(length),
        "step_fn": _identity(step_fn),
        "batch size": str(batch_size),
        "search space": str(space.as_dict()),
        "memory budget": str(memory_budget),
        "fixed loader options": str(fixed),
        # Its kind: under torchrun each rank has its own (cuda:0, cuda:1...).
        "device": str(None if device is None else device.type),
    }


def _identity(value: object) -> str:
    """What names a value across runs: a scalar itself, else its type or function name
    (a repr holds addresses that change with every process)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


# Seconds after which a journal file's lock, left by a killed tuning process, is broken.
_JOURNAL_LOCK_GRACE = 5
# NOTE [ Trials of other machines ]
# A trial left RUNNING by a dead tuning process on this machine is failed as soon as a
# run starts (its owner's pid is gone, see Search._fail_orphans). A process on another
# machine sharing the study cannot be looked up: while a trial runs, Optuna records a
# heartbeat every _HEARTBEAT_SECONDS, and any process starting a trial fails the trials
# whose heartbeat is older than _HEARTBEAT_GRACE seconds. A trial stays alive however
# long it measures; only a dead or frozen process stops its heartbeat.
_HEARTBEAT_SECONDS = 10
_HEARTBEAT_GRACE = 60


def open_storage(storage: object) -> str | optuna.storages.BaseStorage | None:
    """The Optuna storage for ``tune(storage=...)``.

    A storage object is used as given. A URL (``sqlite:///tuning.db``,
    ``postgresql://...``) opens a database with heartbeats (see
    ``NOTE [ Trials of other machines ]``); it is opened here, so a wrong URL or an
    unreachable server is reported before any work. A plain path is a journal file: no
    database needed, safe for several processes, and a lock left by a killed run is
    broken after a few seconds.
    """
    if storage is None or isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if isinstance(storage, str) and "://" in storage:
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    storage, heartbeat_interval=_HEARTBEAT_SECONDS, grace_period=_HEARTBEAT_GRACE
                )
        except Exception as error:  # a driver missing, a bad URL, a server down...
            raise InvalidInputError(
                f"storage {storage!r} cannot be opened ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); check the URL, that "
                "its database driver is installed and that the server is reachable."
            ) from error
    if isinstance(storage, str | os.PathLike):
        path = Path(storage)
        if not path.parent.is_dir():
            raise InvalidInputError(
                f"storage {str(storage)!r}: the folder {str(path.parent)!r} does not exist; "
                "create it, or give another path."
            )
        backend = JournalFileBackend(
            str(path), lock_obj=JournalFileOpenLock(str(path), grace_period=_JOURNAL_LOCK_GRACE)
        )
        return optuna.storages.JournalStorage(backend)
    raise InvalidInputError(
        f"storage must be None (in memory), a journal file path such as 'tuning.log', an "
        f"Optuna storage URL such as 'sqlite:///tuning.db', or an "
        f"optuna.storages.BaseStorage, but got {type(storage).__name__}."
    )
