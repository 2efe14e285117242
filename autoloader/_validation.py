"""Checks of ``tune()``'s arguments, done before any loader is built or trial run."""

from __future__ import annotations

import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autoloader._exceptions import InvalidInputError, UnpicklableError
from autoloader._loader import build_loader, merge_loader_kwargs
from autoloader._search_space import BASELINE_PARAMS, TUNED_KEYS, SearchSpace

# Start methods that pickle the dataset and collate_fn into each worker; under "fork"
# workers inherit them and nothing needs to pickle.
_PICKLING_START_METHODS = frozenset({"spawn", "forkserver"})
# How deep the search for the unpicklable part of an object goes.
_MAX_PICKLE_DEPTH = 6


def check_dataset(dataset: object) -> int | None:
    """Return the dataset's length (``None`` for an iterable dataset without one)."""
    if isinstance(dataset, IterableDataset):
        try:
            return len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
    if isinstance(dataset, DataLoader):
        raise InvalidInputError(
            "dataset is a DataLoader; pass its dataset (loader.dataset) and put its fixed "
            "options (shuffle, collate_fn...) in loader_kwargs."
        )
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise InvalidInputError(
            f"dataset must be a torch.utils.data.Dataset (map-style with __getitem__ and "
            f"__len__, or an IterableDataset), but got {type(dataset).__name__}."
        )
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        raise InvalidInputError(
            f"{type(dataset).__name__} is a map-style dataset without __len__: the sampler "
            "cannot enumerate it. Define __len__, or make it an IterableDataset."
        ) from None
    if length == 0:
        raise InvalidInputError(f"{type(dataset).__name__} is empty: there is nothing to load.")
    return length


def check_batch_size(batch_size: object, dataset_length: int | None) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InvalidInputError(
            f"batch_size must be a positive int, but got {type(batch_size).__name__} "
            f"{batch_size!r}."
        )
    if batch_size <= 0:
        raise InvalidInputError(f"batch_size must be positive but got {batch_size}.")
    if dataset_length is not None and batch_size > dataset_length:
        raise InvalidInputError(
            f"batch_size {batch_size} is larger than the dataset ({dataset_length} items); "
            "use a batch size no larger than the dataset."
        )
    return batch_size


def check_step_fn(step_fn: object) -> Callable[[Any], object]:
    if not callable(step_fn):
        raise InvalidInputError(
            f"step_fn must be callable (it receives one batch and runs the training step), "
            f"but got {type(step_fn).__name__} {step_fn!r}."
        )
    return step_fn


def check_positive_number(name: str, value: object, *, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidInputError(f"{name} must be a number, but got {value!r}.{hint}")
    if value <= 0:
        raise InvalidInputError(f"{name} must be positive but got {value!r}.{hint}")
    return float(value)


def check_n_trials(n_trials: object) -> int | None:
    if n_trials is None:
        return None
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials <= 0:
        raise InvalidInputError(
            f"n_trials must be a positive int or None (no cap), but got {n_trials!r}."
        )
    return n_trials


def check_search_space(search_space: object) -> SearchSpace:
    if search_space is None:
        return SearchSpace()
    if isinstance(search_space, SearchSpace):
        return search_space
    if isinstance(search_space, Mapping):
        return SearchSpace.from_dict(search_space)
    raise InvalidInputError(
        f"search_space must be an autoloader.SearchSpace or a dict of its fields, but got "
        f"{type(search_space).__name__}."
    )


def check_loader_kwargs(loader_kwargs: object) -> dict[str, Any]:
    if loader_kwargs is None:
        return {}
    if not isinstance(loader_kwargs, Mapping):
        raise InvalidInputError(
            f"loader_kwargs must be a dict of DataLoader options, but got "
            f"{type(loader_kwargs).__name__}."
        )
    for key in loader_kwargs:
        if key in TUNED_KEYS:
            raise InvalidInputError(
                f"loader_kwargs sets {key!r}, which autoloader tunes. Remove it, or fix it "
                f"through the search space: SearchSpace({key}={loader_kwargs[key]!r})."
            )
        if key in ("batch_size", "dataset"):
            raise InvalidInputError(
                f"loader_kwargs sets {key!r}; pass it as tune()'s own argument instead."
            )
        if key == "batch_sampler":
            raise InvalidInputError(
                "loader_kwargs sets 'batch_sampler', which fixes the batch size; pass "
                "batch_size and a per-item 'sampler' instead."
            )
    return dict(loader_kwargs)


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


def count_batches(dataset: Dataset[Any], batch_size: int, fixed: Mapping[str, Any]) -> int | None:
    """Build the user's loader once, without workers, and return its length in batches.

    This is where DataLoader itself rejects option combinations (a sampler with
    shuffle, shuffle with an IterableDataset...), so its message reaches the user
    before the run starts.
    """
    try:
        loader = build_loader(
            dataset, merge_loader_kwargs(BASELINE_PARAMS, batch_size=batch_size, fixed=fixed)
        )
    except (TypeError, ValueError) as error:
        raise InvalidInputError(f"DataLoader rejected loader_kwargs: {error}") from error
    try:
        return len(loader)
    except TypeError:
        return None


def start_method(fixed: Mapping[str, Any], default: str) -> str:
    context = fixed.get("multiprocessing_context")
    if context is None:
        return default
    if isinstance(context, str):
        return context
    name: str = context.get_start_method()
    return name


def check_picklable(objects: Mapping[str, object], method: str) -> None:
    """Under spawn/forkserver, check that what the workers receive can be pickled.

    Raises:
        UnpicklableError: naming the innermost attribute that fails to pickle.
    """
    if method not in _PICKLING_START_METHODS:
        return
    for name, obj in objects.items():
        if obj is not None and _dumps(obj) is not None:
            raise UnpicklableError(
                f"{describe_unpicklable(obj, name)}, but the {method!r} start method "
                f"pickles {name} into every worker. Replace lambdas and local functions "
                "with module-level ones, open files and connections lazily in the worker, "
                "or pass loader_kwargs={'multiprocessing_context': 'fork'}."
            )


ISOLATIONS = ("in-process", "subprocess")


def check_isolation(isolation: object) -> str:
    if isolation not in ISOLATIONS:
        raise InvalidInputError(
            f"isolation must be one of {', '.join(map(repr, ISOLATIONS))}, but got {isolation!r}."
        )
    return str(isolation)


Dumps = Callable[[object], object]


def describe_unpicklable(obj: object, name: str, dumps: Dumps = ForkingPickler.dumps) -> str:
    """``"dataset.pipeline.transform (function) cannot be pickled (...)"``: the innermost
    attribute of ``obj`` that ``dumps`` fails on, or ``obj`` itself."""
    found = _find_unpicklable(obj, name, depth=0, dumps=dumps)
    path, error = found or (name, "unknown reason")
    return f"{path} cannot be pickled ({error})"


def _dumps(obj: object, dumps: Dumps = ForkingPickler.dumps) -> BaseException | None:
    try:
        dumps(obj)
    except Exception as error:  # pickling can raise almost anything
        return error
    return None


def _children(obj: object) -> Iterator[tuple[str, object]]:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    else:
        for key, value in getattr(obj, "__dict__", {}).items():
            yield f".{key}", value
        for key in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, key):
                yield f".{key}", getattr(obj, key)


def _find_unpicklable(obj: object, path: str, depth: int, dumps: Dumps) -> tuple[str, str] | None:
    error = _dumps(obj, dumps)
    if error is None:
        return None
    if depth < _MAX_PICKLE_DEPTH:
        for suffix, child in _children(obj):
            found = _find_unpicklable(child, path + suffix, depth + 1, dumps)
            if found is not None:
                return found
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, pickle.PicklingError | AttributeError | TypeError):
        reason = str(error)
    return f"{path} ({type(obj).__name__})", reason
