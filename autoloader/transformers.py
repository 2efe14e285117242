"""Tune the train loader of a Hugging Face ``transformers.Trainer``: :func:`tune_trainer`.

Imported on demand (``from autoloader.transformers import tune_trainer``), never by
``import autoloader``: transformers and accelerate are an optional extra,
``pip install "torch-autoloader[transformers]"``.

How it fits the Trainer, from the top down::

    tune_trainer         the checks, then the tuning, then the result applied
    _TrainingStep        one micro-batch of train(), with its optimizer step
    _trainer_loader.py   the Trainer's train loader: what it is made of, and the
                         tuned settings put into it (NOTE [ A Trainer's loader ])
    BatchItems           the items of the Trainer's batches, one sampler for tune()
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from autoloader._exceptions import InvalidInputError
from autoloader._preserve import Restorable, preserved
from autoloader._problem import DEFAULT_TIME_BUDGET
from autoloader._trainer_loader import LoaderMaker, apply_settings, generators_of, tuning_parts
from autoloader._tune import check_passed_through, tune
from autoloader.results import TuneResult
from autoloader.search import SearchSpace, without_batched_fetch

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

__all__ = ["tune_trainer"]

# The oldest releases supported: transformers 4.46 is the first whose training_step()
# takes num_items_in_batch, and Trainer requires accelerate 1.1.
_FLOORS = {"transformers": "4.46", "accelerate": "1.1"}
# tune()'s arguments that tune_trainer() takes from the Trainer.
_FROM_THE_TRAINER = ("dataset", "step_fn", "batch_size", "loader_kwargs", "restore", "device")


def tune_trainer(
    trainer: Trainer,
    *,
    time_budget: float = DEFAULT_TIME_BUDGET,
    path: str | os.PathLike[str] | None = None,
    **tune_kwargs: Any,
) -> TuneResult:
    """Tune the train loader of a Hugging Face ``Trainer``, and make ``trainer.train()``
    use the tuned settings.

    Tunes the loader the Trainer builds (its dataset, data collator, batch size and
    sampler) with the Trainer's own ``training_step()``, the optimizer's step and the
    gradient accumulation included, then applies the result to ``trainer``: through the
    ``TrainingArguments``' ``dataloader_*`` fields where they can say it, else by a
    ``get_train_dataloader()`` that puts the tuned loader (thread workers, limited
    worker thread pools) inside the one accelerate prepares (see
    ``NOTE [ A Trainer's loader ]`` in this module). Tuned ``step_threads`` (the
    training process's torch threads, see ``NOTE [ Step threads ]``) are set in this
    process with ``result.apply_threads()``: ``train()`` runs here.

    Tuning leaves no trace on training: the model, the optimizer (a temporary one when
    the Trainer has none yet), a given LR scheduler, the gradient scaler, the samplers'
    generators and the global random number generators are put back as they were, and
    the tuned loader draws the same random numbers as the Trainer's own (``NOTE [ A
    tuned Trainer loader's draws ]``). With a fixed seed, on the CPU and batches in
    order (``in_order=True``, the default), ``trainer.train()`` ends with the same
    weights, bit for bit, as without ``tune_trainer()``, if the dataset and collator
    draw no random numbers (with workers, those draw from the workers' seeds) and the
    step runs on the threads it had before (tuned ``step_threads`` of another count
    may sum in another order: ``torch.set_num_threads`` back for such a comparison).

    Tuning steps run the model as it is before ``train()``: not yet wrapped for
    distributed training (under torchrun each rank steps alone, and the ranks tune
    together), compiled or checkpointed, so a step may take a little less time than
    in training.

    Args:
        trainer (transformers.Trainer): a Trainer with a ``train_dataset``, before
            ``train()`` (or between two).
        time_budget (float, optional): seconds for the whole tuning run. (default: ``60``)
        path (str or path, optional): a JSON file that keeps the result: where it holds
            the result of the same problem, measured on this machine, that result is
            applied once a short trial of it agrees (nothing searched); else the run
            tunes and saves its result there (see :func:`autoloader.tune`).
            (default: ``None``)
        **tune_kwargs: other arguments of :func:`autoloader.tune`: ``search_space``,
            ``n_trials``, ``memory_budget``, ``storage``, ``show_progress``... The
            dataset, step, batch size, loader options, device and what to restore come
            from the Trainer. ``batched_fetch`` is never searched: the Trainer always
            collates with its data collator.

    Returns:
        TuneResult: the tuned settings, now the Trainer's.

    Raises:
        InvalidInputError: raised before any trial: transformers or accelerate missing
            or older than 4.46 and 1.1; a Trainer without a ``train_dataset``, under
            DeepSpeed or FSDP, whose ``IterableDataset`` accelerate dispatches from one
            process, or whose batches have no one size; an argument that the Trainer
            gives or ``tune()`` does not take. Or any error of :func:`autoloader.tune`.

    Example::

        from autoloader.transformers import tune_trainer

        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        result = tune_trainer(trainer, time_budget=60, path="loader.json")
        trainer.train()
    """
    _check_versions()
    _check_arguments(tune_kwargs)
    _check_trainer(trainer)
    space = _space(tune_kwargs.pop("search_space", None))
    maker = LoaderMaker.of(trainer)
    accelerator = trainer.accelerator
    prepared_before = list(accelerator._dataloaders)
    # get_train_dataloader() may draw (accelerate seeds a sampler for several processes).
    with preserved():
        try:
            original = maker.plain()
            batch_size, fixed = tuning_parts(original)
            with _training(trainer) as step:
                result = tune(
                    original.dataset,
                    step,
                    batch_size=batch_size,
                    time_budget=time_budget,
                    search_space=space,
                    loader_kwargs=fixed,
                    device=_device(trainer.args),
                    restore=[*step.restorable(), *generators_of(original)],
                    path=path,
                    **tune_kwargs,
                )
            apply_settings(trainer, result.params, maker, original)
            # A setting of the process, which the Trainer's loader cannot carry.
            result.apply_threads()
        finally:
            # prepare() keeps each loader it prepared; train() starts by forgetting them.
            accelerator._dataloaders[:] = prepared_before
    return result


def _installed_version(name: str) -> str:
    """The installed version of the distribution ``name``."""
    return metadata.version(name)


def _check_versions() -> None:
    found: dict[str, str] = {}
    for name, floor in _FLOORS.items():
        try:
            found[name] = _installed_version(name)
        except metadata.PackageNotFoundError:
            raise InvalidInputError(
                f"tune_trainer needs {name}>={floor}, which is not installed: "
                'pip install "torch-autoloader[transformers]".'
            ) from None
    from packaging.version import Version  # which both require

    for name, floor in _FLOORS.items():
        if Version(found[name]) < Version(floor):
            raise InvalidInputError(
                f"tune_trainer needs {name}>={floor}, but {name} {found[name]} is "
                'installed: upgrade it, e.g. pip install -U "torch-autoloader[transformers]".'
            )


def _check_arguments(tune_kwargs: Mapping[str, Any]) -> None:
    check_passed_through(
        tune_kwargs,
        caller="tune_trainer",
        given={
            name: "from the Trainer; drop it. To tune another loader, build it in the "
            "Trainer (a subclass's get_train_dataloader()), or call autoloader.tune()."
            for name in _FROM_THE_TRAINER
        },
    )


def _check_trainer(trainer: Trainer) -> None:
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise InvalidInputError(
            f"tune_trainer takes a transformers.Trainer (or a subclass), but got a "
            f"{type(trainer).__qualname__}."
        )
    if trainer.train_dataset is None:
        raise InvalidInputError(
            "tune_trainer tunes the Trainer's train loader, but the Trainer has no "
            "train_dataset: give one, Trainer(..., train_dataset=dataset)."
        )
    if trainer.args.n_gpu > 1:
        raise InvalidInputError(
            f"tune_trainer does not support DataParallel over {trainer.args.n_gpu} GPUs in "
            "one process: each tuning step would run on one. Launch with torchrun, one "
            "process per GPU; the ranks then tune together."
        )
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            raise InvalidInputError(
                f"tune_trainer does not support {name} yet: its training steps need the "
                "engine train() sets up. Tune a Trainer without it (a loader's best "
                "settings hardly depend on it), then set the TrainingArguments' "
                "dataloader_* fields from result.params."
            )


def _space(asked: object) -> SearchSpace:
    """The search space asked for, without batched fetch: it fetches whole batches by
    one indexing, without a collate_fn, and the Trainer always collates."""
    return without_batched_fetch(
        asked,
        refusal="SearchSpace.batched_fetch=True cannot be tuned for a Trainer: it fetches "
        "whole batches without a collate_fn, and the Trainer always collates with its "
        "data collator. Leave batched_fetch unset.",
    )


def _device(args: TrainingArguments) -> torch.device | None:
    """Where batches go in training, for tune()'s timing; ``None`` on the CPU, where
    there is nothing to move or wait for."""
    device: torch.device = args.device
    return None if device.type == "cpu" else device


class _TrainingStep:
    """One micro-batch of the Trainer's training loop, as ``train()`` runs it:
    ``training_step()`` (forward and backward), then every ``gradient_accumulation_steps``
    micro-batches the gradients clipped to ``max_grad_norm``, the optimizer's step
    (through the gradient scaler under fp16), the LR scheduler's step and
    ``zero_grad()``."""

    def __init__(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        self.trainer = trainer
        self.model: torch.nn.Module = trainer.model_wrapped
        self.optimizer = optimizer
        scheduler = trainer.lr_scheduler
        # One that steps on a metric (ReduceLROnPlateau, HF's GreedyLR) steps at evaluations.
        steps_each_batch = isinstance(
            scheduler, torch.optim.lr_scheduler.LRScheduler
        ) and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = (
            scheduler if steps_each_batch else None
        )
        self.accumulation = max(1, int(trainer.args.gradient_accumulation_steps))
        self.max_grad_norm: float = trainer.args.max_grad_norm or 0.0
        self.micro_batches = 0
        # The step's name where a result file records the problem it was tuned for
        # (tune(path=...)): the Trainer's class and the model's.
        self.__module__ = type(trainer).__module__
        args = trainer.args
        precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
        parameters = sum(p.numel() for p in trainer.model.parameters())
        self.__qualname__ = (
            f"{type(trainer).__qualname__}.training_step of {type(trainer.model).__qualname__} "
            f"with {parameters} parameters, {precision}, gradient_accumulation_steps "
            f"{self.accumulation}"
        )

    def restorable(self) -> list[Restorable]:
        """What the step changes: the model, the optimizer, the LR scheduler and the
        gradient scaler it steps."""
        scaler = self.trainer.accelerator.scaler
        stepped = (self.trainer.model, self.optimizer, self.scheduler, scaler)
        return [item for item in stepped if item is not None]

    def __call__(self, batch: Any) -> None:
        trainer = self.trainer
        trainer.training_step(self.model, batch)
        self.micro_batches += 1
        if self.micro_batches % self.accumulation:
            return
        accelerator = trainer.accelerator
        if self.max_grad_norm > 0:
            accelerator.unscale_gradients(optimizer=self.optimizer)  # a no-op but for fp16
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        scaler = accelerator.scaler
        if scaler is None or _is_accelerated(self.optimizer):  # the latter steps through it
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.model.zero_grad()


def _is_accelerated(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is accelerate's wrapper (an earlier ``train()``'s)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return isinstance(optimizer, AcceleratedOptimizer)


@contextmanager
def _training(trainer: Trainer) -> Iterator[_TrainingStep]:
    """The Trainer set up for :class:`_TrainingStep`, and as it was afterwards.

    Before ``train()`` a Trainer has no optimizer unless one was given: a temporary one
    is made as ``train()`` makes its own, and dropped. ``training_step()`` divides the
    loss by ``current_gradient_accumulation_steps``, which only ``train()`` sets.
    """
    optimizer = trainer.optimizer
    made_optimizer = optimizer is None
    attribute = "current_gradient_accumulation_steps"
    had_steps = attribute in vars(trainer)
    steps_before = vars(trainer).get(attribute)
    try:
        if optimizer is None:
            optimizer = trainer.create_optimizer()
        setattr(trainer, attribute, max(1, int(trainer.args.gradient_accumulation_steps)))
        yield _TrainingStep(trainer, optimizer)
    finally:
        if made_optimizer:
            trainer.optimizer = None
        if had_steps:
            setattr(trainer, attribute, steps_before)
        else:
            vars(trainer).pop(attribute, None)
