"""The study's identity (one name per tuning problem) and its storage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import optuna
import torch
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from torch.utils.data import (
    Dataset,
)

from autoloader._exceptions import InvalidInputError, StorageError
from autoloader.checks import Environment
from autoloader.search._code import dataset_code, step_code
from autoloader.search._lease import HEARTBEAT_GRACE, HEARTBEAT_SECONDS
from autoloader.search._space import SearchSpace

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProblemIdentity:
    """What identifies a tuning problem: trials of two problems that differ in any of
    these do not compare. The one list from which the study's name (:func:`study_name`),
    the problem a result file keeps (:meth:`parts`) and what the ranks of a job must give
    alike (``shared_arguments`` in ``_problem.py``) all derive: a field added here is in
    all three.

    Attributes:
        dataset: named by its type (a repr holds addresses that change with every process).
        step_fn: named by its function or type.
        length: the dataset's length, ``None`` where it has none.
        batch_size: samples per batch.
        space: the search space (a setting outside one space is no trial of another).
        memory_budget: in bytes where one was asked for, else ``None`` (a default one
            moves with the memory free); a setting pruned under 4 GiB may fit in 64.
        fixed_loader_kwargs: the DataLoader options not tuned, objects among them named
            by their type or function.
        device: where the step runs.
        dataset_code: the fingerprint of the code that reads the dataset, and
        step_code: of the step's (``NOTE [ Code fingerprints ]``, in ``_code.py``): its
            type stays the same when its code changes.
    """

    dataset: Dataset[Any]
    step_fn: Callable[[Any], object]
    length: int | None
    batch_size: int
    space: SearchSpace
    memory_budget: int | str | None
    fixed_loader_kwargs: Mapping[str, Any]
    device: torch.device | None
    dataset_code: str
    step_code: str

    def parts(self, *, device_index: bool = False) -> dict[str, str]:
        """The problem by name, part by part, as a result file keeps it: a later run
        reuses the file's settings only where every part is the same (and the machine,
        which the file's environment tells), and names the parts that differ where not.

        The device by its kind (under torchrun each rank has its own: cuda:0,
        cuda:1...), or with ``device_index`` as given (the study's name, which a study
        stored before keeps)."""
        fixed = sorted((name, _identity(value)) for name, value in self.fixed_loader_kwargs.items())
        device = self.device if device_index or self.device is None else self.device.type
        return {
            "dataset": _identity(self.dataset),
            "dataset length": str(self.length),
            "step_fn": _identity(self.step_fn),
            "batch size": str(self.batch_size),
            "search space": str(self.space.as_dict()),
            "memory budget": str(self.memory_budget),
            "fixed loader options": str(fixed),
            "device": str(device),
            "dataset code": self.dataset_code,
            "step code": self.step_code,
        }


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
    """The name of the :class:`ProblemIdentity` of these arguments on this machine:
    :func:`name_of`."""
    identity = ProblemIdentity(
        dataset=dataset,
        step_fn=step_fn,
        length=length,
        batch_size=batch_size,
        space=space,
        memory_budget=memory_budget,
        fixed_loader_kwargs=fixed_loader_kwargs,
        device=device,
        dataset_code=dataset_code(dataset),
        step_code=step_code(step_fn),
    )
    return name_of(identity, environment)


def name_of(identity: ProblemIdentity, environment: Environment) -> str:
    """A name that is the same for the same tuning problem, so a stored study resumes,
    and differs wherever a trial's outcome could: every part of ``identity``, and the
    machine. A study shared by different problems would choose among trials that do not
    compare.

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
    problem = "|".join([*identity.parts(device_index=True).values(), str(machine)])
    digest = hashlib.sha256(problem.encode()).hexdigest()[:12]
    return f"autoloader-{type(identity.dataset).__name__}-{digest}"


def _identity(value: object) -> str:
    """What names a value across runs: a scalar itself, else its type or function name
    (a repr holds addresses that change with every process)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


# Seconds after which a journal file's lock, left by a killed tuning process, is broken.
_JOURNAL_LOCK_GRACE = 5
# Seconds before a database is opened again, where its first opening failed.
_SCHEMA_RACE_SECONDS = 1.0


def open_storage(storage: object) -> str | optuna.storages.BaseStorage | None:
    """The Optuna storage for ``tune(storage=...)``.

    A storage object is used as given. A URL (``sqlite:///tuning.db``,
    ``postgresql://...``) opens a database that keeps Optuna's trial heartbeats (see
    ``NOTE [ The study's lease ]``); it is opened here, so a wrong URL or an
    unreachable server is reported before any work. A plain path is a journal file: no
    database needed, safe for several processes, a lock left by a killed run is broken
    after a few seconds, and a last record torn by a killed writer is removed (see
    :func:`_repair_journal`).

    Raises:
        InvalidInputError: a storage of another type, a URL that cannot be opened, a
            journal file in a folder that does not exist.
        StorageError: a journal file that cannot be read back.
    """
    if storage is None or isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if isinstance(storage, str) and "://" in storage:
        # Only a database needs SQLAlchemy (Optuna's RDBStorage imports it as it opens
        # one): imported at the top, every process that imports autoloader paid for it.
        import sqlalchemy.exc

        try:
            try:
                return _database(storage)
            except sqlalchemy.exc.DBAPIError:
                # Runs that open a new database together race to create its tables: the
                # losers fail, and find them made a moment later.
                time.sleep(_SCHEMA_RACE_SECONDS)
                return _database(storage)
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
        lock = JournalFileOpenLock(str(path), grace_period=_JOURNAL_LOCK_GRACE)
        _repair_journal(path, lock)
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
        except ValueError as error:  # json.JSONDecodeError is one
            raise StorageError(_unreadable_journal(path, error)) from error
    raise InvalidInputError(
        f"storage must be None (in memory), a journal file path such as 'tuning.log', an "
        f"Optuna storage URL such as 'sqlite:///tuning.db', or an "
        f"optuna.storages.BaseStorage, but got {type(storage).__name__}."
    )


def _database(url: str) -> optuna.storages.RDBStorage:
    with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=HEARTBEAT_SECONDS, grace_period=HEARTBEAT_GRACE
        )


# NOTE [ A torn journal ]
# Optuna appends each record to a journal file as one line, under the journal's lock. A
# writer killed mid-write (or a full disk, a power cut) leaves a last line without its
# newline. Optuna's reader skips a last line it cannot parse, but the next record is
# appended to it: the line becomes two records glued, which no reader can parse, and as
# soon as another line follows, every run fails with a JSONDecodeError. A last line that
# is not one whole record was never read by anyone (readers skip it), so dropping it
# loses nothing any run has seen: it is cut, under the lock, before any record is
# written. A broken line inside the file (glued before this repair existed) has been
# skipped by no one: the error names it and says what to do.
_RECORD_START = b'{"op_code":'


def _repair_journal(path: Path, lock: JournalFileOpenLock) -> None:
    """Cut a torn last line off the journal file at ``path`` (``NOTE [ A torn journal ]``),
    under the journal's lock: a live writer's line is whole once it lets go.

    Raises:
        StorageError: the file is not a journal (its first line is not a record): it is
            left as it is, where Optuna would have appended records to it.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    lock.acquire()
    try:
        with open(path, "rb+") as file:
            if file.read(len(_RECORD_START)) != _RECORD_START:
                raise StorageError(
                    f"storage {str(path)!r} is not an Optuna journal file (its first line is "
                    "not a journal record), and autoloader would write into it: give the path "
                    "of a journal file, or of a new file."
                )
            size = file.seek(0, os.SEEK_END)
            end = _last_line_start(file, size)
            file.seek(end)
            last = file.read(size - end)
            if last.endswith(b"\n") and _is_record(last):
                return
            file.truncate(end)
    finally:
        lock.release()
    _logger.warning(
        "the journal file %s ended with an incomplete record (%d bytes, left by a run "
        "stopped while writing it): removed it; the %d bytes of records before it are kept, "
        "as every run read them",
        path,
        size - end,
        end,
    )


def _last_line_start(file: BinaryIO, size: int) -> int:
    """Where the last line of ``file`` (of ``size`` bytes) starts."""
    end = size - 1  # its own newline, if it has one, is not the one before it
    while end > 0:
        start = max(0, end - 65536)
        file.seek(start)
        newline = file.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _unreadable_journal(path: Path, error: ValueError) -> str:
    """What to do about a journal file Optuna cannot read: which line is broken."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            try:
                json.loads(line)
            except ValueError:
                return (
                    f"The journal file {str(path)!r} cannot be read: its line {number} is not "
                    f"one whole record ({type(error).__name__}: {error}); a run was likely "
                    "stopped while writing it and another wrote after it. Delete that line "
                    "to keep the other trials (each line is one record), or move the file "
                    "aside to start the study afresh."
                )
    return (
        f"The journal file {str(path)!r} cannot be read ({type(error).__name__}: {error}); "
        "move it aside to start the study afresh."
    )
