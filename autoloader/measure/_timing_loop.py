"""The timing loop of one trial (the timer calls the step), and its whole epochs; the
clock's rules it follows are in ``_clock.py``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from autoloader.loader import THREAD_WORKER_PREFIX
from autoloader.measure._batches import batch_length, loader_length, tensor_bytes
from autoloader.measure._clock import Totals, TrialClock, memory_horizon
from autoloader.measure._cpu_demand import CpuDemand
from autoloader.measure._deadlines import FIRST_STEP_STAGE, SiblingPace, TrialTimeout
from autoloader.measure._device import move_to_device, synchronize
from autoloader.measure._errors import TrialError, stuck_threads
from autoloader.measure._lockstep import Checkpoint, PeerFailed
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import MemoryBudgetExceeded

if TYPE_CHECKING:
    from autoloader.measure._deadlines import Deadlines
    from autoloader.measure._lockstep import Lockstep
    from autoloader.measure._supervision import Guard

# NOTE [ Whole epochs ]
# The steady rate leaves out what an epoch's edges cost: when the sampler runs out, the
# workers idle while the main process drains the batches already queued (which, timed,
# look faster than steady), and the next epoch waits while every worker loads its first
# batch at once. With many workers on few CPUs and short epochs, this is a fifth of the
# epoch: on the development VM an HF dataset of 63 batches per epoch with 16 workers
# measured 10,900 samples/s steady and ran 8,200 over whole epochs, against 9,200 for 3
# workers (steady 9,750). So where the trial can, it times whole epochs as training gets
# them: from the first batch after warm-up to the same batch of the next epoch, the
# restart, the refill and the drain included; the objective then uses that rate (NOTE
# [ Epoch model ]). Where the batches in flight (num_workers x prefetch_factor) are more
# than a twentieth of an epoch, the edges matter, and the trial keeps going for one
# such epoch if it fits in the trial's time; below that they cost a few percent at most.
_EDGES_MATTER = 20

# NOTE [ Trials span epochs ]
# A trial is not bounded by its epoch. When the sampler runs out the loop starts the
# next epoch and goes on measuring: an open timing window stays open, with the epoch's
# edge (from the last batch's step to the new epoch's first batch: the restart and the
# refill) off its clock; that edge is timed apart (``restarts``), and the epoch model
# charges it once per epoch (NOTE [ Epoch model ]), or a whole epoch timed holds it
# (NOTE [ Whole epochs ]). The warm-up is not repeated: its burst is the start-up's.
# Before, a window was dropped at each epoch's end and the warm-up begun again, so with
# epochs shorter than the burst plus a window no window ever closed: a Lightning fit of
# 24 batches an epoch had every trial with 6 to 16 workers pruned "too short", and kept
# num_workers=0 where 8 workers loaded 8x faster.


@dataclass(slots=True)
class Epochs:
    """Times whole epochs of a trial, from a batch to the same batch one epoch later."""

    length: int | None
    in_flight: int = 0  # batches queued at once: num_workers x prefetch_factor
    epoch: int = 0
    index: int = 1  # batches of the current epoch stepped; the first comes before this
    mark: tuple[int, int] | None = None  # (epoch, index) where the clock started
    mark_time: float = 0.0
    samples: int = 0
    measured: list[tuple[int, float]] = field(default_factory=list)

    def restarted(self) -> None:
        """A new epoch began (its first batch not yet stepped)."""
        self.epoch, self.index = self.epoch + 1, 0

    def add(self, samples: int, now: float) -> None:
        """A batch of ``samples`` was stepped; ``now`` is when."""
        self.index += 1
        if self.mark is None:
            return
        self.samples += samples
        mark_epoch, mark_index = self.mark
        if self.epoch > mark_epoch and self.index == mark_index:
            self.measured.append((self.samples, now - self.mark_time))
            self.start(now)

    def start(self, now: float) -> None:
        """Start the clock at the batch just stepped (again, once an epoch is timed)."""
        self.mark, self.mark_time, self.samples = (self.epoch, self.index), now, 0

    def rate(self) -> float | None:
        """Samples per second over the whole epochs timed, ``None`` if none were."""
        seconds = sum(s for _, s in self.measured)
        return sum(n for n, _ in self.measured) / seconds if seconds > 0 else None

    def due(self, now: float, seconds_per_batch: float, deadline: float) -> bool:
        """Whether to keep measuring for a first whole epoch: one is under way and
        expected (with room to spare) before ``deadline``."""
        if self.length is None or self.mark is None or self.measured:
            return False
        if self.length > _EDGES_MATTER * self.in_flight:
            return False
        mark_epoch, mark_index = self.mark
        to_go = mark_index - self.index
        if self.epoch == mark_epoch:
            to_go += self.length
        return now + 1.5 * to_go * seconds_per_batch < deadline


# Seconds past the trial's time its first batch may come before the trial is given up
# as too short (its workers still starting).
_FIRST_BATCH_GRACE = 0.5


class _NotStarted(Exception):
    """The trial's time ran out before its workers delivered a first batch."""


class TimingLoop:
    """Times the training loop ``next(loader)`` then ``step_fn`` for one trial.

    The first batch is timed alone (``time_to_first_batch``). After the warm-up
    (``NOTE [ Warm-up ]``) the batches are timed in windows of at least
    ``max(2, num_workers)`` batches and ``min_window_seconds``, until the rate is known
    to ``target_relative_error`` from ``min_windows`` windows (and a first whole epoch
    is timed where its edges matter, ``NOTE [ Whole epochs ]``), ``on_window`` stops
    the trial, ``max_batches`` are timed, or the trial's time runs out. Each decision
    is taken at a checkpoint, at the same batch in every process that measures the
    setting (``NOTE [ Joint trials ]``). Built for one trial, and :meth:`run` once.

    Args:
        loader (DataLoader): the trial's loader.
        guard (Guard): what watches over the trial; ``guard.iterator`` follows the
            loop's iterator, and ``guard.started`` is when the trial began.
        params (dict): the setting measured (``num_workers``, ``prefetch_factor``,
            ``pin_memory``).
        step_fn, device, batch_size, min_windows, min_window_seconds,
            target_relative_error: as :class:`TrialRunner`'s.
        max_seconds, deadlines, max_batches, on_window, lockstep: as
            :meth:`TrialRunner.measure`'s.
    """

    # Set as the loop begins (_begin): the loader's iterator (a new one each epoch),
    # the batch last fetched, and what the first batch showed; by run(), what reads
    # the CPU demand.
    cpu: CpuDemand
    iterator: Iterator[Any]
    batch: Any
    time_to_first_batch: float
    batch_bytes: int
    epochs: Epochs

    def __init__(
        self,
        loader: DataLoader[Any],
        guard: Guard,
        params: Mapping[str, Any],
        *,
        step_fn: Callable[[Any], object],
        device: torch.device | None,
        batch_size: int,
        max_seconds: float,
        deadlines: Deadlines | None,
        max_batches: int | None,
        min_windows: int,
        min_window_seconds: float,
        target_relative_error: float,
        on_window: WindowCallback | None,
        lockstep: Lockstep,
        first_within_trial: bool = False,
    ) -> None:
        self.loader = loader
        self.guard = guard
        self.step_fn = step_fn
        self.device = device
        self.batch_size = batch_size
        self.on_window = on_window
        self.lockstep = lockstep
        self.workers = int(params["num_workers"])
        self.non_blocking = bool(params.get("pin_memory"))
        # The limits: when the trial ends, and how long one batch may take.
        self.deadline = guard.started + max_seconds
        self.max_batches = max_batches
        self.first_limit = deadlines.first if deadlines else None
        self.each_limit = deadlines.each if deadlines else None  # tightened by the pace
        # The step on the first batch: the user's one-time set-up (NOTE [ The first step ]).
        self.first_step_limit = deadlines.first_step if deadlines else None
        # NOTE [ Sibling pace ]: with two worker processes or more, in order.
        self.sibling_limit = (
            deadlines.sibling
            if deadlines is not None
            and self.workers >= 2
            and params.get("worker_kind", "processes") == "processes"
            and params.get("in_order", True)
            else None
        )
        self.start_each = deadlines.start_each if deadlines else 0.0
        self.first_within_trial = first_within_trial
        # The warm-up and the timing windows (NOTE [ Warm-up ]), and the seconds each
        # new epoch took to its first batch.
        self.clock = TrialClock(
            params,
            min_windows=min_windows,
            min_window_seconds=min_window_seconds,
            target_relative_error=target_relative_error,
        )
        self.warming = True  # the warm-up went on at the last batch counted
        self.restarts: list[float] = []
        self.iterator: Iterator[Any] = iter(())  # the loader's, from _begin on
        # A joint trial's failure waits for the next checkpoint (NOTE [ Joint trials ]).
        self.failure: TrialError | MemoryBudgetExceeded | None = None
        # Since the last checkpoint: when it was, and batches.
        self.checkpoint_at = 0.0
        self.since_checkpoint = 0

    def run(self) -> Measurement:
        """Time the loop until the trial stops; this process's measurement.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: the dataset, collate_fn or step_fn raised or hung.
            PeerFailed: another process of a joint trial failed.
        """
        self.cpu = CpuDemand()
        try:
            return self._run()
        finally:
            self.cpu.close()

    def _run(self) -> Measurement:
        try:
            self._begin()
        except _NotStarted:
            return self._unstarted()
        agreed = self._checkpoint()
        if not agreed.time_up and self.clock.warmup == 0:
            # No burst to drain (no workers): the clock starts after the first batch.
            self._open_window(perf_counter())
        while not agreed.time_up:
            now, ready, last = self._next_batch()
            self.since_checkpoint += 1
            if self.since_checkpoint < self.lockstep.every():
                continue
            window = self.clock.window
            agreed = self._checkpoint(
                warming=window is None and self.warming,
                not_ready=window is not None and not (ready or last),
            )
            if window is None:
                if not agreed.warming:
                    self._open_window(now)
            elif not agreed.not_ready:
                stopped = self._close_window(last)
                if stopped is not None:
                    return stopped
        return self._finish()

    def _begin(self) -> None:
        """Start the loader's iterator, and fetch and step the first batch."""
        # Joint, a failure to start it (a worker dead as it started: Ctrl-C reaches the
        # job's process group) is kept for the first checkpoint, as at an epoch's
        # restart: the others' first step waits in its collectives for this one's.
        self.iterator = self._restart() if self.lockstep.joint else self.guard.start()
        self.lockstep.begin(loader_length(self.loader))
        self.batch = self._first_fetch()
        first = perf_counter()
        self.time_to_first_batch = first - self.guard.started
        self.clock.first_batch(first, self.deadline)
        self.batch_bytes = tensor_bytes(self.batch)
        self._step(self.batch, first=True)
        self.epochs = Epochs(loader_length(self.loader), in_flight=self.clock.warmup)
        self.checkpoint_at = perf_counter()

    def _first_fetch(self) -> Any:
        """The first batch, within its deadline; and, in a trial of the search
        (``first_within_trial``) with workers, within the trial's time: workers too slow
        to start before it ends leave nothing to measure, which is no hang
        (``_NotStarted``), and are killed. A joint trial waits for its deadline: its
        processes must agree on what each fetched. ``diagnose()`` measures the user's
        own loader, whose hang it reports."""
        cut = self.deadline + _FIRST_BATCH_GRACE - perf_counter()
        if (
            not self.first_within_trial
            or not self.workers
            or self.lockstep.joint
            or (self.first_limit is not None and self.first_limit <= cut)
        ):
            return self._fetch(self.first_limit)
        try:
            return self._fetch(max(cut, 1e-3))
        except TrialError as error:
            timeout = error.error
            if isinstance(timeout, TrialTimeout) and timeout.detail is None:
                self.guard.discard = True
                raise _NotStarted from None
            raise

    def _unstarted(self) -> Measurement:
        """The measurement of a trial whose workers delivered no batch in its time."""
        waited = perf_counter() - self.guard.started
        return Measurement(
            samples_per_second=0.0,
            relative_error=math.inf,
            data_wait_fraction=1.0,
            load_seconds=0.0,
            step_seconds=0.0,
            time_to_first_batch=waited,
            epoch_restart_seconds=None,
            batches=0,
            duration=waited,
            peak_memory=self.guard.watch.peak,
        )

    def _next_batch(self) -> tuple[float, bool, bool]:
        """Fetch, step and count the next batch (the first of a new epoch, once one
        ends). Returns when its step ended, and whether the open window is long enough
        to close (``ready``) and must close (``last``: ``max_batches`` timed)."""
        t0, cpu0, own0 = self.cpu.read()
        restarted = False
        try:
            self.batch = self._fetch(self.each_limit)
        except StopIteration:
            # A new epoch: workers restart unless persistent; its edge is timed apart.
            self.iterator = self.guard.iterator = self._restart()
            self.batch = self._fetch(self.first_limit)
            self.restarts.append(perf_counter() - t0)
            restarted = True
        t1, cpu1, own1 = self.cpu.read()
        self._step(self.batch)
        t2, cpu2, own2 = self.cpu.read()
        samples = batch_length(self.batch, self.batch_size)
        if restarted:
            # The epoch's edge is timed apart (NOTE [ Trials span epochs ]).
            self.epochs.restarted()
            self.clock.epoch_edge(t1 - t0)
        self.epochs.add(samples, t2)
        if self.clock.window is None:
            self.warming = self.clock.warming(t2)
            return t2, False, False
        batch = Totals(samples=samples, batches=1, step=t2 - t1)
        batch.step_cpu, batch.step_own_cpu = cpu2 - cpu1, own2 - own1
        if not restarted:
            batch.wait, batch.wait_cpu, batch.wait_own_cpu = t1 - t0, cpu1 - cpu0, own1 - own0
        ready = self.clock.add(batch, t2)
        timed = self.clock.total.batches + self.clock.window.batches
        last = self.max_batches is not None and timed >= self.max_batches
        return t2, ready, last

    def _open_window(self, now: float) -> None:
        """The warm-up is over: open a timing window. ``now`` is when the last batch's
        step ended."""
        if self.epochs.mark is None:
            self.epochs.start(now)
        synchronize(self.device)
        self.clock.open(perf_counter())

    def _close_window(self, last: bool) -> Measurement | None:
        """Close the open window and decide whether to stop: this process's measurement
        if the trial stops here, else ``None`` with the next window open."""
        synchronize(self.device)
        end = perf_counter()
        clock = self.clock
        clock.close(end)
        mine = self._estimate()
        estimate = self.lockstep.combine(mine)
        per_batch = clock.total.seconds / clock.total.batches
        stop = (
            (self.on_window is not None and self.on_window(len(clock.windows), estimate))
            or last
            or (clock.converged(estimate) and not self.epochs.due(end, per_batch, self.deadline))
        )
        if self.lockstep.decide(stop):
            return mine
        self.each_limit = clock.paced(self.each_limit)
        self.sibling_limit = clock.paced(self.sibling_limit)
        clock.open(end)
        return None

    def _finish(self) -> Measurement:
        """The measurement once the trial's time is up."""
        self.clock.finish(
            perf_counter(),
            first_samples=batch_length(self.batch, self.batch_size),
            time_to_first_batch=self.time_to_first_batch,
        )
        return self._estimate()

    def _checkpoint(self, *, warming: bool = False, not_ready: bool = False) -> Checkpoint:
        """What every process measuring the setting saw since the last checkpoint.

        Raises:
            The failure this process kept, or :class:`PeerFailed`, once any failed.
        """
        now = perf_counter()
        agreed = self.lockstep.agree(
            Checkpoint(
                time_up=now >= self.deadline,
                warming=warming,
                not_ready=not_ready,
                failed=self.failure is not None,
                hung=_hung(self.failure),
                seconds=now - self.checkpoint_at,
            )
        )
        self.checkpoint_at, self.since_checkpoint = now, 0
        if agreed.failed:
            if self.failure is not None:
                raise self.failure
            if agreed.hung:  # NOTE [ Memory growth against the hang deadline ]
                grown = self._outgrown(agreed.seconds)
                if grown is not None:
                    raise grown
            raise PeerFailed()
        return agreed

    def _outgrown(self, overdue: float) -> MemoryBudgetExceeded | None:
        """Another process hung for up to ``overdue`` seconds: the memory fault to
        report instead, where this one's watch finds its tree past the budget, or
        growing past it within the horizon (``NOTE [ Memory growth against the hang
        deadline ]``)."""
        watch = self.guard.watch  # sampled by its own thread: read, not sampled here
        return watch.claim() or watch.outgrows(
            memory_horizon(overdue, self.deadline, perf_counter())
        )

    def _fetch(self, limit: float | None) -> Any:
        """The next batch of the current iterator, within ``limit`` seconds; after a
        failure in a joint trial, the spare batch."""
        if self.failure is not None:
            return self.lockstep.spare
        poll = None
        if self.sibling_limit is not None:
            poll = SiblingPace(
                self.iterator, self.sibling_limit, start_each=self.start_each, workers=self.workers
            )
        self.guard.alarm.arm("loading a batch", limit, poll=poll)
        try:
            with self.guard.deaths.fetching():
                return next(self.iterator)
        except StopIteration:
            raise
        except TrialTimeout as error:
            # (NOTE [ Memory growth against the hang deadline ] in _clock.py)
            horizon = memory_horizon(error.seconds, self.deadline, perf_counter())
            grown = self.guard.watch.outgrows(horizon)
            if grown is not None:
                return self._fail(grown, None)
            return self._fail(_timed_out(error, self.guard.watch.peak), error)
        except Exception as error:
            return self._fail(TrialError("loading a batch", error, self.guard.watch.peak), error)
        finally:
            self.guard.alarm.disarm()

    def _step(self, batch: Any, *, first: bool = False) -> None:
        """Run ``step_fn`` on ``batch``, within the per-batch limit; the trial's
        ``first`` step within the first step's where it has one (``NOTE [ The first
        step ]``)."""
        if self.failure is not None:
            # Only to keep the step's collectives matched with the other ranks'.
            with contextlib.suppress(Exception):
                self._train(batch)
            return
        if first and self.first_step_limit is not None:
            self.guard.alarm.arm(FIRST_STEP_STAGE, self._step_limit(self.first_step_limit))
        else:
            self.guard.alarm.arm("running step_fn", self._step_limit(None))
        try:
            self._train(batch)
            self.guard.watch.check()
        except MemoryBudgetExceeded as error:
            self._fail(error, None)
        except Exception as error:
            self._fail(TrialError("running step_fn", error, self.guard.watch.peak), error)
        else:
            if self.lockstep.joint:
                self.lockstep.spare = batch
        finally:
            self.guard.alarm.disarm()

    def _step_limit(self, limit: float | None) -> float | None:
        """How long a step may take before it counts as hung: ``limit``, else the
        batch's (``each_limit``). In a joint trial the step's collectives wait for every
        rank's batch: on a rank that steps at once, the step takes as long as the
        slowest rank's fetch, which may take up to its own deadline (the first batch's,
        an epoch's first on a rank that restarts workers) before it counts as hung there
        (``NOTE [ Joint trials ]``). Held to the batch's deadline alone, a rank starved
        of CPU beside a loading one failed the job's baseline as a hung step ("no
        progress for 3 s while running step_fn")."""
        own = self.each_limit if limit is None else limit
        if not self.lockstep.joint or own is None:
            return own
        return own + (self.first_limit or own)

    def _train(self, batch: Any) -> None:
        """Move ``batch`` to the device, as a training loop would, and run ``step_fn``."""
        if self.device is not None:
            batch = move_to_device(batch, self.device, non_blocking=self.non_blocking)
        self.step_fn(batch)

    def _fail(self, error: TrialError | MemoryBudgetExceeded, cause: BaseException | None) -> Any:
        """Alone, raise ``error``; in a joint trial keep it for the next checkpoint
        and hand back the spare batch to step in the meantime."""
        if not self.lockstep.joint or self.lockstep.spare is None:
            raise error from cause
        self.failure = error
        return self.lockstep.spare

    def _restart(self) -> Iterator[Any]:
        """A new iterator for the next epoch (or the trial's first, in a joint trial);
        the current one if that failed in a joint trial (the failure kept for the next
        checkpoint, the spare batch stepped meanwhile)."""
        try:
            return self.guard.start()
        except Exception as error:
            self._fail(TrialError("loading a batch", error, self.guard.watch.peak), error)
            return self.iterator

    def _estimate(self) -> Measurement:
        """The measurement from the windows closed so far."""
        return self.clock.estimate(
            time_to_first_batch=self.time_to_first_batch,
            restarts=self.restarts,
            duration=perf_counter() - self.guard.started,
            peak_memory=self.guard.watch.peak,
            batch_bytes=self.batch_bytes,
            epochs_samples_per_second=self.epochs.rate(),
        )


def _hung(failure: TrialError | MemoryBudgetExceeded | None) -> bool:
    """Whether ``failure`` is a batch that overran its deadline."""
    return (
        isinstance(failure, TrialError)
        and failure.stage == "loading a batch"
        and isinstance(failure.error, TrialTimeout)
    )


def _timed_out(error: TrialTimeout, peak_memory: int) -> TrialError:
    """The failure of a fetch that overran its deadline. Where thread workers are stuck
    in the user's code, the error says which and where (``NOTE [ Where user code was
    stuck ]``): the main thread's own stack shows only the wait for them."""
    stuck = stuck_threads(THREAD_WORKER_PREFIX)
    if error.detail is not None or not stuck:
        return TrialError("loading a batch", error, peak_memory)
    name, where = stuck[0]
    others = f" ({len(stuck) - 1} more with it)" if len(stuck) > 1 else ""
    detail = (
        f"{error}: thread worker {name}{others} is stuck"
        + (f" at {where}" if where else "")
        + "; a thread cannot be stopped, it is left to end when its read returns"
    )
    failure = TrialError(
        "loading a batch", TrialTimeout(error.stage, error.seconds, detail), peak_memory
    )
    failure.where = where
    return failure
