"""Tuning inside a Lightning fit: :class:`LoaderTuner`, a callback.

Example::

    from autoloader.lightning import LoaderTuner

    trainer = lightning.Trainer(callbacks=[LoaderTuner(time_budget=60, path="loader.json")])
    trainer.fit(model, datamodule=dm)   # tunes first, then trains with the tuned loader

Like Lightning's own ``BatchSizeFinder`` it runs when the fit starts (``on_fit_start``:
after the strategy has set up the model and optimizers, before the sanity check). It
asks the model or datamodule for its train dataloader as the fit would (the hook, then
Lightning's processing: a ``DistributedSampler`` under DDP), and tunes it with
:func:`autoloader.tune` and the model's real training step: ``training_step``,
backward and the optimizer step through Lightning's strategy and precision plugin
(``NOTE [ One Lightning step ]``). Then the fit trains with a loader of the tuned
settings, built from the hook's own loader each time Lightning asks for it.

Every private Lightning and torchmetrics name it needs (the fit loop's data source, the
training epoch loop's step, a ``Metric``'s accumulated state...) is reached through
``autoloader/_lightning_compat.py``, which says the versions they were checked against;
this module uses Lightning's public API only.

NOTE [ Leaving no trace on the fit ]
Tuning runs hundreds of real optimizer steps. Around them the callback keeps, and puts
back bit for bit: the module's parameters, buffers, gradients and modes, every
optimizer, every LR scheduler, the precision plugin's state (a ``GradScaler``), the
generators of the loader and its sampler, the global random number generators, the fit
loop's progress counters (``global_step``) and the logged results. Other callbacks
are left out of the tuning steps (as ``BatchSizeFinder`` does): their batch hooks do
not run. The module's own hooks do: they are its step. A fit with the tuner then
trains as one without it: on the CPU, with a fixed seed, a deterministic dataset and
``in_order=True`` (the default), the final weights are equal bit for bit. Persistent
workers draw one number fewer per epoch from the RNG than a loader without them: the
tuned loader makes the draws the hook's own loader would (``NOTE [ A tuned loader's
draws ]``).
What a step changes outside these (a Python counter on the module) cannot be known
from outside and is not restored.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import warnings
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
    from torchmetrics import Metric
except ImportError as error:  # pragma: no cover: the extra is not installed
    raise ImportError(
        "autoloader.lightning needs Lightning 2.6 or later: pip install "
        "'torch-autoloader[lightning]'"
    ) from error

from autoloader import _lightning_compat as internals
from autoloader._exceptions import InvalidInputError
from autoloader._lightning_compat import DataLoaderSource, check_version
from autoloader._preserve import Restorable, preserved
from autoloader._problem import DEFAULT_TIME_BUDGET
from autoloader._tune import check_passed_through, tune
from autoloader.checks import env_int
from autoloader.loader import drawing_as
from autoloader.results import TuneResult
from autoloader.search import SearchSpace, check_search_space, without_batched_fetch

__all__ = ["LoaderTuner"]

_logger = logging.getLogger("autoloader")

# Strategies that shard the model or optimizer: their state is not the module's
# parameters and the optimizers' state dicts, which the callback restores.
_SHARDED = (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)
# tune()'s arguments that the fit gives.
_FROM_THE_FIT = ("dataset", "step_fn", "batch_size", "loader_kwargs", "restore", "device")


class LoaderTuner(pl.Callback):
    """Tune the fit's train dataloader when the fit starts, then train with it.

    Args:
        time_budget (float, optional): seconds tuning may take. (default: ``60``)
        path (str or path, optional): a JSON file that keeps the result: reused,
            once a short trial of its setting agrees, when it holds this problem's
            result on this machine, else written after tuning (see
            ``tune(path=...)``). (default: ``None``)
        **tune_kwargs: other :func:`autoloader.tune` arguments (``search_space``,
            ``memory_budget``, ``n_trials``, ``storage``, ``show_progress``...). Not
            ``dataset``, ``step_fn``, ``batch_size``, ``loader_kwargs`` or ``restore``,
            which the fit gives.

    Attributes:
        result (TuneResult or None): the tuning result, once the fit has started.

    The fit trains with the tuned settings, tuned ``step_threads`` (this process's
    torch threads, see ``NOTE [ Step threads ]``) included; when it ends, the process's
    threads are put back.

    Under DDP every rank runs the callback and the ranks tune together, as
    :func:`autoloader.tune` does under torchrun; the settings are the same on every
    rank. Tuning is skipped, with a warning, under ``fast_dev_run``,
    ``overfit_batches`` or ``limit_train_batches=0``.

    Ctrl-C while tuning stops the fit (a ``KeyboardInterrupt``, which Lightning ends
    gracefully), rather than training with the best of the trials so far.

    Raises:
        InvalidInputError: Lightning older than 2.6, or ``tune_kwargs`` naming what the
            fit gives, what ``tune()`` does not take, or a search space that cannot be
            (on construction); at the fit's start, before any trial: no
            ``train_dataloader``, several train dataloaders, a loader made with a
            ``batch_sampler`` instead of ``batch_size``, a ``training_step`` that takes
            ``dataloader_iter``, or a strategy that shards the model (FSDP, DeepSpeed).
    """

    def __init__(
        self,
        time_budget: float = DEFAULT_TIME_BUDGET,
        path: str | os.PathLike[str] | None = None,
        **tune_kwargs: Any,
    ) -> None:
        found = internals.installed_version()
        if found is not None:  # None: imported from a source tree, without its metadata
            check_version(found)
        _check_tune_kwargs(tune_kwargs)
        self.time_budget = time_budget
        self.path = path
        self.tune_kwargs = tune_kwargs
        self.result: TuneResult | None = None
        self._source: DataLoaderSource | None = None
        self._threads: int | None = None  # this process's, before the tuned step_threads

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _skipped(trainer):
            return
        internals.check_internals(trainer, pl_module)  # before any trial
        source = internals.train_source(trainer)
        _check_fit(trainer, pl_module, source)
        _seeds_workers()  # read after the tuning: a bad value is refused before it
        # The hook is called once more than without the tuner: what it draws from the
        # RNGs (a random split) is drawn again, as then, when the fit calls it.
        with preserved():
            loader = _processed(trainer, source)
        result = self._tune(trainer, pl_module, loader)
        self.result = result
        if result.partial:  # Ctrl-C: the user stops the fit, not only the tuning
            raise KeyboardInterrupt
        self._source = source
        # The hook's own loader, then a tuned one built from it each time the fit asks:
        # the hook is called when it would be (and once more, above, to tune).
        internals.set_train_source(
            trainer, internals.built_source(source, functools.partial(_tuned, trainer, result))
        )
        # The fit trains on the tuned threads; _give_back puts the process's back.
        self._threads = result.apply_threads()
        _logger.info(
            "LoaderTuner: training with %s (%.2fx the defaults)", result.params, result.speedup
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._give_back(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._give_back(trainer)

    def _give_back(self, trainer: pl.Trainer) -> None:
        """The fit loop's own data source and this process's threads again, for a later
        fit with this trainer."""
        if self._source is not None:
            internals.set_train_source(trainer, self._source)
            self._source = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def _tune(
        self, trainer: pl.Trainer, module: pl.LightningModule, loader: DataLoader[Any]
    ) -> TuneResult:
        """The tuning run, leaving no trace on the fit (``NOTE [ Leaving no trace on
        the fit ]``)."""
        # Trainer's connectors set callbacks, fast_dev_run and overfit_batches: untyped.
        connected: Any = trainer
        callbacks, progress = connected.callbacks, copy.deepcopy(trainer.fit_loop.state_dict())
        connected.callbacks = []
        try:
            with internals.logged_results_put_back(trainer), preserved(*_generators(loader)):
                return tune(
                    loader.dataset,
                    _TrainingStep(trainer, module),
                    batch_size=_batch_size(loader),
                    time_budget=self.time_budget,
                    path=self.path,
                    loader_kwargs=_fixed(loader),
                    restore=_state(trainer, module),
                    device=_device(trainer, module),
                    **{**self.tune_kwargs, **_search(trainer, self.tune_kwargs)},
                )
        finally:
            connected.callbacks = callbacks
            internals.load_progress(trainer.fit_loop, progress)


def _check_tune_kwargs(tune_kwargs: dict[str, Any]) -> None:
    """:class:`InvalidInputError` for ``tune()`` arguments the callback cannot pass."""
    check_passed_through(
        tune_kwargs,
        caller="LoaderTuner",
        given={name: "from the fit: leave it out." for name in _FROM_THE_FIT},
        refused={"isolation": "the trials run the model's steps in the fit's own processes."},
    )
    if "search_space" in tune_kwargs:
        check_search_space(tune_kwargs["search_space"])


def _search(trainer: pl.Trainer, tune_kwargs: dict[str, Any]) -> dict[str, SearchSpace]:
    """The search space asked for, without batched fetch where Lightning puts a
    distributed sampler in the loader: it would wrap the batch sampler that batched
    fetch puts in the sampler's place, splitting each rank's batches again."""
    if not internals.adds_distributed_sampler(trainer):
        return {}
    space = without_batched_fetch(
        tune_kwargs.get("search_space"),
        refusal="LoaderTuner cannot tune batched_fetch=True under a distributed strategy: "
        "Lightning's DistributedSampler would wrap the whole batches. Leave "
        "batched_fetch unset, or set use_distributed_sampler=False and give each "
        "rank its sampler.",
    )
    return {"search_space": space}


def _skipped(trainer: pl.Trainer) -> bool:
    """Whether this fit is one not to tune (said with a warning)."""
    why = None
    connected: Any = trainer  # fast_dev_run and overfit_batches are set by connectors
    if connected.fast_dev_run:
        why = "fast_dev_run runs a few batches only"
    elif connected.overfit_batches:
        why = "overfit_batches replaces the sampler"
    elif trainer.limit_train_batches == 0:
        why = "limit_train_batches=0 trains nothing"
    if why is not None:
        warnings.warn(f"LoaderTuner does not tune this fit: {why}.", UserWarning, stacklevel=2)
    return why is not None


def _check_fit(trainer: pl.Trainer, module: pl.LightningModule, source: DataLoaderSource) -> None:
    """:class:`InvalidInputError` for a fit the callback cannot tune, before any trial."""
    if isinstance(trainer.strategy, _SHARDED):
        strategy = type(trainer.strategy).__name__
        raise InvalidInputError(
            f"LoaderTuner does not support {strategy}: it shards the model and optimizer "
            "state, which tuning's steps would change. Tune with DDP or one device, and "
            "reuse the saved settings (path=...) under this strategy."
        )
    if internals.takes_dataloader_iter(module):
        raise InvalidInputError(
            "LoaderTuner times a training_step that takes a batch; this one takes "
            "dataloader_iter and fetches its own. Tune with autoloader.tune() and a "
            "step of your own, then set the loader's settings from the result."
        )
    if not internals.defines_dataloader(source):
        raise InvalidInputError(
            "LoaderTuner: the model and datamodule define no train_dataloader() to tune. "
            "Define train_dataloader(), or pass train_dataloaders= to fit()."
        )


def _processed(trainer: pl.Trainer, source: DataLoaderSource) -> DataLoader[Any]:
    """The train loader as the fit would use it: the hook's, then Lightning's processing
    (its distributed sampler, its worker seeding), without starting an iterator."""
    loader = internals.request_dataloader(source)
    if isinstance(loader, CombinedLoader):
        if len(loader.flattened) != 1:
            raise InvalidInputError(
                f"LoaderTuner tunes one train dataloader; this fit has {len(loader.flattened)}."
            )
        (loader,) = loader.flattened
    if not isinstance(loader, DataLoader):
        raise InvalidInputError(
            f"LoaderTuner tunes a torch DataLoader; train_dataloader() returned "
            f"{type(loader).__name__}."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers: ours to give
        processed = internals.processed_train_dataloader(trainer, loader)
    assert isinstance(processed, DataLoader)
    return processed


def _batch_size(loader: DataLoader[Any]) -> int:
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise InvalidInputError(
            "LoaderTuner tunes a DataLoader made with batch_size=...; this one has a "
            f"batch_sampler ({type(loader.batch_sampler).__name__}), which it cannot "
            "rebuild."
        )
    return loader.batch_size


def _fixed(loader: DataLoader[Any]) -> dict[str, Any]:
    """The options of ``loader`` that tuning keeps (not its worker settings, which it
    tunes): sampler, collate_fn, drop_last, timeout, the user's worker_init_fn,
    generator, start method."""
    fixed: dict[str, Any] = {"drop_last": loader.drop_last}
    if not isinstance(loader.dataset, IterableDataset):
        fixed["sampler"] = loader.sampler
    if loader.collate_fn is not torch.utils.data.default_collate:
        fixed["collate_fn"] = loader.collate_fn
    if loader.timeout:
        fixed["timeout"] = loader.timeout
    init = loader.worker_init_fn
    # Lightning's own seeding (seed_everything(workers=True)) is added back to the
    # loader the fit uses; left out here, it would rule out thread workers.
    if init is not None and not internals.seeds_workers_as_lightning(init):
        fixed["worker_init_fn"] = init
    for name in ("generator", "multiprocessing_context"):
        if getattr(loader, name) is not None:
            fixed[name] = getattr(loader, name)
    return fixed


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The generators tuning draws from besides the global one: the loader's and its
    sampler's (a datamodule may keep one across calls of its hook)."""
    found = [loader.generator, getattr(loader.sampler, "generator", None)]
    return [g for g in found if isinstance(g, torch.Generator)]


def _state(trainer: pl.Trainer, module: pl.LightningModule) -> list[Restorable]:
    """What a training step changes and tuning restores (``NOTE [ Leaving no trace on
    the fit ]``)."""
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    metrics = [_MetricState(m) for m in module.modules() if isinstance(m, Metric)]
    return [module, *trainer.optimizers, *schedulers, trainer.precision_plugin, *metrics]


class _MetricState:
    """A torchmetrics ``Metric``'s accumulated state, which is neither a parameter nor
    a buffer (its states are plain attributes), as a state dict: a metric logged with
    ``on_epoch=True`` would otherwise count the tuning steps into the first epoch."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def state_dict(self) -> dict[str, Any]:
        return internals.metric_state(self.metric)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        device = self.metric.device
        # Copied to host memory by preserved(): back where the metric keeps it.
        internals.load_metric_state(
            self.metric,
            states={name: _to_device(value, device) for name, value in saved["states"].items()},
            update_count=saved["update_count"],
            computed=_to_device(saved["computed"], device),
        )


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


def _device(trainer: pl.Trainer, module: pl.LightningModule) -> torch.device | None:
    """Where tune() moves each batch, so that it can synchronise the accelerator at the
    edges of its timing windows: the root device, unless the module handles its
    batches on the way there (``on_before_batch_transfer``, ``transfer_batch_to_device``),
    or the CPU."""
    device = trainer.strategy.root_device
    overridden = any(
        getattr(type(module), hook) is not getattr(pl.LightningModule, hook)
        for hook in ("on_before_batch_transfer", "transfer_batch_to_device")
    )
    return None if device.type == "cpu" or overridden else device


class _TrainingStep:
    """One step of the training epoch loop (``NOTE [ One Lightning step ]`` in
    ``autoloader/_lightning_compat.py``), counting the batches it was given."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, module
        self.batches = 0
        # The step's name where a result file records the problem it was tuned for
        # (tune(path=...)): the module's class and what changes a step's cost.
        parameters = sum(p.numel() for p in module.parameters())
        self.__module__ = type(module).__module__
        self.__qualname__ = (
            f"{type(module).__qualname__}.training_step of {parameters} parameters, "
            f"precision {trainer.precision}, accumulate_grad_batches "
            f"{trainer.accumulate_grad_batches}, {type(trainer.strategy).__name__}"
        )

    def __call__(self, batch: Any) -> None:
        internals.run_training_step(self.trainer, self.module, batch, self.batches)
        self.batches += 1


def _seeds_workers() -> bool:
    """Whether Lightning seeds the workers (``PL_SEED_WORKERS``, as Lightning reads it).

    Raises:
        InvalidInputError: the variable is not an int >= 0.
    """
    return bool(
        env_int(
            "PL_SEED_WORKERS",
            default=0,
            least=0,
            why="lightning.seed_everything(workers=True) sets it to 1: seed every worker",
        )
    )


def _tuned(trainer: pl.Trainer, result: TuneResult, raw: Any) -> Any:
    """A loader of ``result``'s settings with ``raw``'s dataset and options, its sampler
    the one Lightning would give ``raw`` (a ``DistributedSampler`` under DDP)."""
    loader = raw.flattened[0] if isinstance(raw, CombinedLoader) else raw
    fixed = _fixed(loader)
    if "sampler" in fixed:
        fixed["sampler"] = internals.train_sampler(trainer, loader)
    seeding = loader.worker_init_fn
    if (
        "worker_init_fn" not in fixed
        and seeding is None
        and _seeds_workers()
        and result.params.get("worker_threads") is not None
        and result.params.get("worker_kind") != "threads"
    ):
        # Lightning adds its seeding only to a loader without a worker_init_fn; the one
        # that limits the workers' threads calls it.
        fixed["worker_init_fn"] = internals.lightning_worker_seeding(trainer.global_rank)
    fixed.pop("generator", None)  # the tuned loader's is its own: see drawing_as()
    kwargs = result.loader_kwargs(loader.dataset, batch_size=loader.batch_size, **fixed)
    threads = result.params["worker_kind"] == "threads"
    tuned = drawing_as(loader, loader.dataset, kwargs, threads=threads)
    if isinstance(raw, CombinedLoader):
        raw.flattened = [tuned]
        return raw
    return tuned
