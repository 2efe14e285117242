"""``AutoLoader`` under Hugging Face accelerate: :func:`prepare`.

Imported on demand (``from autoloader.accelerate import prepare``), never by
``import autoloader``: accelerate is an optional extra,
``pip install "torch-autoloader[accelerate]"``.

NOTE [ AutoLoader under accelerate ]
``accelerator.prepare()`` builds, for each ``DataLoader`` it is given, a
``DataLoaderShard`` around a plain ``DataLoader`` made from the given one's attributes:
its dataset, its collate_fn, its generator and the batch sampler accelerate chose (this
process's share of the given loader's batches, ``BatchSamplerShard``, with a seedable
sampler where it is asked to). A ``DataLoader`` subclass comes back a plain
``DataLoader``: an ``AutoLoader`` would load untuned, with ``num_workers=0``, and no
hook of accelerate's builds another class. So a tuning AutoLoader refuses accelerate's
``prepare()``, in the user's call (it answers accelerate's question whether it was
prepared already, ``_is_accelerate_prepared``, with the error that names this route),
and :func:`prepare` here hands accelerate a plain stand-in instead: a ``DataLoader`` of
the AutoLoader's own sampler, batch size, collate_fn, generator and the rest, the
objects themselves, so that what accelerate changes in them (a sampler's generator, a
seedable sampler) is the AutoLoader's too. In the ``DataLoaderShard`` accelerate builds
from it, the AutoLoader then takes the stand-in's place as ``base_dataloader`` and loads
from the next epoch on the batches of the batch sampler accelerate chose; the
``DataLoaderShard`` does the rest as for any loader: it synchronises the random states
of the processes, sets the sampler's epoch, moves each batch to the device and tells
accelerate's gradient state where the epoch ends. The prepared loader passes what it
does not have on to the AutoLoader (``loader.result``, ``loader.report()``), and is an
``AutoLoader`` to ``isinstance``.

Under several processes the ranks tune together (``NOTE [ Joint segments ]``), which
needs epochs of one length on every rank: accelerate's ``even_batches=True`` (its
default). Where one process loads the batches for all (``dispatch_batches=True``) or
the loader must be a torchdata ``StatefulDataLoader``, it is refused; so is an
AutoLoader told of another device than the one accelerate moves its batches to, since
it tunes for the device it is told of. accelerate's ``skip_first_batches()`` (a
Trainer resumed mid-epoch) builds a plain loader from the prepared one's attributes
too: the rest of that one epoch loads untuned, with ``num_workers=0``, and the
AutoLoader takes the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from autoloader._autoloader import AutoLoader
from autoloader._exceptions import InvalidInputError

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["prepare"]


def prepare(
    accelerator: Accelerator, *objects: Any, device_placement: Sequence[bool] | None = None
) -> Any:
    """``accelerator.prepare(*objects)``, with each tuning :class:`~autoloader.AutoLoader`
    among ``objects`` tuning on in the loader prepared for it.

    Takes and returns what ``Accelerator.prepare()`` does (one object for one given).
    accelerate prepares a loader for each AutoLoader as for a ``DataLoader``: this
    process's share of its batches, moved to the accelerator's device. The AutoLoader
    loads them, and tunes while it does (see ``NOTE [ AutoLoader under accelerate ]`` in
    this module); the prepared loader answers for it (``loader.result``,
    ``loader.report()``). Prepare an AutoLoader before its first epoch: the batches
    accelerate chose are loaded from its next epoch on. An AutoLoader that does not
    tune (:attr:`AutoLoader.untuned`) is prepared as a ``DataLoader``.

    Args:
        accelerator (accelerate.Accelerator): the accelerator that prepares.
        *objects: what ``accelerator.prepare()`` takes: models, optimizers, loaders
            (AutoLoaders among them) and schedulers.
        device_placement (list of bool, optional): as ``accelerator.prepare()``'s.

    Returns:
        What ``accelerator.prepare(*objects)`` returns.

    Raises:
        InvalidInputError: before anything is prepared, for an AutoLoader told of
            another device than the one accelerate moves its batches to (make it with
            ``device=accelerator.device``), or that accelerate's configuration would
            load some other way: its batches
            dispatched from one process (``dispatch_batches=True``), uneven epochs
            across processes (``even_batches=False``), a torchdata
            ``StatefulDataLoader`` (``use_stateful_dataloader=True``). Or any error of
            ``accelerator.prepare()``.

    Example::

        import autoloader.accelerate

        loader = autoloader.AutoLoader(dataset, batch_size=64, shuffle=True)
        model, optimizer, loader = autoloader.accelerate.prepare(
            accelerator, model, optimizer, loader
        )
        for batch in loader:  # this process's batches, on accelerator.device
            ...
    """
    tuning = {
        position: item
        for position, item in enumerate(objects)
        # The type itself: a loader accelerate prepared passes for its base's class.
        if issubclass(type(item), AutoLoader) and item.untuned is None
    }
    if tuning:
        _check(accelerator)
    for position, loader in tuning.items():
        placed = None if device_placement is None else device_placement[position]
        _check_device(
            accelerator, loader, accelerator.device_placement if placed is None else placed
        )
    given = [
        _stand_in(item) if position in tuning else item for position, item in enumerate(objects)
    ]
    prepared = accelerator.prepare(*given, device_placement=device_placement)
    results = list(prepared) if len(objects) > 1 else [prepared]
    for position, loader in tuning.items():
        _install(loader, results[position])
    return prepared


def _check(accelerator: Accelerator) -> None:
    """Refuse what accelerate's configuration would load otherwise than by each
    process's AutoLoader over its share of the batches."""
    if accelerator.dispatch_batches:
        raise InvalidInputError(
            "accelerate dispatches the batches (dispatch_batches=True): one process loads "
            "them all and sends each its share, so no AutoLoader of a process would load "
            "them. Let each process load its own: Accelerator(dataloader_config="
            "DataLoaderConfiguration(dispatch_batches=False)), the default for a dataset "
            "that is not an IterableDataset."
        )
    if accelerator.num_processes > 1 and not accelerator.even_batches:
        raise InvalidInputError(
            "with even_batches=False the processes' epochs may differ in length, but "
            "AutoLoader's ranks switch settings at the same batches and need epochs of one "
            "length (NOTE [ Joint segments ]). Use even_batches=True (accelerate's default)."
        )
    if accelerator.use_stateful_dataloader:
        raise InvalidInputError(
            "AutoLoader is not a torchdata StatefulDataLoader, which "
            "use_stateful_dataloader=True asks for. Prepare it without: "
            "DataLoaderConfiguration(use_stateful_dataloader=False)."
        )


def _check_device(accelerator: Accelerator, loader: AutoLoader[Any], placed: bool) -> None:
    """Refuse an AutoLoader told of another device than the one accelerate moves its
    batches to: it tunes for the device it is told of (``pin_memory``, whether the
    step's threads are searched)."""
    target = torch.device(accelerator.device)
    told = None if loader.device is None else torch.device(loader.device)
    if placed and target.type != "cpu" and (told is None or told.type != target.type):
        raise InvalidInputError(
            f"accelerate moves this AutoLoader's batches to {target}, but the AutoLoader "
            f"was told device={loader.device!r}, and tunes for that device (whether "
            "pin_memory helps, whether the step's threads are searched). Make it with "
            "AutoLoader(..., device=accelerator.device)."
        )


def _stand_in(loader: AutoLoader[Any]) -> DataLoader[Any]:
    """A plain DataLoader of ``loader``'s batches (its own sampler, generator and
    the rest, the objects themselves), for accelerate to prepare in its place."""
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        pin_memory_device=loader.pin_memory_device,
    )


def _install(loader: AutoLoader[Any], prepared: Any) -> None:
    """Make ``loader`` the loader inside ``prepared``, accelerate's, loading the batches
    accelerate chose for this process."""
    from accelerate.data_loader import DataLoaderShard

    if type(prepared) is not DataLoaderShard:
        raise InvalidInputError(
            f"accelerate prepared the AutoLoader as a {type(prepared).__qualname__}, not a "
            "DataLoaderShard around a DataLoader, which is the one AutoLoader can load for "
            "(e.g. on a TPU, accelerate's MpDeviceLoaderWrapper). Use a DataLoader there."
        )
    loader._load_batches_of(prepared.base_dataloader.batch_sampler)
    prepared.base_dataloader = loader
