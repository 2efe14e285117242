"""A setting measured in the user's own training loop: the batches it loads are the
ones training gets, and the time between two of the loop's ``next()`` calls is the real
step (``NOTE [ Tuning in the training loop ]`` in ``_autoloader.py``).

:class:`LiveTrial` is the counterpart of :class:`~autoloader.measure._timing_loop.TimingLoop`
turned inside out: the loop calls it for each batch instead of it calling the step. Both
follow one :class:`~autoloader.measure._clock.TrialClock` (warm-up, windows, pace, the
memory horizon), under the same watch (memory budget, worker deaths, per-batch
deadlines). It ends with a :class:`Measurement` or with the failure, never raising a
fault into the loop: the caller hands the undelivered batches to the next setting.

Meant differences from the timer: a live trial spans epochs as the timer's do, but the
training loop, not the trial, starts the next one, and does its own work in between
(``NOTE [ Live trials span epochs ]``), so it times no whole epoch, and its restart is
the refill at an epoch's edge (persistent workers only); it
measures alone (a torchrun job's ranks agree on its length beforehand, ``feed.limit``,
instead of at checkpoints); and each window closes at the first batch it may.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

from torch.utils.data import DataLoader

from autoloader.loader import EpochBatches, Feed
from autoloader.measure._batches import batch_length, tensor_bytes
from autoloader.measure._clock import Totals, TrialClock, memory_horizon
from autoloader.measure._cpu_demand import CpuDemand
from autoloader.measure._deadlines import (
    Alarm,
    Deadlines,
    TrialTimeout,
    alarm_unused,
    put_back_stale_alarms,
    stale_alarms,
)
from autoloader.measure._errors import TrialError
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import MemoryBudgetExceeded, MemoryWatch
from autoloader.measure._supervision import (
    Guard,
    WorkerDeaths,
    stop_workers,
    worker_died,
    worker_exits,
)

Failure = TrialError | MemoryBudgetExceeded
MIN_WINDOWS = 4  # timing windows a live trial closes before its rate counts as known
# A trial's on_batch: told a batch's wait for data and the step before it.
BatchCallback = Callable[[float, float], bool]


class TrialEnded(Exception):
    """The trial has ended before this batch: the caller starts the next setting."""


# NOTE [ A live trial's time starts at its first batch ]
# A live trial's max_seconds are its measuring time: its deadline moves by its time to
# first batch (recorded, and charged by the epoch model where workers restart each
# epoch). Counted against max_seconds, a setting's start-up took the warm-up's time:
# in a search drift started on benchmarks/drift.py's images pipeline (reads of 6 ms,
# 2 s trials), 11 workers took 0.93 s to their first batch, the warm-up's cap (half of
# what was left) ended with 2 of their 22 start-up batches still queued, and the trial
# was pruned too short; the search chose 3 workers (0.47 of the best hand setting).
# A successor started ahead (NOTE [ Overlapped start-up ]) waits less, or not at all.

# NOTE [ Live trials span epochs ]
# As tune()'s (NOTE [ Trials span epochs ], in _timing_loop.py), a live trial is not
# bounded by its epoch. Cut there, a trial that had not closed two timing windows was
# lost as too short: with 12 batches a rank per epoch and 8 workers (16 batches in
# flight) the warm-up alone outlasted every epoch, no trial with workers was measured,
# and AutoLoader kept num_workers=0 (1.00x where 8 persistent workers gave 3.08x).
# So where the epoch's batches run out before the trial's end (its time, its vote, its
# ``feed.limit`` of batches), the epoch ends (StopIteration) and the trial waits at the
# epoch's edge, its loader and workers kept (trial loaders keep their workers, as
# persistent ones do); the loop's next epoch resumes it (:meth:`LiveTrial.resume`), its
# feed taking that epoch's batches (NOTE [ Every batch once ]) with its counts and
# limit going on. The edge, from the last batch's step to the new epoch's first batch
# (the loop's own work between epochs, validation and checkpoints, then the refill),
# is off the open window's clock (TrialClock.epoch_edge); the loop's own part of it
# (up to its first next()) is off the trial's time too: its deadline, its start and
# its warm-up move by that much. The first batch of the epoch counts no wait (it is the
# edge's), and the warm-up is not repeated: it ends at the first edge. The refill there
# loaded a batch on each worker off the clock, and those batches then come at once; so
# they do at every epoch, and they are the epoch's rate as training sees it, not a
# start-up to skip. With 12-batch epochs and 12 workers x prefetch 2, skipping a burst
# of 24 batches took two epochs. For a setting with persistent workers the refill is the
# epoch's restart (Measurement.epoch_restart_seconds), which the epoch model charges
# once an epoch (NOTE [ Epoch model ], in search/_objective.py), in place of the
# baseline's load time a batch; a setting without them starts its workers each epoch in
# training, which the trial's kept workers do not show, and is charged its start-up. A
# trial started where an epoch has no batch left waits at the edge the same way.

# NOTE [ An epoch left at its last batch ]
# A loop that knows the loader's length may take the epoch's last batch and never ask
# for one more: Lightning's fetcher does (its ``done`` is ``fetched >= len``), holding
# the iterator until the next epoch's ``iter()``; DataLoader lets it. The epoch then
# never saw StopIteration, and the next ``iter()`` found it unfinished and ended its
# trial where it stood. Under Lightning every trial ended with its epoch, as if trials
# did not span epochs: in a 2-rank DDP fit of 12-batch epochs every trial with workers
# was pruned as too short and AutoLoader kept num_workers=0
# (benchmarks/ddp_short_epochs.py). So where the next ``iter()`` finds an epoch whose
# every batch the loop took, the epoch ends as at StopIteration
# (:meth:`LiveTrial.epoch_left`), the sampler asked for nothing more (DataLoader's
# iterator asks nothing then). The end of the last batch's step is not seen: it is
# taken to have lasted as long as the step before it, and the edge starts there. An
# iterator dropped instead (``islice(loader, len(loader))``, or Lightning's teardown at
# the fit's end) is the loop letting go: its trial ends where it stands, as before
# (NOTE [ Nothing outlives the loop ], in _loop_epoch.py).


class LiveTrial:
    """Loads batches with one setting for the user's loop, timing the loop as it goes.

    Args:
        loader: the setting's DataLoader; its sampler is ``feed``.
        feed: the loader's share of the epoch's batches.
        params: the setting.
        batch_size: samples per batch.
        memory_budget: bytes the process tree may use, or ``None`` to leave memory
            unwatched (a setting already chosen: the watch's sampling would cost the
            whole run a little CPU).
        max_seconds: the trial ends at the first batch after this, or once its rate is
            known well enough; ``inf``: it is measured until its feed's ``limit`` of
            batches is delivered (a torchrun job's trial); ``None``: not measured (a
            setting already chosen, serving the rest of training).
        deadlines: how long a batch may take to load before the setting counts as hung.
        on_window: called after each timing window; the trial ends there when it
            returns True.
        keep_workers: the loader is persistent and outlives the trial (its workers are
            not stopped by :meth:`close`, unless the trial failed).
        on_batch: for a trial not measured, told each batch's wait for data and the
            step before it (the epoch's first batch: nothing); where it returns True,
            the trial ends after the batches already handed out (``NOTE [ Drift ]``,
            in ``_drift.py``), :attr:`drifted` saying so.

    After the trial ends, :attr:`outcome` holds its :class:`Measurement` or failure.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        feed: Feed,
        params: dict[str, Any],
        *,
        batch_size: int,
        memory_budget: int | None,
        max_seconds: float | None,
        deadlines: Deadlines | None,
        on_window: WindowCallback | None = None,
        keep_workers: bool = False,
        on_batch: BatchCallback | None = None,
        min_windows: int = MIN_WINDOWS,
        min_window_seconds: float = 0.1,
        target_relative_error: float = 0.05,
    ) -> None:
        self.loader, self.feed, self.params = loader, feed, params
        self.batch_size = batch_size
        self.measuring = max_seconds is not None
        # A trial of a set length (max_seconds inf: its feed's limit) is measured to its
        # end, the same on every rank of a torchrun job; a timed one ends once measured.
        self.stop_early = max_seconds is not None and math.isfinite(max_seconds)
        self.on_window = on_window
        self.keep_workers = keep_workers
        self.on_batch = on_batch
        self.drifted = False
        self.started = perf_counter()
        self.deadline = math.inf if max_seconds is None else self.started + max_seconds
        self.first_limit = deadlines.first if deadlines else None
        self.each_limit = deadlines.each if deadlines else None
        self.outcome: Measurement | Failure | None = None
        self.draining = False  # NOTE [ Draining a trial ]
        self.voted = False
        self.clock = TrialClock(
            params,
            min_windows=min_windows,
            min_window_seconds=min_window_seconds,
            target_relative_error=target_relative_error,
        )
        self.time_to_first_batch = 0.0
        self.batch_bytes = 0
        # The last batch handed to the loop: when, its samples, and what fetching it cost.
        self.returned_at: float | None = None
        self.returned_cpu = (0.0, 0.0)
        self.last_samples = 0
        self.last_wait = (0.0, 0.0, 0.0)
        self.last_step = (0.0, 0.0, 0.0)  # the last step seen: seconds, CPU, own CPU
        self.refills: list[float] = []  # each epoch's, persistent workers' restarts
        watched = memory_budget is not None
        self.watch = MemoryWatch(
            memory_budget if memory_budget is not None else 1 << 62,
            ends_at=time.monotonic() + max_seconds if max_seconds and self.stop_early else None,
        )
        # In front of DataLoader's SIGCHLD handler for the whole trial: a worker's death
        # between two fetches, while the user's step runs, is held back until the next
        # fetch (defer), never raised into the step.
        self.deaths = WorkerDeaths(self.watch, defer=True)
        self._handlers = contextlib.ExitStack()
        self._handlers.enter_context(self.deaths.handled())
        # Behind that handler: a budget passed at once signals the main thread to it.
        self.watch.start(sample=watched)
        # CPU time plus run delay (NOTE [ CPU demand ]); its files close with the trial.
        self.cpu = CpuDemand()
        self._handlers.callback(self.cpu.close)
        self.alarm = Alarm()
        # Where nothing else uses SIGALRM, its handler is installed for the whole trial
        # (about 20 us a batch less than for each fetch); it fires only while armed.
        put_back_stale_alarms()
        self._alarm_held = deadlines is not None and alarm_unused()
        if self._alarm_held:
            self._handlers.enter_context(self.alarm.installed())
        self._alarm_handler = signal.getsignal(signal.SIGALRM)
        self.guard = Guard(self.watch, self.deaths, self.alarm, self.started, loader=loader)
        self.iterator: Iterator[Any] | None = None
        self.closed = False
        # NOTE [ Live trials span epochs ]: where the trial waits at an epoch's edge, when
        # the loop's step of the epoch's last batch ended (then its last next()).
        self.edge_from: float | None = None
        # NOTE [ Overlapped start-up ] (in _loop_overlap.py): when its workers started,
        # ahead of the loop's first next(), where they did.
        self.prestarted: float | None = None
        self.begins = False  # and its time starts at the loop's first next()

    def prestart(self) -> None:
        """Start the loader's workers now, ahead of the loop's first :meth:`next`, while
        the trial before this one drains (``NOTE [ Overlapped start-up ]``, in
        ``_loop_overlap.py``): they load the batches the feed hands them meanwhile. The
        trial's time starts at that first next(), as any trial's; its start-up counts
        from here. Where starting fails, the first next() starts them again, the fault
        then the trial's; the batches the failed start was handed go back first (lost
        otherwise: the next iterator asks the feed afresh)."""
        assert self.iterator is None and self.returned_at is None, "a trial not begun"
        self.prestarted = perf_counter()
        self.begins = True
        try:
            self._start()
        except Exception:
            self.iterator = None
            self.feed.requeue()

    # The loop's next() ----------------------------------------------------------------

    def next(self) -> Any:
        """The next batch.

        Raises:
            TrialEnded: the trial ended (its time, its windows, or a fault): nothing was
                fetched; :attr:`outcome` says how it ended.
            StopIteration: the epoch has no batch left. A setting not measured, serving
                training, ends with it; a trial not over yet waits for the next epoch
                (:meth:`resume`, ``NOTE [ Live trials span epochs ]``), its
                :attr:`outcome` still ``None``. A trial given a number of batches
                (``feed.limit``) that delivered them all ends with TrialEnded instead.
        """
        if self.outcome is not None:
            if self.draining:
                return self._drain()
            raise TrialEnded
        if not self.measuring:
            return self._serve() if self.on_batch is None else self._watched()
        now, cpu, own = self.cpu.read()
        if self.begins:  # its time starts now (NOTE [ Overlapped start-up ])
            self.begins = False
            self._pause(now - self.started)
        if self.edge_from is None:
            if self.returned_at is not None:
                self._count(now, cpu, own)
            if self.outcome is None and now >= self.deadline:
                self.outcome = self._finish()
            if self.outcome is not None:
                return self._drain_from_here()
        else:
            self._pause(now - self.edge_from)  # the loop's own work, before this next()
            self.edge_from = now
        try:
            batch = self._serve()
        except StopIteration:
            if self.outcome is None and self.edge_from is None:
                self.edge_from = now  # NOTE [ Live trials span epochs ]
            raise
        got, got_cpu, got_own = self.cpu.read()
        if self.returned_at is None:
            self.time_to_first_batch = got - (self.prestarted or self.started)
            # Start-up, off its time (NOTE [ A live trial's time starts at its first batch ]).
            self.deadline += got - self.started
            self.clock.first_batch(got, self.deadline)
            self.batch_bytes = tensor_bytes(batch)
        if self.edge_from is not None:
            # The refill is the edge's too: off the windows' clock, and no wait of the batch.
            refill = got - self.edge_from
            self.clock.epoch_edge(refill)
            self.clock.burst_over()
            if self.params.get("persistent_workers"):
                self.refills.append(refill)
            self.edge_from = None
            now, cpu, own = got, got_cpu, got_own
        self.last_wait = (got - now, got_cpu - cpu, got_own - own)
        self.last_samples = batch_length(batch, self.batch_size)
        self.returned_at, self.returned_cpu = got, (got_cpu, got_own)
        return batch

    def _watched(self) -> Any:
        """The next batch of a setting serving training, its wait told to
        :attr:`on_batch` (``NOTE [ Drift ]``, in ``_drift.py``)."""
        assert self.on_batch is not None
        if self.drifted:
            self.outcome = self._finish()
            return self._drain_from_here()
        before = perf_counter()
        batch = self._serve()
        got = perf_counter()
        if self.returned_at is not None:
            self.drifted = self.on_batch(got - before, before - self.returned_at)
        self.returned_at = got
        return batch

    # NOTE [ Draining a trial ]
    # When a timed trial has measured enough, its loader holds up to num_workers x
    # prefetch_factor batches handed out and not delivered, loaded or being loaded. They
    # are the epoch's next batches in order: given back, the next setting would load
    # them again (with 8 workers x prefetch 8, an epoch's worth of loading thrown away
    # at each switch). So the feed stops handing out batches, and the loop gets those
    # already handed out, unmeasured, before the next setting starts. A fault while
    # draining is the trial's (its setting did fail): what was not delivered is given
    # back then, as after any failure.

    def _drain_from_here(self) -> Any:
        if self.feed.limit is not None or not self.feed.in_flight:
            raise TrialEnded
        self.feed.stop()
        self.draining = True
        return self._drain()

    def _drain(self) -> Any:
        try:
            batch = self._fetch()
        except StopIteration:
            self.draining = False
            if self.feed.in_flight:  # NOTE [ A loader that ends short ]
                self.outcome = self._ended_short()
            raise TrialEnded from None
        except (TrialError, MemoryBudgetExceeded) as failure:
            self.draining = False
            self.outcome = failure
            raise TrialEnded from None
        self.feed.delivered()
        return batch

    def _serve(self) -> Any:
        """The next batch, delivered; the trial's end where there is none. Alone, for a
        setting not measured: the chosen one, or the reload of a failed setting's
        batches (NOTE [ Tuning in the training loop ])."""
        try:
            self.watch.check()  # a watch not sampling never finds the budget passed
            batch = self._fetch()
        except StopIteration:
            if self.feed.in_flight:  # NOTE [ A loader that ends short ]
                self.outcome = self._ended_short()
                raise TrialEnded from None
            if self.feed.limit is not None and self.feed.handed_count >= self.feed.limit:
                self.outcome = self._finish()
                raise TrialEnded from None  # the batches it was given are delivered
            if not self.measuring and self.feed.limit is None:
                self.outcome = self._finish()  # serving training: it ends with its epoch
            # Otherwise the trial goes on in the next epoch (NOTE [ Live trials span epochs ]).
            raise
        except (TrialError, MemoryBudgetExceeded) as failure:
            self.outcome = failure
            raise TrialEnded from None
        self.feed.delivered()
        return batch

    # NOTE [ A loader that ends short ]
    # A loader's iterator ends (StopIteration) once it has delivered every batch its feed
    # handed it: DataLoader's and the thread loader's deliver what they asked for before
    # they end. One that ends with batches handed out and not delivered has dropped them
    # (DataLoader's iterator skips the tasks of a worker it marked dead, if asked again
    # after raising that death), and passed up, its end would end the loop's epoch short,
    # those batches never seen. So it is the setting's failure: the batches go back to
    # the epoch, the last good setting loads them, and the failure is logged and recorded.

    def _ended_short(self) -> TrialError:
        """The failure of a loader that ended with batches undelivered."""
        lost = self.feed.in_flight
        error = RuntimeError(
            f"the loader's iterator ended with {lost} batch(es) it was handed not delivered"
        )
        return TrialError("loading a batch", error, self.watch.peak)

    def _fetch(self) -> Any:
        """The loader's next batch, within its deadline, its faults as trial errors."""
        try:
            if self.iterator is None:
                self._start()
                return self._next(self.first_limit)
            if self.returned_at is None and self.prestarted is not None:
                return self._next(self.first_limit)  # started ahead: still its first batch
            return self._next(self.each_limit)
        except (StopIteration, MemoryBudgetExceeded, TrialError):
            raise
        except TrialTimeout as error:
            # NOTE [ Memory growth against the hang deadline ] (in _clock.py)
            horizon = memory_horizon(error.seconds, self.deadline, perf_counter())
            grown = self.watch.outgrows(horizon)
            if grown is not None:
                raise grown from None
            raise TrialError("loading a batch", error, self.watch.peak) from None
        except Exception as error:
            self.deaths.expected = True
            if self.watch.exceeded:  # a worker the watch killed surfaced as an error
                raise (self.watch.claim() or self.watch.error()) from error
            failure = TrialError("loading a batch", error, self.watch.peak)
            if worker_died(error):
                failure.worker_signals, failure.worker_exit_codes = worker_exits(
                    self.iterator, error
                )
            raise failure from error

    def _start(self) -> None:
        """``iter()`` of the loader: its workers start."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            self.iterator = self.guard.start()

    def _next(self, limit: float | None) -> Any:
        """``next()`` of the iterator, under the alarm where there is a ``limit``: the
        handler is installed for the fetch alone, never while the user's code runs."""
        assert self.iterator is not None
        if limit is None:
            with self.deaths.fetching():
                return next(self.iterator)
        with contextlib.nullcontext() if self._alarm_held else self.alarm.installed():
            self.alarm.arm("loading a batch", limit)
            try:
                with self.deaths.fetching():
                    return next(self.iterator)
            finally:
                self.alarm.disarm()

    # Timing ---------------------------------------------------------------------------

    def _count(self, now: float, cpu: float, own: float) -> None:
        """Count the batch last handed to the loop, its step over (``now``); close a
        window where one is due, ending the trial if it is measured enough."""
        assert self.returned_at is not None
        self.last_step = (
            now - self.returned_at,
            cpu - self.returned_cpu[0],
            own - self.returned_cpu[1],
        )
        clock = self.clock
        if clock.window is None:
            if not clock.warming(now):
                clock.open(now)
            return
        wait, wait_cpu, wait_own = self.last_wait
        batch = Totals(
            samples=self.last_samples,
            batches=1,
            wait=wait,
            wait_cpu=wait_cpu,
            wait_own_cpu=wait_own,
            step=now - self.returned_at,
            step_cpu=cpu - self.returned_cpu[0],
            step_own_cpu=own - self.returned_cpu[1],
        )
        if not clock.add(batch, now):
            return
        clock.close(now)
        measured = self._estimate()
        self.voted = self.on_window is not None and self.on_window(len(clock.windows), measured)
        if self.voted or (self.stop_early and clock.converged(measured)):
            self.outcome = measured
            return
        self.each_limit = clock.paced(self.each_limit)
        clock.open(now)

    def measured(self) -> Measurement:
        """What the trial timed up to its end, whatever ended it (a setting that failed
        on the dataset's own error, which every setting raises, did load until then)."""
        return self._finish()

    def _finish(self) -> Measurement:
        """The measurement once the trial's time is up, or the loop left it."""
        self.clock.finish(
            perf_counter() if self.edge_from is None else self.edge_from,
            # Nothing delivered (a trial the loop left at an epoch's edge): no rate.
            first_samples=self.last_samples,
            time_to_first_batch=self.time_to_first_batch,
        )
        return self._estimate()

    def _pause(self, seconds: float) -> None:
        """The loop did its own work for ``seconds`` at an epoch's edge: off the trial's
        time (``NOTE [ Live trials span epochs ]``)."""
        self.started += seconds
        self.deadline += seconds
        if self.watch.ends_at is not None:
            self.watch.ends_at += seconds
        self.clock.pause(seconds)

    def epoch_left(self) -> None:
        """The loop took the epoch's last batch and went on without asking for one more
        (``NOTE [ An epoch left at its last batch ]``): what a measured trial's
        :meth:`next` would do there before the epoch's StopIteration, its last batch
        counted with the step before it as its step, the epoch's edge starting at that
        step's end; a trial whose time is up ends there (:attr:`outcome` set). A
        setting not measured has nothing to count: its next :meth:`next` ends it."""
        if self.outcome is not None or self.edge_from is not None or not self.measuring:
            return
        end = perf_counter()
        if self.returned_at is None:
            self.edge_from = end
        else:
            seconds, cpu, own = self.last_step
            # What the trial measured ends here, whatever ends it: set before counting.
            end = self.edge_from = min(end, self.returned_at + seconds)
            self._count(end, self.returned_cpu[0] + cpu, self.returned_cpu[1] + own)
        if self.outcome is None and end >= self.deadline:
            self.outcome = self._finish()

    def resume(self, batches: EpochBatches) -> None:
        """Go on with the next epoch's ``batches`` (``NOTE [ Live trials span epochs ]``):
        the loader is iterated again at the next batch, its workers kept."""
        assert self.outcome is None and not self.closed, "only a trial at an epoch's edge resumes"
        self.feed.carry_to(batches)
        self.iterator = None

    def _estimate(self) -> Measurement:
        end = perf_counter() if self.edge_from is None else self.edge_from
        return self.clock.estimate(
            time_to_first_batch=self.time_to_first_batch,
            restarts=self.refills,
            duration=end - self.started,
            peak_memory=self.watch.peak,
            batch_bytes=self.batch_bytes,
            epochs_samples_per_second=None,
        )

    # The end ----------------------------------------------------------------------------

    def end(self) -> None:
        """End the trial here, its time up (the loop left the epoch, or it ended): the
        windows closed so far are its measurement."""
        self.draining = False
        if self.outcome is None:
            self.outcome = self._finish()

    def close(self, *, kill: bool = False) -> None:
        """Stop the loader (its workers killed if it failed or with ``kill``, kept if
        persistent and well), give the batches it had not delivered back to the epoch,
        and put back the signal handlers the trial found. Once; from any thread
        (``NOTE [ Nothing outlives the loop ]`` in ``_loop_epoch.py``), where no handler
        can be set and no alarm rings: the handlers are then left to pass every signal
        on. ``kill`` is for the interpreter's exit, where DataLoader's shutdown does
        nothing."""
        if self.closed:
            return
        self.closed = True
        self.feed.close()
        failed = kill or isinstance(self.outcome, (TrialError, MemoryBudgetExceeded))
        self.deaths.expected = True  # before the watch's join (as in the runner)
        self.watch.stop()
        main = threading.current_thread() is threading.main_thread()
        try:
            if self.keep_workers and not failed:
                return
            if not main:
                self.guard.alarm = Alarm()  # one that does nothing in this thread
            with self.guard.alarm.installed():
                if failed:
                    # Discarded anyway, and possibly hung; a persistent loader's workers
                    # were there before the trial.
                    self.guard.kill_workers()
                with contextlib.suppress(Exception):
                    stop_workers(self.guard, abandon=failed)
        finally:
            if not main and self._alarm_held:
                stale_alarms.append(self._alarm_handler)
            with contextlib.nullcontext() if main else contextlib.suppress(ValueError):
                self._handlers.close()
