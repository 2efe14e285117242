"""``AutoLoader``: a DataLoader that tunes its own settings in the first minutes of the
real training run.

NOTE [ Tuning in the training loop ]
``tune()`` measures settings in a run of its own before training. ``AutoLoader`` runs
the same search (the same :class:`~autoloader._session.RunSession`: the same
:class:`~autoloader.search.Policy`, Driver and Optuna study, asked and told one trial at
a time; ``NOTE [ AutoLoader's tuning ]`` in ``_loop_tuning.py`` names its stages)
inside the training loop: the epoch's batches are loaded by one setting after another,
each a trial, and a trial's rate is the loop's own, the time between two of its
``next()`` calls being the real step on the real device
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from autoloader._exceptions import InvalidInputError
from autoloader._loader_state import Draws, between_epochs, checked, in_epoch, position_of
from autoloader._loop_tuning import LoopTuning
from autoloader._problem import TuneArguments, check_arguments
from autoloader.checks import world
from autoloader.loader import DATALOADER_DEFAULTS, EpochBatches, Params, changed_options
from autoloader.loader._torch_compat import batches_yielded, exiting
from autoloader.measure import LiveTrial, TrialEnded
from autoloader.results import TrialRecord, TuneResult, record_of, report
from autoloader.search import SearchSpace

_logger = logging.getLogger("autoloader")

_T_co = TypeVar("_T_co", covariant=True)

# DataLoader's arguments that AutoLoader chooses: given, each must have DataLoader's default.
_TUNED_ARGUMENTS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")


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
        multiprocessing_context: as DataLoader's, which takes it with workers only:
            AutoLoader chooses them, so it takes none (set the process's start method,
            ``torch.multiprocessing.set_start_method``, instead); passed through to a
            loader it does not tune.
        path (str or path, optional): a JSON file that keeps the tuned settings. A run
            that finds there the result of the same problem (dataset type and length,
            batch size, search space, loader options, device, the training script) on
            this machine starts with it and tunes nothing; otherwise it tunes and saves
            the result there, saying why it could not reuse it. (default: ``None``)
        time_budget (float, optional): seconds of training the search may take, from the
            first batch; ``None`` means 60. (default: ``None``)
        device (str or torch.device, optional): the device the loop moves batches to;
            it tells the search whether ``pin_memory`` can help and whether the step
            trains on the CPU (then the process's torch threads are searched too).
            AutoLoader does not move batches. (default: ``None``)
        verbose (bool, optional): print one line to stderr when tuning ends, with what
            it chose. It is logged (``autoloader`` logger, INFO) either way.
            (default: ``True``)

    Attributes:
        result (TuneResult or None): the tuned settings, every trial and the notes, once
            tuning ended (or was read from ``path``); ``None`` where it does not tune.
        untuned (str or None): why it loads as the DataLoader of its arguments without
            tuning, ``None`` where it tunes.

    Raises:
        InvalidInputError: before any work, for an argument that is wrong, a tuned
            argument given (``num_workers=4``: pass a search space instead) or a
            ``multiprocessing_context``, where it tunes.
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
        self.untuned = _untuned_because(dataset, batch_size, options)
        self.verbose = verbose
        # NOTE [ An AutoLoader's state ]: a state loaded for the next iter(), and, for a
        # loader passed through, the iterator of the epoch under way (the loop holds it).
        self._resume: dict[str, Any] | None = None
        self._passed: tuple[weakref.ref[Any], Draws] | None = None
        if self.untuned is not None:
            # The rest kept as given, unused: the loader is DataLoader's.
            self.path = None if path is None else Path(path)
            self.time_budget: float | None = time_budget
            self.n_trials = n_trials
            self.memory_budget = memory_budget
            self.search_space = search_space
            self.device = device
            self.seed = seed
            self._pass_through(dataset, batch_size, options)
            return
        checked_batch_size = _checked_batch_size(batch_size, options)
        # DataLoader's own checks first, in its words. Without workers: each setting's
        # loader has its own.
        kept = {name: value for name, value in options.items() if name not in _TUNED_ARGUMENTS}
        super().__init__(dataset, batch_size=checked_batch_size, **kept)
        arguments = TuneArguments(
            batch_size=checked_batch_size,
            time_budget=time_budget,
            n_trials=n_trials,
            memory_budget=memory_budget,
            search_space=search_space,
            # The tuned options, multiprocessing_context, batch_sampler and in_order are
            # DataLoader's defaults (checked): those that differ are kept in every setting.
            loader_kwargs=changed_options(options),
            device=device,
            seed=seed,
            show_progress=False,
            path=path,
        )
        step = TrainingLoop()
        # Whether workers can be sent the dataset is asked where the search starts
        # (LoopTuning): none is needed before, nor at all where it cannot be.
        problem = check_arguments(None, dataset, step, arguments, check_pickling=False)
        self.path = problem.path
        self.time_budget = problem.budget
        self.n_trials = n_trials
        self.memory_budget = memory_budget
        self.search_space = search_space
        self.device = device
        self.seed = seed
        # Under torchrun, checked again as one rank of the job once the ranks have joined.
        problem_of = functools.partial(
            check_arguments,
            dataset=dataset,
            step_fn=step,
            arguments=arguments,
            check_pickling=False,
        )
        tuning = LoopTuning(self, problem, problem_of, threads=torch.get_num_threads())
        self._problem_key = problem.key()  # what a state loaded must be of
        self._tuning: LoopTuning | None = tuning
        # NOTE [ Nothing outlives the loop ]: the epoch under way, held by the loop alone.
        self._epoch: weakref.ref[_Epoch] | None = None
        weakref.finalize(self, tuning.release)

    def _pass_through(
        self, dataset: Dataset[_T_co], batch_size: int | None, options: Mapping[str, Any]
    ) -> None:
        """Be the DataLoader of these arguments, untuned, and say why once."""
        super().__init__(dataset, batch_size, **options)
        self._tuning = None
        self._epoch = None
        line = f"AutoLoader: not tuning, {self.untuned}; it loads as DataLoader would"
        _logger.warning("%s", line)
        if self.verbose and world()[0] == 0:
            print(line, file=sys.stderr, flush=True)

    @property
    def result(self) -> TuneResult | None:
        return None if self._tuning is None else self._tuning.result

    @property
    def tuned(self) -> bool:
        """Whether the settings are chosen (tuning ended, or was read from ``path``);
        never, for a loader that does not tune (:attr:`untuned`)."""
        return self.result is not None

    @property
    def history(self) -> list[TrialRecord]:
        """Every trial so far, as :attr:`TuneResult.trials` records them."""
        if self._tuning is None:
            return []
        if self._tuning.result is not None:
            return list(self._tuning.result.trials)
        return [record_of(trial) for trial in self._tuning.history]

    @property
    def setting(self) -> Params | None:
        """The setting loading the current epoch's batches now (a trial's, while it
        tunes), ``None`` between epochs and where it does not tune."""
        epoch = self._current_epoch()
        trial = None if epoch is None else epoch.trial
        return None if trial is None else dict(trial.params)

    @property
    def failures(self) -> list[str]:
        """What went wrong in a setting and was kept from the loop, in order."""
        return [] if self._tuning is None else list(self._tuning.failures)

    def report(self) -> str:
        """The tuning run's report (:func:`autoloader.report`), or where it stands."""
        if self._tuning is None:
            return f"AutoLoader: not tuned, {self.untuned}: it loads as DataLoader would."
        if self._tuning.result is not None:
            return report(self._tuning.result)
        return (
            f"AutoLoader: tuning, {len(self.history)} trials so far; the report comes once it ends."
        )

    def close(self) -> None:
        """Stop the workers now: those of an epoch left unfinished, and the chosen
        setting's persistent ones (a later epoch starts new ones). An epoch the loop
        dropped, the loader's garbage collection and the interpreter's exit stop them
        too (``NOTE [ Nothing outlives the loop ]``)."""
        if self._tuning is None:
            # As DataLoader's own: its persistent workers, where it keeps them.
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._iterator = None
            return
        tuning = self._tuning
        epoch, self._epoch = self._current_epoch(), None
        with contextlib.ExitStack() as stack:
            stack.callback(tuning.release)
            if epoch is not None:
                stack.callback(epoch.close)
            tuning.settle()

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
        if self._tuning is None:
            state = self._passed_state()
        else:
            epoch = self._current_epoch()
            state = (
                between_epochs(self)
                if epoch is None or epoch.done or epoch.batches.all_done
                else in_epoch(epoch.draws, epoch.batches.done)
            )
            state["_problem"] = self._problem_key
            state["_tuning"] = self._tuning.state()
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
        state = checked(state_dict, None if self._tuning is None else self._problem_key)
        tuning = state.get("_tuning")
        if self._tuning is not None and tuning is not None:
            self._tuning.resume(tuning)
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
        if self._tuning is None:
            draws, skip, drawing = self._draws()
            with drawing:
                iterator = super().__iter__()
                for _ in range(skip):  # NOTE [ An AutoLoader's state ]: loaded and dropped
                    if next(iterator, _END) is _END:
                        break
            self._passed = (weakref.ref(iterator), draws)
            return iterator
        tuning = self._tuning
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
        epoch = _Epoch(self, tuning, batches, seed, draws)
        self._epoch = weakref.ref(epoch)
        return epoch

    def _current_epoch(self) -> _Epoch | None:
        return None if self._epoch is None else self._epoch()

    # NOTE [ AutoLoader under accelerate ] (autoloader/accelerate.py): accelerate asks
    # each DataLoader given to prepare() whether it was prepared already; a tuning
    # AutoLoader answers with the refusal, which reaches the user's prepare() call.
    @property
    def _is_accelerate_prepared(self) -> bool:
        if self._tuning is None:
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
        assert self._tuning is not None, "an untuned AutoLoader is accelerate's to rebuild"
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


def _untuned_because(
    dataset: object, batch_size: int | None, options: Mapping[str, Any]
) -> str | None:
    """Why AutoLoader cannot tune these arguments (``options``: its other DataLoader
    arguments after ``dataset`` and ``batch_size``, by name), or ``None`` where it can.
    Each setting takes turns at the epoch's batches of indices, in the sampler's order
    (``NOTE [ Every batch once ]``)."""
    if isinstance(dataset, IterableDataset):
        return (
            "an IterableDataset has no batches of indices for the settings to take turns "
            "at (autoloader.tune() and result.make_loader() tune one)"
        )
    if options["batch_sampler"] is not None:
        return "it takes batch_size and a per-item sampler, not a batch_sampler"
    if batch_size is None:
        return "it times the loop in batches, and batch_size=None loads items one at a time"
    if options["in_order"] is not True:
        return (
            "out of order (in_order=False), a setting that fails could not say which "
            "batches it had delivered"
        )
    return None


def _checked_batch_size(batch_size: int | None, options: Mapping[str, Any]) -> int:
    """``batch_size``, once AutoLoader takes its arguments to tune (``options``: its
    other DataLoader arguments after ``dataset``, by name).

    Raises:
        InvalidInputError: for what AutoLoader does not take where it tunes.
    """
    for name in _TUNED_ARGUMENTS:
        value = options[name]
        if value != DATALOADER_DEFAULTS[name]:
            raise InvalidInputError(
                f"AutoLoader chooses {name} itself, but got {name}={value!r}. Remove it; to "
                f"search only some values pass search_space={{{name!r}: ...}}, or use a "
                "DataLoader with your own setting."
            )
    if options["multiprocessing_context"] is not None:
        # DataLoader's own words: AutoLoader is built with num_workers=0 (it chooses them).
        raise InvalidInputError(
            "multiprocessing_context can only be used with multi-process loading "
            "(num_workers > 0), but got num_workers=0: AutoLoader chooses num_workers "
            "itself, so it takes no multiprocessing_context. To start its workers with "
            "another method, set the process's: "
            "torch.multiprocessing.set_start_method('spawn')."
        )
    assert batch_size is not None, "batch_size=None is passed through"
    return batch_size


# NOTE [ Nothing outlives the loop ]
# A trial holds a thread (the memory watch), the SIGCHLD and SIGALRM handlers, and its
# loader's workers. Left running after the loop stopped using them, the watch would
# kill processes of the user's long after (it acts only on the trial's workers, but a
# stale trial is nobody's to judge). So the loop alone holds the epoch: the loader keeps
# a weak reference to it, and the epoch holds the loader. When the loop drops it (a
# ``break``, an exception, Ctrl-C), its finalizer ends the trial under way where it
# stands and stops all it holds (``LiveTrial.close``), at once in CPython; the study is
# told how the trial went at the loader's next epoch or ``close()``, in the loop's own
# code, not in a finalizer (under torchrun that takes a collective). The search holds
# the loader by a weak reference too, so a loader nobody holds is collected at once,
# and its finalizer stops the chosen setting's persistent workers. Both finalizers run
# at the interpreter's exit too, where the workers are killed: DataLoader's own
# shutdown does nothing then. A finalizer the garbage collector runs in another thread
# stops the threads and the workers; the handlers, which only the main thread can
# set, are put back by the next trial there (``NOTE [ Handlers put back ]``).


@dataclass(slots=True)
class _Current:
    """The trial under way in an epoch: what its finalizer stops."""

    trial: LiveTrial | None = None


class _Epoch(Iterator[Any]):
    """One pass over an AutoLoader: each batch from the trial under way, the next trial
    started where one ends."""

    def __init__(
        self,
        owner: AutoLoader[Any],
        tuning: LoopTuning,
        batches: EpochBatches,
        seed: int,
        draws: Draws,
    ) -> None:
        self.owner = owner  # NOTE [ Nothing outlives the loop ]
        self.tuning = tuning
        self.batches = batches
        self.seed = seed
        self.draws = draws  # the generators' states at its start
        self.current = _Current()
        self.done = False
        weakref.finalize(self, _abandon, self.tuning, self.current)

    @property
    def trial(self) -> LiveTrial | None:
        return self.current.trial

    def __iter__(self) -> _Epoch:
        return self

    def __len__(self) -> int:
        return len(self.owner)

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        while True:
            trial = self.current.trial
            if trial is None:
                trial = self.current.trial = self.tuning.start_trial(self.batches, self.seed)
            try:
                return trial.next()
            except TrialEnded:
                self._end_trial()
            except StopIteration:
                self.done = True
                self.batches.exhaust()
                self._end_trial()
                raise

    def _end_trial(self) -> None:
        trial, self.current.trial = self.current.trial, None
        assert trial is not None
        trial.end()
        undelivered = trial.feed.in_flight
        trial.close()
        self.tuning.trial_ended(trial, undelivered)

    def close(self) -> None:
        """The loop left this epoch: end its trial where it stands."""
        self.done = True
        if self.current.trial is not None:
            self._end_trial()


def _abandon(tuning: LoopTuning, current: _Current) -> None:
    """The loop dropped an epoch: end its trial where it stands and stop all it holds;
    the study is told at the loader's next epoch (``NOTE [ Nothing outlives the loop ]``)."""
    trial, current.trial = current.trial, None
    if trial is None:
        return
    try:
        trial.end()
        undelivered = trial.feed.in_flight
        trial.close(kill=exiting())
    except Exception:
        _logger.warning("AutoLoader: stopping an abandoned epoch's trial failed", exc_info=True)
        return
    tuning.abandoned.append((trial, undelivered))
