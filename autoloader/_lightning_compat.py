"""Every private Lightning and torchmetrics API :mod:`autoloader.lightning` touches, in
one place.

``LoaderTuner`` works inside a fit: it asks the fit loop for its train dataloader as the
fit would, runs the training epoch loop's step without its fetching, puts back the
loops' counters and logged results, and hands the fit loop a data source of its own.
Lightning keeps all of that private (``trainer.fit_loop._data_source``,
``lightning.pytorch.trainer.connectors``, the loops' helpers), and torchmetrics keeps a
``Metric``'s accumulated state in private attributes. Each is named here once, with the
versions it was checked against (:data:`CHECKED`). A release that moves one of them is
fixed here, and nowhere else: a name missing at import fails the import, and an
attribute missing on the fit's objects fails :func:`check_internals` at the fit's start,
before any trial, each with an error that names the version found and what to do.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from torch.utils.data import DataLoader

from autoloader._exceptions import InvalidInputError

# The versions every name below was checked against: Lightning's sources at 2.6.0, 2.6.5
# and its master of July 2026 (each name is there since 2.5.0 at least), run and tested
# with Lightning 2.6.6 and torchmetrics 1.9.0, as installed in development.
CHECKED = "Lightning 2.6.0 to 2.6.6 with torchmetrics 1.9"
# The oldest Lightning supported (pyproject.toml's extra says the same).
MIN_VERSION = (2, 6)
_INSTALL = "pip install 'torch-autoloader[lightning]'"
_TESTED = "pip install 'lightning==2.6.6' 'torchmetrics==1.9.0'"


def installed_version(package: str = "lightning") -> str | None:
    """The installed version of ``package``; ``None`` where it has no package metadata
    (imported from a source tree) or is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _unsupported(what: str, package: str = "lightning") -> str:
    """The message for an installed ``package`` that lacks ``what``, a name used here."""
    found = installed_version(package)
    if found is None:
        return f"autoloader.lightning needs Lightning 2.6 or later: {_INSTALL}"
    return (
        f"autoloader.lightning uses Lightning internals checked in {CHECKED}, but "
        f"{package} {found} {what}. Install the release tested ({_TESTED}), or an "
        f"autoloader release that supports {package} {found}."
    )


try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import pl_worker_init_function
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.data_connector import (
        _DataLoaderSource,
        _process_dataloader,
        _request_dataloader,
    )
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
    from torchmetrics import Metric
except ImportError as error:  # pragma: no cover: the extra is not installed, or moved
    raise ImportError(_unsupported(f"lacks one of them ({error})")) from error

# The private attributes reached below through the trainer, the module and each
# torchmetrics Metric; check_internals() looks for each at the fit's start.
_TRAINER_ATTRIBUTES = (
    "fit_loop._data_source",
    "fit_loop._results",
    "fit_loop.epoch_loop._build_kwargs",
    "fit_loop.epoch_loop.batch_progress.increment_ready",
    "fit_loop.epoch_loop.automatic_optimization.run",
    "fit_loop.epoch_loop.manual_optimization.run",
    "_logger_connector.on_batch_start",
    "_logger_connector.reset_results",
    "_logger_connector.reset_metrics",
    "_accelerator_connector.is_distributed",
    "_accelerator_connector.use_distributed_sampler",
    "_data_connector._resolve_sampler",
)
_MODULE_ATTRIBUTES = ("_on_before_batch_transfer",)
_METRIC_ATTRIBUTES = ("_defaults", "_update_count", "_computed")

# The fit loop's source of its train dataloader (``trainer.fit_loop._data_source``): the
# model or datamodule (``instance``) and its hook's name (``name``); ``is_defined()``
# says whether the hook is overridden, ``dataloader()`` calls it.
DataLoaderSource = _DataLoaderSource


def check_version(found: str) -> None:
    """Raise :class:`InvalidInputError` if Lightning ``found`` is older than supported."""
    parts = tuple(int(p) for p in found.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        raise InvalidInputError(
            f"autoloader.lightning supports Lightning {'.'.join(map(str, MIN_VERSION))} or "
            f"later; this is {found}. Upgrade: pip install -U 'lightning>=2.6'."
        )


def check_internals(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Raise :class:`InvalidInputError` naming the first private attribute used here
    that this fit's trainer, module or metrics lack (another Lightning or torchmetrics
    than :data:`CHECKED`)."""
    owners: list[tuple[str, str, object, tuple[str, ...]]] = [
        ("lightning", "Trainer", trainer, _TRAINER_ATTRIBUTES),
        ("lightning", "LightningModule", module, _MODULE_ATTRIBUTES),
    ]
    owners += [
        ("torchmetrics", type(m).__name__, m, _METRIC_ATTRIBUTES)
        for m in module.modules()
        if isinstance(m, Metric)
    ]
    for package, owner, value, paths in owners:
        for path in paths:
            *through, name = path.split(".")
            try:
                # Looked up, not called: fit_loop._results is a property that raises
                # outside the fit's stages.
                inspect.getattr_static(functools.reduce(getattr, through, value), name)
            except AttributeError:
                raise InvalidInputError(_unsupported(f"has no {owner}.{path}", package)) from None


def train_source(trainer: pl.Trainer) -> DataLoaderSource:
    """Where the fit loop gets its train dataloader (``fit_loop._data_source``)."""
    return trainer.fit_loop._data_source


def set_train_source(trainer: pl.Trainer, source: DataLoaderSource) -> None:
    """Make ``source`` where the fit loop gets its train dataloader."""
    trainer.fit_loop._data_source = source


def defines_dataloader(source: DataLoaderSource) -> bool:
    """Whether the model or datamodule of ``source`` overrides its dataloader hook (or
    the fit was given the loaders)."""
    return source.is_defined()


def request_dataloader(source: DataLoaderSource) -> Any:
    """What the hook of ``source`` returns, called as the fit calls it: with
    DataLoader's arguments recorded, for Lightning to rebuild it with its sampler."""
    return _request_dataloader(source)


def processed_train_dataloader(trainer: pl.Trainer, loader: DataLoader[Any]) -> object:
    """``loader`` after Lightning's processing of a fit's train dataloader: its
    distributed sampler, its worker seeding (``_process_dataloader``)."""
    return _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, loader)


def train_sampler(trainer: pl.Trainer, loader: DataLoader[Any]) -> object:
    """The sampler Lightning gives a fit's train ``loader``: a ``DistributedSampler``
    under DDP, else the loader's own (``DataConnector._resolve_sampler``)."""
    return trainer._data_connector._resolve_sampler(
        loader, shuffle=True, mode=RunningStage.TRAINING
    )


def adds_distributed_sampler(trainer: pl.Trainer) -> bool:
    """Whether Lightning puts a distributed sampler in the fit's loaders (a distributed
    strategy and ``use_distributed_sampler``)."""
    connector = trainer._accelerator_connector
    return bool(connector.is_distributed and connector.use_distributed_sampler)


def takes_dataloader_iter(module: pl.LightningModule) -> bool:
    """Whether the module's ``training_step`` takes ``dataloader_iter`` (and fetches
    its own batches), as Lightning decides it."""
    return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


def seeds_workers_as_lightning(worker_init_fn: object) -> bool:
    """Whether ``worker_init_fn`` is the worker seeding Lightning adds to a loader
    (``seed_everything(workers=True)``): a ``functools.partial`` of
    ``pl_worker_init_function``."""
    return getattr(worker_init_fn, "func", None) is pl_worker_init_function


def lightning_worker_seeding(rank: int) -> Callable[[int], None]:
    """The ``worker_init_fn`` Lightning adds to a loader of the process of global rank
    ``rank``, where the workers are seeded."""
    return functools.partial(pl_worker_init_function, rank=rank)


@contextmanager
def logged_results_put_back(trainer: pl.Trainer) -> Iterator[None]:
    """The fit loop's logged results (``fit_loop._results``) as they were before the
    block, and the logger connector's caches emptied of what the block logged."""
    results = trainer.fit_loop._results
    logged = list(results.items())
    try:
        yield
    finally:
        results.clear()
        results.update(logged)
        trainer._logger_connector.reset_results()
        trainer._logger_connector.reset_metrics()


def load_progress(loop: object, saved: dict[str, Any], prefix: str = "") -> None:
    """The loop's progress counters as ``saved`` (``loop.state_dict()``) has them.
    Not ``Loop.load_state_dict``, which marks the loops as resuming from a checkpoint.
    The loops and counters are found as Lightning's ``_Loop`` and ``_BaseProgress``."""
    for name, value in vars(loop).items():
        key = prefix + name
        if isinstance(value, _BaseProgress) and key in saved:
            value.load_state_dict(saved[key])
        elif isinstance(value, _Loop):
            load_progress(value, saved, key + ".")


def run_training_step(
    trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_index: int
) -> None:
    """One step of the training epoch loop on ``batch``, the ``batch_index``-th
    (``NOTE [ One Lightning step ]``).

    NOTE [ One Lightning step ]
    The training epoch loop's step (``TrainingEpochLoop.advance``, lightning 2.6)
    without its fetching, callbacks and logging: the batch through the precision
    plugin, the module's ``on_before_batch_transfer`` and the strategy's transfer, then
    the optimization (automatic: a closure of zero_grad, ``training_step`` and backward,
    then ``LightningModule.optimizer_step`` through the strategy and precision plugin;
    manual: ``training_step``, which steps its optimizers itself). Each step counts a
    batch as ready, as the loop does, and passes its index: with
    ``accumulate_grad_batches=N`` the optimizer steps (and DDP reduces gradients) once
    in N batches, as in training. The counters are put back after tuning.
    """
    loop = trainer.fit_loop.epoch_loop
    batch = trainer.precision_plugin.convert_input(batch)
    batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
    batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)
    loop.batch_progress.increment_ready()
    trainer._logger_connector.on_batch_start(batch)
    kwargs = loop._build_kwargs(OrderedDict(), batch, batch_index)
    if module.automatic_optimization:
        loop.automatic_optimization.run(trainer.optimizers[0], batch_index, kwargs)
    else:
        loop.manual_optimization.run(kwargs)


def metric_state(metric: Metric) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s accumulated state: its states (plain attributes,
    named by ``_defaults``), ``_update_count`` and ``_computed``."""
    return {
        "states": {name: getattr(metric, name) for name in metric._defaults},
        "update_count": metric._update_count,
        "computed": metric._computed,
    }


def load_metric_state(
    metric: Metric, *, states: dict[str, Any], update_count: int, computed: Any
) -> None:
    """Set a ``Metric``'s accumulated state, as :func:`metric_state` gives it."""
    for name, value in states.items():
        setattr(metric, name, value)
    metric._update_count = update_count
    metric._computed = computed


def pass_on_to_rebuilds(loader: DataLoader[Any], **kwargs: Any) -> None:
    """Make Lightning's rebuilds of ``loader`` pass ``kwargs`` too, where ``loader`` was
    made in a ``*_dataloader`` hook: Lightning recorded the arguments it was made with
    (``_replace_dunder_methods`` keeps them in ``__pl_saved_kwargs``) and rebuilds it
    from them with its own sampler (``_update_dataloader``). A loader made elsewhere is
    rebuilt from its public attributes, which need nothing of this. Only the arguments
    its class's ``__init__`` takes are passed on: Lightning refuses to rebuild a
    subclass that takes fewer with others."""
    saved = vars(loader).get("__pl_saved_kwargs")
    if not isinstance(saved, dict):
        return
    parameters = inspect.signature(type(loader).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    saved.update({name: v for name, v in kwargs.items() if takes_any or name in parameters})


@dataclass
class _BuiltSource(_DataLoaderSource):
    """A data source whose loader is built from another source's (see
    :func:`built_source`)."""

    inner: _DataLoaderSource | None = field(default=None, kw_only=True)
    build: Callable[[Any], Any] | None = field(default=None, kw_only=True)

    def dataloader(self) -> Any:
        assert self.inner is not None and self.build is not None
        return self.build(self.inner.dataloader())


def built_source(source: DataLoaderSource, build: Callable[[Any], Any]) -> DataLoaderSource:
    """A data source of the same model or datamodule and hook as ``source`` whose
    loader is ``build`` of ``source``'s, each time Lightning asks (at setup, and on
    ``reload_dataloaders_every_n_epochs``): the hook is called when it would be."""
    return _BuiltSource(source.instance, source.name, inner=source, build=build)
