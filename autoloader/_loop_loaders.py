"""The loaders AutoLoader's tuning loads the epoch's batches with, and what a setting
sets beyond its loader: a setting's DataLoader over the batches a Feed hands it
(:func:`setting_loader`), the trials' loaders and the chosen setting's, kept across
epochs (:class:`Loaders`), the attributes an AutoLoader shows of the setting chosen
(:func:`shown_setting`), the process's torch threads (:func:`set_threads`), and the
settings searched where workers could not be sent the dataset
(:func:`workers_only_where_picklable`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoloader._drift import DriftWatch
from autoloader._loop_reuse_check import FirstBatchesCheck
from autoloader._problem import Problem, workers_unpicklable
from autoloader.loader import (
    EpochBatches,
    Feed,
    Params,
    dataloader_kwargs,
    merge_loader_kwargs,
    new_loader,
    set_step_threads,
)
from autoloader.measure import Deadlines, LiveTrial, Measurement, WindowCallback, release

_logger = logging.getLogger("autoloader")


class Loaders:
    """The loaders of one tuning's trials, each over the epoch's batches a
    :class:`~autoloader.loader.Feed` hands it: a new one for each trial (:meth:`trial`),
    and the chosen setting's (:meth:`serve`), kept across epochs where its workers
    persist until :meth:`release_kept`."""

    def __init__(self) -> None:
        # The chosen setting's loader, kept across epochs where its workers persist.
        self.kept: tuple[DataLoader[Any], Feed] | None = None
        # The last search trial's loader, its workers kept until the next loader is
        # made: the chosen setting's, where the search chose it (NOTE [ The last
        # trial's workers kept ]).
        self.parked: tuple[Params, DataLoader[Any], Feed] | None = None
        # The chosen setting's torch threads, set for training; the process's, found
        # when the AutoLoader was made, put back by close() (NOTE [ Threads put back ]).
        self.step_threads: int | None = None
        self._put_back = False

    # NOTE [ Threads put back ]
    # The chosen setting's step_threads are the process's while it trains: set when
    # tuning ends (TUNED), as LoaderTuner sets them for a fit. close() puts back the
    # threads the process had when the AutoLoader was made, where the chosen ones are
    # still set (a count the user set since is theirs), so that they do not outlive the
    # loader; an epoch after close(), which starts the chosen setting's workers anew,
    # sets them again. A search started again (drift) puts the process's back first.
    def choose_threads(self, threads: int | None) -> None:
        """TUNED: the chosen setting's ``threads`` (``None``: leave the process's)."""
        self.step_threads, self._put_back = threads, False
        if threads is not None:
            torch.set_num_threads(threads)

    def put_back_threads(self, found: int) -> None:
        """close(): the process's ``found`` threads, where the chosen ones are still set."""
        if self.step_threads is not None and torch.get_num_threads() == self.step_threads:
            torch.set_num_threads(found)
            self._put_back = True

    def trial(
        self,
        problem: Problem,
        params: Params,
        batches: EpochBatches,
        seed: int,
        *,
        memory_share: int = 1,
        limit: int | None = None,
        max_seconds: float | None = None,
        deadlines: Deadlines | None = None,
        on_window: WindowCallback | None = None,
    ) -> LiveTrial:
        """A trial of ``params`` over ``batches`` (at most ``limit``), measured where it
        has ``max_seconds``, with its share of the memory budget then."""
        self.release_parked()
        feed = Feed(batches, limit=limit)
        return LiveTrial(
            # Its workers kept at an epoch's edge (NOTE [ Live trials span epochs ]).
            setting_loader(problem, params, feed, seed, keep_workers=True),
            feed,
            params,
            batch_size=problem.batch_size,
            memory_budget=problem.memory_bytes // memory_share if max_seconds is not None else None,
            max_seconds=max_seconds,
            deadlines=deadlines,
            on_window=on_window,
        )

    def serve(
        self,
        problem: Problem,
        params: Params,
        batches: EpochBatches,
        seed: int,
        *,
        deadlines: Deadlines | None,
        check: FirstBatchesCheck | None,
        drift: DriftWatch | None,
    ) -> LiveTrial:
        """TUNED: the chosen setting, for the rest of training: one loader kept across
        epochs where its workers persist; its first batches timed by ``check`` (a reused
        setting's), else its wait for data told to ``drift`` (``NOTE [ Drift ]``)."""
        if self._put_back:  # NOTE [ Threads put back ]
            self.choose_threads(self.step_threads)
        persistent = bool(params.get("persistent_workers"))
        parked, self.parked = self.parked, None
        if persistent and self.kept is None and parked is not None and parked[0] == params:
            _, loader, feed = parked  # NOTE [ The last trial's workers kept ]
            feed.limit = None
            self.kept = (loader, feed)
        elif parked is not None:
            release(parked[1])
        if persistent and self.kept is not None:
            loader, feed = self.kept
            feed.point_at(batches)
        else:
            feed = Feed(batches)
            loader = setting_loader(problem, params, feed, seed, keep_workers=persistent)
            if persistent:
                self.kept = (loader, feed)
        if check is not None:
            drift = None
        trial = LiveTrial(
            loader,
            feed,
            params,
            batch_size=problem.batch_size,
            memory_budget=None,
            max_seconds=None if check is None else math.inf,
            deadlines=deadlines,
            on_window=None if check is None else check.on_window,
            keep_workers=persistent,
            on_batch=None if drift is None else drift.batch,
        )
        if check is not None:
            check.begin(trial.guard.weak_worker_pids())
        return trial

    # NOTE [ The last trial's workers kept ]
    # A search trial's workers stop at its end, and the chosen setting's loader starts
    # its own: where the search's last trial measured the setting it then chose (the
    # runoff's, under torchrun above all, where no drain hides the start: NOTE [
    # Overlapped start-up ]), the loop stalled for a start-up of workers it had just
    # stopped. In a 2-rank Lightning DDP fit of 12-batch epochs (benchmarks/
    # ddp_short_epochs.py) each start of 12 workers stalled the loop 0.4-0.5 s, a tenth
    # of tuning's cost to the run. So a trial of persistent workers that ended well
    # (its batches delivered, its setting not failed) keeps its workers, parked, until
    # the next loader is made: the chosen setting's adopts them, its feed pointed at the
    # epoch's batches with no limit, as a kept loader's at an epoch's edge; any other
    # loader (a trial's, the making up of a failed setting's batches, another setting
    # chosen) stops them first, so that at most one parked loader lives, and nothing
    # outlives the tuning: releasing the kept loader releases the parked one too.
    def park(self, trial: LiveTrial) -> None:
        """``trial``, a search trial with no successor started, ends: where its workers
        persist and it ended well, keep them past its end, for the chosen setting's
        loader."""
        params = trial.params
        if not (isinstance(trial.outcome, Measurement) and params["num_workers"] > 0):
            return
        if params["persistent_workers"]:
            self.release_parked()
            trial.keep_workers = True
            self.parked = (params, trial.loader, trial.feed)

    def release_parked(self) -> None:
        """Stop a parked trial's workers (``NOTE [ The last trial's workers kept ]``)."""
        parked, self.parked = self.parked, None
        if parked is not None:
            release(parked[1])

    def release_kept(self) -> None:
        """Stop the kept loader's persistent workers, and a parked trial's; the next
        loader starts its own."""
        self.release_parked()
        if self.kept is not None:
            loader, _ = self.kept
            self.kept = None
            release(loader)


def setting_loader(
    problem: Problem, params: Params, feed: Feed, seed: int, *, keep_workers: bool
) -> DataLoader[Any]:
    """A loader of ``params``, for ``problem``, over the batches ``feed`` hands it, its
    workers seeded from the epoch's base seed and, with ``keep_workers``, kept from one
    iteration to the next (DataLoader's ``persistent_workers``)."""
    options = merge_loader_kwargs(
        {**params, "batched_fetch": False},
        batch_size=problem.batch_size,
        fixed=problem.fixed,
        overrides={"persistent_workers": keep_workers},
    )
    kwargs = dataloader_kwargs(problem.dataset, options)
    for name in ("batch_size", "shuffle", "sampler", "drop_last"):
        kwargs.pop(name, None)
    kwargs["generator"] = torch.Generator().manual_seed(seed)
    if kwargs["num_workers"] == 0:
        kwargs["timeout"] = 0  # DataLoader takes a timeout with workers only
    if params.get("batched_fetch"):  # NOTE [ Batched fetch ]: each index a batch's
        kwargs.pop("collate_fn", None)
        kwargs.update(batch_size=None, sampler=feed)
    else:
        kwargs["batch_sampler"] = feed
    return new_loader(problem.dataset, kwargs, threads=params.get("worker_kind") == "threads")


def shown_setting(chosen: Params) -> dict[str, Any]:
    """The DataLoader attributes an AutoLoader shows for the ``chosen`` setting."""
    return {
        "num_workers": int(chosen["num_workers"]),
        "prefetch_factor": chosen["prefetch_factor"],
        "pin_memory": bool(chosen["pin_memory"]),
    }


def show_setting(loader: object, chosen: Params) -> None:
    """Set ``loader``'s DataLoader attributes to the ``chosen`` setting's."""
    for name, value in shown_setting(chosen).items():
        setattr(loader, name, value)


def workers_only_where_picklable(problem: Problem) -> Problem:
    """``problem``, searched without workers where they could not be sent what they
    load (under spawn or forkserver): the loop goes on as DataLoader's would with
    ``num_workers=0``, which sends nothing, where a worker would fail."""
    why = workers_unpicklable(problem)
    if why is None or problem.space.num_workers == (0, 0):
        return problem
    _logger.warning("AutoLoader: tuning without workers: %s", why)
    return dataclasses.replace(problem, space=dataclasses.replace(problem.space, num_workers=0))


def set_threads(threads: int | None) -> int | None:
    """Set this process's torch threads to ``threads`` (``None``: leave them); the count
    they had, to put back, or ``None``."""
    return None if threads is None else set_step_threads(threads)
