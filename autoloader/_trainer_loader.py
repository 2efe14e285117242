"""A Hugging Face Trainer's train loader: what it is made of, and the tuned settings put
into it (for :func:`autoloader.transformers.tune_trainer`).

NOTE [ A Trainer's loader ]
``Trainer.get_train_dataloader()`` builds a plain ``DataLoader`` (the dataset, the data
collator, a batch size, a sampler, HF's ``seed_worker``) and hands it to
``accelerator.prepare()``, which builds another from its attributes: a
``DataLoaderShard`` whose ``base_dataloader`` is a plain ``DataLoader`` over the same
dataset, with the batch sampler accelerate chose (``SeedableRandomSampler`` inside,
sharded across processes under torchrun). A ``DataLoader`` subclass given to
``prepare()`` comes back a plain ``DataLoader``: a ``ThreadLoader``'s threads would run
as that many processes. So the tuned loader is put in after ``prepare()``, as the
``DataLoaderShard``'s ``base_dataloader``, built from that one's parts: its batch
sampler, collate_fn, ``worker_init_fn`` and the rest. The ``DataLoaderShard`` iterates
its ``base_dataloader`` each epoch, sets the sampler's epoch through it and moves each
batch to the device as before. Tuning runs on a plain ``DataLoader`` made of the same
parts (a ``DataLoaderShard`` is never iterated: its iterator registers with
accelerate's gradient state).

Settings that ``TrainingArguments`` can say (worker processes without a limit on their
thread pools, the same persistence as the Trainer's loader) are written to its
``dataloader_*`` fields instead: they then also reach a mid-epoch resume, which
accelerate rebuilds from attributes (``skip_first_batches``), and the saved arguments.
Those fields also set the evaluation loaders' workers.

The tuned loader draws from the random number generators as the Trainer's own would
(``NOTE [ A tuned loader's draws ]`` in ``autoloader/loader/_draws.py``), so the
``dataloader_*`` route is taken only where the persistence is the same.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from autoloader._exceptions import InvalidInputError
from autoloader.loader import (
    BatchItems,
    dataloader_kwargs,
    drawing_as,
    merge_loader_kwargs,
    persistent,
)

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

_logger = logging.getLogger("autoloader.transformers")


@dataclass(frozen=True)
class LoaderMaker:
    """The Trainer's own ``get_train_dataloader()``: a Trainer subclass's override or a
    method set on the instance included, an earlier ``tune_trainer()``'s left out."""

    made_by: Callable[[], Any]
    # What the instance's own ``get_train_dataloader`` attribute was before any
    # tune_trainer() (None: it had none, the class's method is used).
    replaced: object | None

    @classmethod
    def of(cls, trainer: Trainer) -> LoaderMaker:
        current = vars(trainer).get("get_train_dataloader")
        if isinstance(current, _TunedTrainLoader):
            return current.maker
        return cls(trainer.get_train_dataloader, current)

    def plain(self) -> DataLoader[Any]:
        """The plain DataLoader the Trainer's train loader iterates (see ``NOTE [ A
        Trainer's loader ]``)."""
        return _plain(self.made_by())

    def install(self, trainer: Trainer, loader: _TunedTrainLoader | None) -> None:
        """Make ``loader`` the Trainer's ``get_train_dataloader``, or with ``None`` its
        own again."""
        value = loader if loader is not None else self.replaced
        if value is None:
            vars(trainer).pop("get_train_dataloader", None)
        else:
            vars(trainer)["get_train_dataloader"] = value


def _plain(prepared: Any) -> DataLoader[Any]:
    """The plain DataLoader inside a loader that accelerate prepared, or the loader
    itself where it is one."""
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(prepared, DataLoaderDispatcher):
        raise InvalidInputError(
            "accelerate dispatches this Trainer's batches: one process iterates the "
            "IterableDataset and sends each its share, which a loader's settings cannot "
            "be tuned around. Let each process iterate its own part: "
            'TrainingArguments(accelerator_config={"dispatch_batches": False}), with a '
            "dataset that splits its items with torch.utils.data.get_worker_info()."
        )
    # A DataLoaderShard's base_dataloader; accelerate answers an attribute missing on
    # it with AttributeError, as for a plain DataLoader.
    base = getattr(prepared, "base_dataloader", prepared)
    if type(base) is not DataLoader:
        raise InvalidInputError(
            "tune_trainer rebuilds the Trainer's train loader from its parts, which it "
            "can only do for torch.utils.data.DataLoader itself, but get_train_dataloader() "
            f"gave a {type(base).__module__}.{type(base).__qualname__}."
        )
    return base


def tuning_parts(original: DataLoader[Any]) -> tuple[int, dict[str, Any]]:
    """The batch size and fixed loader options that load the batches ``original`` loads.

    HF's ``seed_worker`` (the Trainer's ``worker_init_fn``) is left out: it only seeds
    worker processes, and a ``worker_init_fn`` would rule out thread workers. The
    Trainer's loader puts it back in training.
    """
    fixed: dict[str, Any] = {"collate_fn": original.collate_fn}
    if isinstance(original.dataset, IterableDataset):
        batch_size = _batch_size(original)
        fixed["drop_last"] = original.drop_last
    else:
        items = BatchItems.of(original.batch_sampler)
        batch_size = items.batch_size
        fixed["sampler"] = items
    if original.timeout:
        fixed["timeout"] = original.timeout
    if original.multiprocessing_context is not None:
        fixed["multiprocessing_context"] = original.multiprocessing_context
    init = original.worker_init_fn
    if init is not None and not _is_seed_worker(init):
        fixed["worker_init_fn"] = init
    return batch_size, fixed


def _batch_size(original: DataLoader[Any]) -> int:
    """The batch size of a loader over an IterableDataset."""
    if original.batch_size is None:
        raise InvalidInputError(
            "tune_trainer tunes loaders that batch items, but the Trainer's IterableDataset "
            "is loaded with batch_size=None (it yields whole batches)."
        )
    return original.batch_size


def _is_seed_worker(function: object) -> bool:
    """Whether ``function`` is HF's ``seed_worker`` (or a ``functools.partial`` of it,
    as the Trainer passes it)."""
    from transformers.trainer_utils import seed_worker

    while isinstance(function, functools.partial):
        function = function.func
    return function is seed_worker


def generators_of(original: DataLoader[Any]) -> list[torch.Generator]:
    """The generators that loading ``original``'s batches draws from (its samplers'
    and its dataset's), for tune() to put back: a sampler the Trainer keeps between
    calls would otherwise start training further down its stream."""
    batch_sampler = original.batch_sampler
    inner = getattr(batch_sampler, "batch_sampler", None)  # inside a BatchSamplerShard
    holders = (
        original,
        original.dataset,
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        inner,
        getattr(inner, "sampler", None),
    )
    found: dict[int, torch.Generator] = {}
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator):
            found[id(generator)] = generator
    return list(found.values())


def apply_settings(
    trainer: Trainer, params: Mapping[str, Any], maker: LoaderMaker, original: DataLoader[Any]
) -> None:
    """Make ``trainer.train()`` load with the tuned settings ``params`` (see ``NOTE [ A
    Trainer's loader ]``)."""
    args = trainer.args
    if _arguments_can_say(params, args, original):
        before = _set_arguments(args, _arguments(params, args))
        maker.install(trainer, None)
        if _builds(maker, params):
            _logger.info("tuned settings applied to the TrainingArguments: %s", params)
            return
        # A Trainer subclass that builds its loader without those fields.
        _set_arguments(args, before)
    maker.install(trainer, _TunedTrainLoader(maker, params))
    _logger.info("tuned settings applied by a loader of their own: %s", params)


def _arguments_can_say(
    params: Mapping[str, Any], args: TrainingArguments, original: DataLoader[Any]
) -> bool:
    """Whether the ``dataloader_*`` fields give a loader with ``params`` that draws as
    ``original`` does (see ``NOTE [ A tuned loader's draws ]``)."""
    return (
        params["worker_kind"] == "processes"
        and params["worker_threads"] is None
        and not params["batched_fetch"]
        and params["persistent_workers"] == persistent(original)
        and (params["in_order"] or hasattr(args, "dataloader_in_order"))
    )


def _arguments(params: Mapping[str, Any], args: TrainingArguments) -> dict[str, Any]:
    """The ``dataloader_*`` fields that say ``params``. Set after ``__post_init__``,
    which would refuse a prefetch factor or persistence without workers, as DataLoader
    does: those stay unset then."""
    workers = params["num_workers"] > 0
    fields = {
        "dataloader_num_workers": params["num_workers"],
        "dataloader_prefetch_factor": params["prefetch_factor"] if workers else None,
        "dataloader_persistent_workers": bool(params["persistent_workers"]) and workers,
        "dataloader_pin_memory": bool(params["pin_memory"]),
    }
    if hasattr(args, "dataloader_in_order"):  # transformers 5.x
        fields["dataloader_in_order"] = bool(params["in_order"])
    return fields


def _set_arguments(args: TrainingArguments, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Set ``fields`` on ``args``; what they were."""
    before = {name: getattr(args, name) for name in fields}
    for name, value in fields.items():
        setattr(args, name, value)
    return before


def _builds(maker: LoaderMaker, params: Mapping[str, Any]) -> bool:
    """Whether the Trainer's loader now has ``params``'s settings."""
    loader = maker.plain()
    built = (
        loader.num_workers,
        loader.prefetch_factor,
        persistent(loader),
        loader.pin_memory,
        getattr(loader, "in_order", True),
    )
    tuned = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "in_order")
    return built == tuple(params[name] for name in tuned)


class _TunedTrainLoader:
    """A Trainer's ``get_train_dataloader``: the Trainer's own, with the tuned loader in
    place of the plain one inside accelerate's (see ``NOTE [ A Trainer's loader ]``).

    Set on the instance, so that a Trainer subclass's override still builds the loader
    (its dataset, collator, sampler), and each ``train()`` gets a fresh one.
    """

    def __init__(self, maker: LoaderMaker, params: Mapping[str, Any]) -> None:
        self.maker = maker
        self.params = dict(params)

    def __call__(self) -> Any:
        prepared = self.maker.made_by()
        tuned = _tuned_loader(_plain(prepared), self.params)
        if getattr(prepared, "base_dataloader", None) is None:  # not prepared by accelerate
            return tuned
        prepared.base_dataloader = tuned
        return prepared

    def __repr__(self) -> str:
        return f"<get_train_dataloader with the tuned settings {self.params}>"


def _tuned_loader(original: DataLoader[Any], params: Mapping[str, Any]) -> DataLoader[Any]:
    """A loader of ``original``'s batches with the settings ``params``, drawing random
    numbers as ``original`` would (see ``NOTE [ A tuned loader's draws ]``)."""
    threads = params["worker_kind"] == "threads"
    fixed: dict[str, Any] = {
        "collate_fn": original.collate_fn,
        "timeout": original.timeout,
        "pin_memory_device": original.pin_memory_device,
    }
    if isinstance(original.dataset, IterableDataset):
        batch_size, fixed["drop_last"] = _batch_size(original), original.drop_last
    else:
        batch_size, fixed["batch_sampler"] = 1, original.batch_sampler  # 1: DataLoader's default
    if not threads:  # neither sets up a thread
        fixed["worker_init_fn"] = original.worker_init_fn
        fixed["multiprocessing_context"] = original.multiprocessing_context
    options = merge_loader_kwargs(params, batch_size=batch_size, fixed=fixed)
    kwargs = dataloader_kwargs(original.dataset, options)
    return drawing_as(original, original.dataset, kwargs, threads=threads)
