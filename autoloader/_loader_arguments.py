"""AutoLoader's arguments, checked at construction: whether it can tune them
(:func:`untuned_because`), the tuned ones DataLoader's defaults
(:func:`checked_batch_size`), the workers' start method it takes without workers
(:func:`checked_context`), and those of a copy of an AutoLoader, Lightning's rebuild of it
(:func:`check_copied_settings`, :func:`pass_tuning_to_rebuilds`; ``NOTE [ A rebuilt
AutoLoader ]``).
"""

from __future__ import annotations

import multiprocessing.context
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from autoloader._exceptions import InvalidInputError
from autoloader._loop_loaders import shown_setting
from autoloader._loop_tuning import LoopTuning
from autoloader.loader import DATALOADER_DEFAULTS
from autoloader.search import SearchSpace

# DataLoader's arguments that AutoLoader chooses: given, each must have DataLoader's default.
_TUNED_ARGUMENTS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")


def untuned_because(
    dataset: object, batch_size: int | None, options: Mapping[str, Any], tuning: LoopTuning | None
) -> str | None:
    """Why AutoLoader cannot tune these arguments (``options``: its other DataLoader
    arguments after ``dataset`` and ``batch_size``, by name; ``tuning``: that of the
    AutoLoader this one copies), or ``None`` where it can. Each setting takes turns at
    the epoch's batches of indices, in the sampler's order (``NOTE [ Every batch once ]``):
    a copy's batch_sampler too, where its batches are the size its tuning measures
    (``NOTE [ A rebuilt AutoLoader ]``)."""
    if isinstance(dataset, IterableDataset):
        return (
            "an IterableDataset has no batches of indices for the settings to take turns "
            "at (autoloader.tune() and result.make_loader() tune one)"
        )
    batch_sampler = options["batch_sampler"]
    if batch_sampler is not None:
        measured = None if tuning is None else tuning.problem.batch_size
        if measured is None or getattr(batch_sampler, "batch_size", None) != measured:
            return "it takes batch_size and a per-item sampler, not a batch_sampler"
    elif batch_size is None:
        return "it times the loop in batches, and batch_size=None loads items one at a time"
    if options["in_order"] is not True:
        return (
            "out of order (in_order=False), a setting that fails could not say which "
            "batches it had delivered"
        )
    return None


def checked_batch_size(batch_size: int | None, options: Mapping[str, Any]) -> int:
    """``batch_size``, once AutoLoader takes its arguments to tune (``options``: its
    other DataLoader arguments after ``dataset``, by name).

    Raises:
        InvalidInputError: for a tuned argument given.
    """
    for name in _TUNED_ARGUMENTS:
        value = options[name]
        if value != DATALOADER_DEFAULTS[name]:
            raise InvalidInputError(
                f"AutoLoader chooses {name} itself, but got {name}={value!r}. Remove it; to "
                f"search only some values pass search_space={{{name!r}: ...}}, or use a "
                "DataLoader with your own setting."
            )
    assert batch_size is not None, "batch_size=None is passed through"
    return batch_size


def kept(options: Mapping[str, Any]) -> dict[str, Any]:
    """What of ``options`` AutoLoader gives DataLoader's own ``__init__``, which it calls
    without workers: all but the tuned arguments and the workers' start method."""
    return {
        name: value
        for name, value in options.items()
        if name not in _TUNED_ARGUMENTS and name != "multiprocessing_context"
    }


def checked_context(context: Any) -> Any:
    """``multiprocessing_context`` as DataLoader checks and keeps it with workers (a start
    method's name becomes its context): AutoLoader takes it without them, for the
    settings with worker processes (``NOTE [ A rebuilt AutoLoader ]`` says why).

    Raises:
        ValueError, TypeError: DataLoader's own, for a context DataLoader refuses.
    """
    if context is None:
        return None
    if isinstance(context, str):
        methods = torch.multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        return torch.multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context!r}"
        )
    return context


def workers_only(space: SearchSpace) -> bool:
    """Whether every setting ``space`` lets AutoLoader choose loads with workers: only
    then does a ``multiprocessing_context`` have a use, as DataLoader asks of it."""
    workers = space.num_workers
    low = workers[0] if isinstance(workers, tuple) else workers
    return low is not None and low > 0


def check_copied_settings(tuning: LoopTuning, options: Mapping[str, Any]) -> None:
    """A copy of an AutoLoader (``NOTE [ A rebuilt AutoLoader ]``) is given the tuned
    arguments its original shows (DataLoader's defaults, or once tuned the chosen
    setting's, which the copy shows too) and its original's start method, if any.

    Raises:
        InvalidInputError: for another value.
    """
    shown = {} if tuning.chosen is None else shown_setting(tuning.chosen)
    for name in _TUNED_ARGUMENTS:
        value, default = options[name], DATALOADER_DEFAULTS[name]
        if value == default or (name in shown and value == shown[name]):
            continue
        raise InvalidInputError(
            f"AutoLoader chooses {name} itself, but got {name}={value!r} for a copy of an "
            f"AutoLoader (tuning=...), whose tuning chose {shown.get(name, default)!r}. "
            f"Leave {name} out: the copy takes its original's setting."
        )
    context = options["multiprocessing_context"]
    original = tuning.problem.fixed.get("multiprocessing_context")
    if context is not None and _start_method(context) != _start_method(original):
        raise InvalidInputError(
            f"a copy of an AutoLoader (tuning=...) starts workers as its original does "
            f"({_start_method(original) or 'the default start method'}), but got "
            f"multiprocessing_context={context!r}. Leave it out, or make a new AutoLoader."
        )


def _start_method(context: Any) -> str | None:
    """The start method of a ``multiprocessing_context`` as DataLoader takes it."""
    if context is None or isinstance(context, str):
        return context
    return str(context.get_start_method())


def pass_tuning_to_rebuilds(loader: DataLoader[Any], tuning: LoopTuning) -> None:
    """Make Lightning's rebuild of ``loader``, where Lightning recorded its arguments to
    rebuild it from (it was made in a ``*_dataloader`` hook), a copy that shares
    ``tuning`` (``NOTE [ A rebuilt AutoLoader ]``). Elsewhere it is rebuilt from the
    loader's attributes, ``loader.tuning`` among them."""
    if "lightning" not in sys.modules:
        return  # nothing recorded its arguments
    try:
        from autoloader._lightning_compat import pass_on_to_rebuilds
    except ImportError:  # a Lightning autoloader.lightning does not support
        return
    pass_on_to_rebuilds(loader, tuning=tuning)


# NOTE [ A rebuilt AutoLoader ]
# Lightning (and Fabric) rebuild a DataLoader subclass to put in a sampler of their own:
# a DistributedSampler in a distributed fit (training and validation), and, to predict,
# a batch sampler that records the indices it hands out. They call the class again,
# ``type(loader)(**arguments)``, with the arguments Lightning recorded where the loader
# was made in a ``*_dataloader`` hook, else with its public attributes named as
# ``__init__``'s parameters; the user keeps the original, the loop gets the copy. A
# fresh AutoLoader would tune again from nothing while the user's object says "0
# trials", and an attribute showing the tuned setting (``num_workers=2``) would be
# refused as an argument AutoLoader chooses itself. So an AutoLoader passes on its
# tuning (the LoopTuning: one search, its result, its kept workers) as its attribute
# ``tuning`` and, where its class takes that argument, in the arguments Lightning
# recorded (``_lightning_compat.py``). The copy, given ``tuning=``, loads through it:
# one search per process (under DDP each rank's copy through its rank's tuning, the
# ranks searching together as under torchrun), seen alike from original and copy
# (``result``, ``history``, ``report()``, the chosen ``num_workers``). The epoch is
# the iterated loader's (its sampler's order and length: a rank's share), the problem
# planned for it at the first batch. A copy takes the tuned arguments its original
# shows and refuses others; its batch_sampler, where its batches are the size the
# tuning measures (Lightning's predict wrapper around the original's), is tuned as a
# sampler's batches are. The kept loader's persistent workers stop when the last of
# original and copies goes.
# The workers' ``multiprocessing_context`` is read back as an attribute too, and kept.
# DataLoader takes one with workers only, where something uses it; AutoLoader, which
# chooses the workers, takes one where every setting it may choose has worker
# processes (a search space of ``num_workers`` from 1): a start method is the one option
# a loader of the user's cannot be converted without (the process's own start method,
# the alternative, changes it for all else the process starts), and DataLoader's
# refusal of one that nothing would use holds (PyTorch's conformance test of it passes).
