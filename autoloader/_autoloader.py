"""``AutoLoader``: a DataLoader that tunes its own settings in the first minutes of the
real training run.

NOTE [ Tuning in the training loop ]
``tune()`` measures settings in a run of its own before training. ``AutoLoader`` runs
the same search (the same :class:`~autoloader._session.RunSession`: the same
:class:`~autoloader.search.Policy`, Driver and Optuna study, asked and told one trial at
a time; ``NOTE [ AutoLoader's tuning ]`` in ``_loop_tuning.py`` names its stages)
inside the training loop: the epoch's batches are loaded by one setting after another,
each a trial (going on into the next epoch where the epoch ends first: ``NOTE [ Live
trials span epochs ]``), and a trial's rate is the loop's own, the time between two of
its ``next()`` calls being the real step on the real device
(:class:`~autoloader.measure._live.LiveTrial`).

- **The same batches.** Each epoch draws from the user's generator, and its sampler,
  exactly what ``DataLoader`` draws (the workers' base seed, then the sampler's order),
  and the trials' loaders take turns at that epoch's batches (``NOTE [ Every batch
  once ]``): the loop gets DataLoader's batches in DataLoader's order, whatever the
  switches. The trials' loaders seed their workers from that base seed, through a
  generator of their own: a worker's random augmentation differs from DataLoader's, as
  it does between any two worker counts.
- **Faults stay out of the loop.** A trial that crashes, hangs or passes the memory
  budget is stopped; the batches it had not delivered are loaded again by the last
  setting that completed, and the failure is recorded as in ``tune()``. Only an error
  that the baseline (``num_workers=0``, in this process) raises too reaches the loop,
  as DataLoader would raise it.
- **The end.** Once the policy stops, the chosen setting loads the rest of training
  (its workers persistent across epochs where it chose so), the process keeps the
  tuned ``step_threads``, and the result is saved at ``path`` with its problem's
  identity: a later run of the same problem on the same machine reads it and tunes
  nothing.
- **What it cannot tune, it passes through.** Where the epoch is not a sequence of
  batches of indices that the settings could take turns at (an ``IterableDataset``,
  ``batch_size=None``, a ``batch_sampler``, ``in_order=False``), AutoLoader is the
  DataLoader of its arguments, tuned arguments included, and says once why it does not
  tune (:attr:`AutoLoader.untuned`): it never refuses what DataLoader takes.
- **Checkpoints mid-epoch.** ``state_dict()`` and ``load_state_dict()``, as torchdata's
  ``StatefulDataLoader`` has them (and Lightning saves them): a run resumed from a state
  goes on at the next undelivered batch, with the batches and the generators' states of
  the uninterrupted run, and its tuning where it stood (``NOTE [ An AutoLoader's
  state ]``, in ``_loader_state.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from autoloader._exceptions import InvalidInputError
from autoloader._loader_arguments import (
    check_copied_settings,
    checked_batch_size,
    checked_context,
    kept,
    pass_tuning_to_rebuilds,
    untuned_because,
    workers_only,
)
from autoloader._loader_state import Draws, between_epochs, checked, in_epoch, position_of
from autoloader._loop_epoch import Epoch
from autoloader._loop_tuning import LoopTuning
from autoloader._problem import TuneArguments, check_arguments
from autoloader.checks import world
from autoloader.loader import EpochBatches, Params, changed_options
from autoloader.loader._torch_compat import batches_yielded
from autoloader.results import TrialRecord, TuneResult, record_of, report
from autoloader.search import SearchSpace

_logger = logging.getLogger("autoloader")

_T_co = TypeVar("_T_co", covariant=True)


class TrainingLoop:
    """What stands for the step in an AutoLoader's problem: the user's own loop, named
    by the script that runs it (a result file is reused by the same script only)."""

    def __init__(self) -> None:
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        self.__qualname__ = f"training loop of {Path(script).name if script else 'an interpreter'}"

    def __call__(self, batch: Any) -> None:
        raise NotImplementedError("the training loop is the user's own")  # never called


class AutoLoader(DataLoader[_T_co]):
    """A ``DataLoader`` that finds its fastest safe settings while training runs.

    Takes DataLoader's arguments and is used as one (``for batch in loader``), but
    chooses ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and
    ``pin_memory`` itself (see ``NOTE [ Tuning in the training loop ]``): the first
    ``time_budget`` seconds of training load the batches with one setting after another,
    proposed by the same search as :func:`autoloader.tune`, measured by the loop's own
    pace; then the best loads the rest. Every epoch yields exactly the batches, in the
    order, that ``DataLoader`` with the same arguments and generator yields. Like
    torchdata's ``StatefulDataLoader``, it has :meth:`state_dict` and
    :meth:`load_state_dict` for checkpoints taken mid-epoch (Lightning saves them).

    Where its arguments leave nothing it can tune (an ``IterableDataset``,
    ``batch_size=None``, a ``batch_sampler`` or ``in_order=False``), it is the
    ``DataLoader`` of those arguments, tuned ones included, untuned: :attr:`untuned`
    says why, and it is logged (``autoloader`` logger, WARNING).

    ``dataset``, ``batch_size``, ``shuffle``, ``sampler``, ``collate_fn``,
    ``drop_last``, ``timeout``, ``worker_init_fn``, ``generator`` and
    ``pin_memory_device`` are DataLoader's, kept in every setting; ``n_trials``,
    ``memory_budget``, ``search_space`` and ``seed`` are :func:`autoloader.tune`'s.

    Args:
        multiprocessing_context: the start method of the workers of every setting with
            worker processes, as DataLoader's (threads are then not searched). As
            DataLoader takes it with workers only, AutoLoader takes it with a
            ``search_space`` of ``num_workers`` from 1 (``NOTE [ A rebuilt
            AutoLoader ]``). Given at construction only.
        path (str or path, optional): a JSON file that keeps the tuned settings. A run
            that finds there the result of the same problem (dataset type and length,
            batch size, search space, loader options, device, the training script) on
            this machine starts with it, and times its first batches: outside the
            saved trial's band it tunes from there (``NOTE [ A reused setting
            checked ]``); otherwise it tunes and saves the result there, saying why it
            could not reuse it. (default: ``None``)
        time_budget (float, optional): seconds of training the search may take, from the
            first batch; ``None`` means 60. (default: ``None``)
        device (str or torch.device, optional): the device the loop moves batches to;
            it tells the search whether ``pin_memory`` can help and whether the step
            trains on the CPU (then the process's torch threads are searched too).
            AutoLoader does not move batches. (default: ``None``)
        verbose (bool, optional): print one line to stderr when tuning ends, with what
            it chose. It is logged (``autoloader`` logger, INFO) either way.
            (default: ``True``)
        retune (bool, optional): once tuned, watch the loop's wait for data, and where
            loading became the bottleneck for a sustained stretch (a slower disk, a
            costlier item, a busy node), search again with half the ``time_budget``,
            say why (WARNING) and save the new result at ``path``; at most 3 times a
            run, never twice within 10 such searches' time (``NOTE [ Drift ]``). Off
            under torchrun. (default: ``True``)
        tuning (optional): another AutoLoader's :attr:`tuning`: this one is a copy of it
            that loads through the same tuning, one search whose result both show, as
            Lightning's rebuilds of an AutoLoader with a sampler of its own are (its
            other AutoLoader arguments are the original's). (default: ``None``)

    Attributes:
        result (TuneResult or None): the tuned settings, every trial and the notes, once
            tuning ended (or was read from ``path``); ``None`` where it does not tune.
        untuned (str or None): why it loads as the DataLoader of its arguments without
            tuning, ``None`` where it tunes.
        tuning: its search, shared with its copies (``NOTE [ A rebuilt AutoLoader ]``);
            ``None`` where it does not tune.

    Raises:
        InvalidInputError: before any work, for an argument that is wrong, or a tuned
            argument given (``num_workers=4``: pass a search space instead) where it
            tunes, but for a copy's, its original's.
        ValueError, TypeError: DataLoader's own, for arguments DataLoader refuses.
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        path: str | os.PathLike[str] | None = None,
        time_budget: float | None = None,
        n_trials: int | None = None,
        memory_budget: int | str | None = None,
        search_space: SearchSpace | Mapping[str, Any] | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        verbose: bool = True,
        retune: bool = True,
        tuning: LoopTuning | None = None,
    ) -> None:
        options = {
            "shuffle": shuffle,
            "sampler": sampler,
            "batch_sampler": batch_sampler,
            "num_workers": num_workers,
            "collate_fn": collate_fn,
            "pin_memory": pin_memory,
            "drop_last": drop_last,
            "timeout": timeout,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context,
            "generator": generator,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
            "pin_memory_device": pin_memory_device,
            "in_order": in_order,
        }
        self.tuning: LoopTuning | None = None
        self._context: Any = None
        # NOTE [ Nothing outlives the loop ]: the epoch under way, held by the loop alone.
        self._epoch: weakref.ref[Epoch] | None = None
        self.untuned = untuned_because(dataset, batch_size, options, tuning)
        self.verbose = verbose
        self.retune = retune
        # NOTE [ An AutoLoader's state ]: a state loaded for the next iter(), and, for a
        # loader passed through, the iterator of the epoch under way (the loop holds it).
        self._resume: dict[str, Any] | None = None
        self._passed: tuple[weakref.ref[Any], Draws] | None = None
        self.n_trials = n_trials
        self.memory_budget = memory_budget
        self.search_space = search_space
        self.device = device
        self.seed = seed
        if self.untuned is not None:
            self._pass_through(dataset, batch_size, options, path=path, time_budget=time_budget)
            return
        if tuning is not None:
            self._copy(tuning, dataset, batch_size, options)
            return
        checked_size = checked_batch_size(batch_size, options)
        # DataLoader's own checks first, in its words. Without workers: each setting's
        # loader has its own (the multiprocessing_context theirs).
        super().__init__(dataset, batch_size=checked_size, **kept(options))
        context = checked_context(multiprocessing_context)
        arguments = TuneArguments(
            batch_size=checked_size,
            time_budget=time_budget,
            n_trials=n_trials,
            memory_budget=memory_budget,
            search_space=search_space,
            # The tuned options, batch_sampler and in_order are DataLoader's defaults
            # (checked): those that differ, multiprocessing_context included, are kept
            # in every setting (the context in those with worker processes).
            loader_kwargs=changed_options(options),
            device=device,
            seed=seed,
            show_progress=False,
            path=path,
        )
        self._tune(dataset, arguments, context)

    def _tune(self, dataset: Dataset[_T_co], arguments: TuneArguments, context: Any) -> None:
        """Tune these arguments (``context``: the workers' start method, checked): the
        problem checked, and the tuning that loads through this loader from its first
        batch."""
        step = TrainingLoop()
        # Whether workers can be sent the dataset is asked where the search starts
        # (LoopTuning): none is needed before, nor at all where it cannot be.
        problem = check_arguments(None, dataset, step, arguments, check_pickling=False)
        self.path = problem.path
        self.time_budget: float | None = problem.budget
        # Under torchrun, checked again as one rank of the job once the ranks have joined.
        problem_of = functools.partial(
            check_arguments,
            dataset=dataset,
            step_fn=step,
            arguments=arguments,
            check_pickling=False,
        )
        if context is not None and not workers_only(problem.space):
            raise ValueError(
                "multiprocessing_context can only be used with multi-process loading "
                "(num_workers > 0), but got num_workers=0 among the settings AutoLoader may "
                "choose. Pass search_space={'num_workers': (1, ...)} to search worker "
                "processes only, started with this context, or drop it and set the "
                "process's start method: torch.multiprocessing.set_start_method(...)."
            )
        self._context = context
        self._problem_key = problem.key()  # what a state loaded must be of
        self.tuning = LoopTuning(
            self, problem, problem_of, threads=torch.get_num_threads(), retune=self.retune
        )
        weakref.finalize(self, self.tuning.gone)
        pass_tuning_to_rebuilds(self, self.tuning)

    def _copy(
        self,
        tuning: LoopTuning,
        dataset: Dataset[_T_co],
        batch_size: int | None,
        options: Mapping[str, Any],
    ) -> None:
        """Be a copy of the AutoLoader of ``tuning``, loading through it
        (``NOTE [ A rebuilt AutoLoader ]``)."""
        check_copied_settings(tuning, options)
        super().__init__(dataset, batch_size=batch_size, **kept(options))
        self._context = checked_context(options["multiprocessing_context"])
        self.path = tuning.problem.path
        self._problem_key = tuning.problem.key()
        home = tuning.retuning.home  # NOTE [ Drift ]: the problem as given
        self.time_budget = (tuning.problem if home is None else home).budget
        self.retune = tuning.retune  # the original's, as its tuning is
        self.tuning = tuning
        tuning.share(self)
        weakref.finalize(self, tuning.gone)
        pass_tuning_to_rebuilds(self, tuning)

    def _pass_through(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None,
        options: Mapping[str, Any],
        *,
        path: str | os.PathLike[str] | None,
        time_budget: float | None,
    ) -> None:
        """Be the DataLoader of these arguments, untuned, and say why once (``path`` and
        ``time_budget`` kept as given, unused: the loader is DataLoader's)."""
        self.path = None if path is None else Path(path)
        self.time_budget = time_budget
        super().__init__(dataset, batch_size, **options)
        line = f"AutoLoader: not tuning, {self.untuned}; it loads as DataLoader would"
        _logger.warning("%s", line)
        if self.verbose and world()[0] == 0:
            print(line, file=sys.stderr, flush=True)

    @property
    def result(self) -> TuneResult | None:
        return None if self.tuning is None else self.tuning.result

    @property
    def tuned(self) -> bool:
        """Whether the settings are chosen (tuning ended, or was read from ``path``);
        never, for a loader that does not tune (:attr:`untuned`)."""
        return self.result is not None

    @property
    def history(self) -> list[TrialRecord]:
        """Every trial so far, as :attr:`TuneResult.trials` records them. Under
        torchrun the study runs on rank 0: other ranks see the trials once tuned."""
        if self.tuning is None:
            return []
        if self.tuning.result is not None:
            return list(self.tuning.result.trials)
        return [record_of(trial) for trial in self.tuning.history]

    @property
    def setting(self) -> Params | None:
        """The setting loading the current epoch's batches now (a trial's, while it
        tunes), ``None`` between epochs and where it does not tune. Where a copy
        shares its tuning (Lightning's rebuilt loader, ``NOTE [ A rebuilt AutoLoader
        ]``), the copy's epoch, where this loader has none going."""
        epoch = self._current_epoch()
        if epoch is None and self.tuning is not None and self.tuning.epoch is not None:
            epoch = self.tuning.epoch()
        trial = None if epoch is None else epoch.trial
        return None if trial is None else dict(trial.params)

    @property
    def failures(self) -> list[str]:
        """What went wrong in a setting and was kept from the loop, in order."""
        return [] if self.tuning is None else list(self.tuning.failures)

    @property
    def multiprocessing_context(self) -> Any:
        """As DataLoader's: the start method of the workers (a context). Where it tunes,
        that of every setting with worker processes, which AutoLoader takes at
        construction only (``NOTE [ A rebuilt AutoLoader ]``)."""
        if self.tuning is None:
            return super().multiprocessing_context
        return self._context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        if self.tuning is None:  # DataLoader's own, as its __init__ sets it
            DataLoader.multiprocessing_context.fset(self, context)  # type: ignore[attr-defined]
            return
        if context is not self._context:
            raise InvalidInputError(
                "AutoLoader takes its multiprocessing_context at construction: its "
                "settings are searched with it. Make a new AutoLoader with "
                f"multiprocessing_context={context!r}."
            )

    def report(self) -> str:
        """The tuning run's report (:func:`autoloader.report`), or where it stands."""
        if self.tuning is None:
            return f"AutoLoader: not tuned, {self.untuned}: it loads as DataLoader would."
        if self.tuning.result is not None:
            return report(self.tuning.result)
        return (
            f"AutoLoader: tuning, {len(self.history)} trials so far; the report comes once it ends."
        )

    def close(self) -> None:
        """Stop the workers now: those of an epoch left unfinished, of a trial waiting
        for the next epoch, and the chosen setting's persistent ones, which its copies
        share (a later epoch starts new ones; ``NOTE [ A rebuilt AutoLoader ]``). An
        epoch the loop dropped, the loader's garbage collection and the interpreter's
        exit stop them too (``NOTE [ Nothing outlives the loop ]``). The process's torch
        threads are put back as they were when the loader was made, where the chosen
        setting's ``step_threads`` set them (a later epoch sets those again: ``NOTE [
        Threads put back ]``)."""
        if self.tuning is None:
            # As DataLoader's own: its persistent workers, where it keeps them.
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._iterator = None
            return
        tuning = self.tuning
        epoch, self._epoch = self._current_epoch(), None
        with contextlib.ExitStack() as stack:
            stack.callback(tuning.loaders.put_back_threads, tuning.threads)
            stack.callback(tuning.release)
            if epoch is not None:
                stack.callback(epoch.close)
            tuning.settle()
            tuning.end_carried()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, for a checkpoint, as torchdata's ``StatefulDataLoader``
        gives it: at any time, mid-epoch included (between two ``next()`` calls), in
        plain values and tensors. Lightning saves it in its checkpoints.

        It holds the epoch's position (the batches the loop got of the epoch it holds,
        and the generators' states at its start) and where the tuning stands (the
        trials finished, or the result and the setting chosen). See ``NOTE [ An
        AutoLoader's state ]``.
        """
        if self._resume is not None:  # loaded, for the next epoch
            return dict(self._resume)
        if self.tuning is None:
            state = self._passed_state()
        else:
            epoch = self._current_epoch()
            state = (
                between_epochs(self)
                if epoch is None or epoch.done or epoch.batches.all_done
                else in_epoch(epoch.draws, epoch.batches.done)
            )
            state["_problem"] = self._problem_key
            state["_tuning"] = self.tuning.state()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` of an AutoLoader of the same arguments (in an
        earlier run): the next ``iter()`` goes on at the first batch the loop had not
        got, with the batches and generators' states of the uninterrupted run, and the
        tuning goes on where it stood, measuring no finished trial again; or, tuned,
        keeps the setting chosen. An empty dict changes nothing (as torchdata's).

        Raises:
            InvalidInputError: ``state_dict`` is not an AutoLoader's state, is of a
                loader of other arguments, or this loader has started tuning.
        """
        if not state_dict:
            return
        state = checked(state_dict, None if self.tuning is None else self._problem_key)
        tuning = state.get("_tuning")
        if self.tuning is not None and tuning is not None:
            self.tuning.resume(tuning)
        self._resume = state

    def _passed_state(self) -> dict[str, Any]:
        """:meth:`state_dict` of a loader passed through, DataLoader's iterator counting
        the batches delivered."""
        iterator = None if self._passed is None else self._passed[0]()
        if iterator is None or self._passed is None:
            return between_epochs(self)
        done = batches_yielded(iterator)
        try:
            length: int | None = len(self)
        except TypeError:  # an IterableDataset without a length
            length = None
        if length is not None and done >= length:
            return between_epochs(self)
        return in_epoch(self._passed[1], done)

    def _draws(self) -> tuple[Draws, int, contextlib.AbstractContextManager[None]]:
        """The epoch's generators' states at its start, the batches to skip, and where
        to draw it: a state loaded, replayed, or the generators as they are."""
        resume, self._resume = self._resume, None
        if resume is None:
            return Draws.now(self, global_too=True), 0, contextlib.nullcontext()
        draws, skip = position_of(resume)
        return draws, skip, draws.replayed(self)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.tuning is None:
            draws, skip, drawing = self._draws()
            with drawing:
                iterator = super().__iter__()
                for _ in range(skip):  # NOTE [ An AutoLoader's state ]: loaded and dropped
                    if next(iterator, _END) is _END:
                        break
            self._passed = (weakref.ref(iterator), draws)
            return iterator
        tuning = self.tuning
        tuning.loads(self)
        tuning.settle()
        previous = self._current_epoch()
        if previous is not None:
            previous.close()  # the loop left the last epoch before its end
        draws, skip, drawing = self._draws()
        with drawing:
            # What DataLoader's iterator draws, in its order: the sampler's iterator, then
            # the base seed of the workers, from the user's generator.
            indices = iter(self._index_sampler)
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
            batches = EpochBatches(indices, length=_length(self._index_sampler))
            batches.fast_forward(skip)
        epoch = Epoch(self, tuning, batches, seed, draws)
        self._epoch = tuning.epoch = weakref.ref(epoch)
        return epoch

    def _current_epoch(self) -> Epoch | None:
        return None if self._epoch is None else self._epoch()

    # NOTE [ AutoLoader under accelerate ] (autoloader/accelerate.py): accelerate asks
    # each DataLoader given to prepare() whether it was prepared already; a tuning
    # AutoLoader answers with the refusal, which reaches the user's prepare() call.
    @property
    def _is_accelerate_prepared(self) -> bool:
        if self.tuning is None:
            # Untuned, it is DataLoader: accelerate rebuilds it as it rebuilds one.
            raise AttributeError("_is_accelerate_prepared")
        raise InvalidInputError(
            "accelerator.prepare() rebuilds the DataLoaders given to it as plain "
            "DataLoaders from their attributes, so this AutoLoader would load untuned, "
            "with num_workers=0. Prepare it with autoloader.accelerate.prepare(), which "
            "takes and returns what accelerator.prepare() does and keeps it tuning with "
            "accelerate's sharding and device placement: model, optimizer, loader = "
            "autoloader.accelerate.prepare(accelerator, model, optimizer, loader) (in a "
            "Trainer's get_train_dataloader(): return "
            "autoloader.accelerate.prepare(self.accelerator, loader))."
        )

    def _load_batches_of(self, batch_sampler: Sampler[list[Any]]) -> None:
        """Load ``batch_sampler``'s batches from the next epoch on: accelerate's share
        of this loader's batches for this process (``NOTE [ AutoLoader under
        accelerate ]``)."""
        assert self.tuning is not None, "an untuned AutoLoader is accelerate's to rebuild"
        # DataLoader refuses a new batch_sampler once built, which its iterator (kept
        # with persistent workers) would not see; a tuning AutoLoader draws each epoch's
        # batches afresh from its batch_sampler (__iter__), and never uses that iterator.
        object.__setattr__(self, "batch_sampler", batch_sampler)


_END = object()


def _length(sampler: object) -> int | None:
    """``len(sampler)``, or ``None`` where it has none."""
    try:
        return len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
