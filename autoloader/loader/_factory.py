"""DataLoaders from tuned settings, the user's fixed options and overrides."""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, Dataset

from autoloader._exceptions import InvalidInputError
from autoloader.loader._batched import batched_loader_kwargs
from autoloader.loader._params import normalize_params
from autoloader.loader._thread_loader import ThreadLoader
from autoloader.loader._worker_process import forked_worker_kwargs
from autoloader.loader._worker_threads import LimitThreads

# Tuned settings that are not DataLoader options but change how the loader is built.
_BUILD_OPTIONS = ("batched_fetch", "worker_threads")


def merge_loader_kwargs(
    params: Mapping[str, Any],
    *,
    batch_size: int,
    fixed: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings and options of a loader, in canonical form; overrides win.

    Worker-only options (``prefetch_factor``, ``persistent_workers``,
    ``multiprocessing_context``...) are dropped when the result has no workers: DataLoader
    rejects them then, and a baseline or an override of ``num_workers=0`` must still
    give a valid loader. Pass the result to :func:`build_loader`.
    """
    merged: dict[str, Any] = {
        "batch_size": batch_size,
        **(fixed or {}),
        **params,
        **(overrides or {}),
    }
    merged.update(normalize_params(merged))
    if merged["num_workers"] == 0:
        merged.pop("prefetch_factor", None)
        merged.pop("multiprocessing_context", None)
        merged["persistent_workers"] = False
    if merged["worker_kind"] == "threads":
        merged.pop("multiprocessing_context", None)  # no process is started
    return merged


def build_loader(dataset: Dataset[Any], options: Mapping[str, Any]) -> DataLoader[Any]:
    """A DataLoader over ``dataset`` from :func:`merge_loader_kwargs` output (see
    :func:`dataloader_kwargs`): a :class:`ThreadLoader` for thread workers."""
    return new_loader(
        dataset, dataloader_kwargs(dataset, options), threads=options["worker_kind"] == "threads"
    )


def new_loader(
    dataset: Dataset[Any], kwargs: Mapping[str, Any], *, threads: bool = False
) -> DataLoader[Any]:
    """``DataLoader(dataset, **kwargs)``, or ``ThreadLoader`` with ``threads``, without
    torch's warning about more workers than cores: trials use them on purpose, and a
    tuned count was measured to pay."""
    if not threads:
        kwargs = forked_worker_kwargs(kwargs, default_start_method())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        if threads:
            return ThreadLoader(dataset, **kwargs)
        return DataLoader(dataset, **kwargs)


def dataloader_kwargs(dataset: Dataset[Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """``DataLoader(dataset, **kwargs)`` options from :func:`merge_loader_kwargs` output.

    ``batched_fetch`` turns the batch size and sampling options into a ``BatchSampler``
    (see ``NOTE [ Batched fetch ]``); ``worker_threads`` wraps the ``worker_init_fn``
    (see ``NOTE [ Worker threads ]``).

    The worker kind is not an option: with ``worker_kind="threads"`` the result is for
    :class:`ThreadLoader` (see :func:`new_loader`). Nor is ``step_threads``, the training
    process's own threads: the caller sets them (see ``NOTE [ Step threads ]``).

    Raises:
        InvalidInputError: the options do not go together (``batched_fetch`` with a
            ``collate_fn``, or without the dataset its sampler needs).
    """
    kwargs = dict(options)
    kwargs.pop("worker_kind", None)
    # A setting of the training process, which no loader can carry (NOTE [ Step threads ]).
    kwargs.pop("step_threads", None)
    batched, threads = (kwargs.pop(name, None) for name in _BUILD_OPTIONS)
    if threads is not None:
        kwargs["worker_init_fn"] = LimitThreads(threads, kwargs.get("worker_init_fn"))
    if batched:
        if dataset is None:
            raise InvalidInputError(
                "these settings fetch whole batches (batched_fetch=True), which needs a "
                "sampler over the dataset: pass the dataset, or use make_loader(dataset)."
            )
        kwargs = batched_loader_kwargs(dataset, kwargs)
    return kwargs


def default_start_method() -> str:
    """The start method workers get when ``multiprocessing_context`` is not given.

    Reads it without fixing it: ``multiprocessing.get_start_method()`` would set the
    process-wide default as a side effect.
    """
    return (
        multiprocessing.get_start_method(allow_none=True)
        or (multiprocessing.get_all_start_methods()[0])
    )
