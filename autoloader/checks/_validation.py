"""Checks of ``tune()``'s arguments, done before any loader is built or trial run."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from torch.utils.data import DataLoader, Dataset, IterableDataset

from autoloader._exceptions import InvalidInputError, UnpicklableError
from autoloader.loader import (
    BASELINE_PARAMS,
    TUNED_KEYS,
    build_loader,
    merge_loader_kwargs,
)
from autoloader.measure import _dumps, describe_unpicklable

# Start methods that pickle the dataset and collate_fn into each worker; under "fork"
# workers inherit them and nothing needs to pickle.
_PICKLING_START_METHODS = frozenset({"spawn", "forkserver"})


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


# NOTE [ The longest time ]
# A time given in seconds becomes deadlines (time.monotonic() + seconds), alarms
# (signal.setitimer) and waits (Event.wait, Popen.wait), which Python turns into C
# timestamps: infinity converts to none of them and 1e10 s (317 years) is past
# time_t's range, so each raised OverflowError from deep inside a run. No tuning run,
# diagnosis or DataLoader timeout needs more than a week: a time is refused past
# MAX_SECONDS, and any that is not a finite number, before any work starts.
MAX_SECONDS = 7 * 24 * 3600.0
_MAX_SECONDS_WORDS = f"{MAX_SECONDS:.0f} s (a week)"


def check_seconds(name: str, value: object, *, hint: str = "", zero: bool = False) -> float:
    """``value`` as a number of seconds: positive (or 0 where ``zero``), finite and at most
    ``MAX_SECONDS`` (see ``NOTE [ The longest time ]``).

    Raises:
        InvalidInputError: naming ``name``, the value and the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidInputError(f"{name} must be a number, but got {value!r}.{hint}")
    if value < 0 or (value == 0 and not zero):
        rule = "must not be negative" if zero else "must be positive"
        raise InvalidInputError(f"{name} {rule} but got {value!r}.{hint}")
    if value > MAX_SECONDS:
        raise InvalidInputError(
            f"{name} is {value!r}, but it must be a finite number of seconds, at most "
            f"{_MAX_SECONDS_WORDS}.{hint}"
        )
    return float(value)


def env_int(name: str, *, default: int, least: int, most: int | None = None, why: str) -> int:
    """The environment variable ``name`` as an int from ``least`` to ``most``, or
    ``default`` where it is unset; ``why`` says what sets it and what it means.

    Raises:
        InvalidInputError: naming the variable, its value and what it must be.
    """
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        rule = f"an int >= {least}" if most is None else f"an int from {least} to {most}"
        raise InvalidInputError(
            f"environment variable {name} is {text!r}, but it must be {rule} ({why}). "
            f"Correct it, or unset it."
        )
    return value


def check_n_trials(n_trials: object) -> int | None:
    if n_trials is None:
        return None
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials <= 0:
        raise InvalidInputError(
            f"n_trials must be a positive int or None (no cap), but got {n_trials!r}."
        )
    return n_trials


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
    if "timeout" in loader_kwargs:  # DataLoader's wait for a batch: see NOTE [ The longest time ]
        check_seconds(
            "loader_kwargs['timeout']",
            loader_kwargs["timeout"],
            hint=" It is the seconds DataLoader waits for a batch from its workers (0: no limit).",
            zero=True,
        )
    return dict(loader_kwargs)


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


def unpicklable(objects: Mapping[str, object], method: str) -> str | None:
    """Under spawn/forkserver, what of ``objects`` (by name) a worker process could not
    be sent, pickled as the start method pickles it (``worker_dumps``: multiprocessing's
    own objects, a ``Value`` or a ``Lock``, pickle as they do into a real worker);
    ``None`` where all can be, or under fork, where workers inherit them.
    ``"dataset.transform (function) cannot be pickled (...), but the 'spawn' start
    method pickles dataset into every worker"``."""
    if method not in _PICKLING_START_METHODS:
        return None
    for name, obj in objects.items():
        if obj is not None and _dumps(obj) is not None:
            return (
                f"{describe_unpicklable(obj, name)}, but the {method!r} start method "
                f"pickles {name} into every worker"
            )
    return None


def check_picklable(objects: Mapping[str, object], method: str) -> None:
    """Under spawn/forkserver, check that what the workers receive can be pickled.

    Raises:
        UnpicklableError: naming the innermost attribute that fails to pickle.
    """
    problem = unpicklable(objects, method)
    if problem is not None:
        raise UnpicklableError(
            f"{problem}. Replace lambdas and local functions with module-level ones, open "
            "files and connections lazily in the worker, or pass "
            "loader_kwargs={'multiprocessing_context': 'fork'}."
        )


# Where trials run: here, or each in a fresh process (measure/_isolation.py).
Isolation = Literal["in-process", "subprocess"]
ISOLATIONS: tuple[Isolation, ...] = get_args(Isolation)


def check_isolation(isolation: object) -> Isolation:
    for known in ISOLATIONS:
        if isolation == known:
            return known
    raise InvalidInputError(
        f"isolation must be one of {', '.join(map(repr, ISOLATIONS))}, but got {isolation!r}."
    )
