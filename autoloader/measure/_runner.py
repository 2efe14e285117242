"""One trial: build a DataLoader with given settings and time the training loop.

The runner knows nothing of Optuna or of other trials: everything it needs is passed
in, so the same measurement can run in another process or on every rank of a job.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from time import perf_counter, process_time
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader.loader._factory import build_loader, merge_loader_kwargs
from autoloader.measure._deadlines import Alarm, Deadlines
from autoloader.measure._device import move_to_device, synchronize
from autoloader.measure._errors import TrialError
from autoloader.measure._lockstep import Alone, Checkpoint, Lockstep, PeerFailed
from autoloader.measure._measurement import Measurement, t95
from autoloader.measure._memory import MemoryBudgetExceeded, MemoryWatch, kill
from autoloader.measure._supervision import (
    Guard,
    WorkerDeaths,
    stop_workers,
    worker_died,
    worker_exits,
)
from autoloader.measure._timing_loop import (
    WARMUP_SHARE,
    Epochs,
    Totals,
    batch_length,
    loader_length,
    pace_limit,
    tensor_bytes,
)

_T = TypeVar("_T")


# Called after each timing window with the window's number and the estimate so far;
# returns True to stop the trial there (a vote, not an exception: the runner returns
# the estimate as measured, and every process of a trial can stop at the same window).
WindowCallback = Callable[[int, Measurement], bool]


# NOTE [ Joint trials ]
# Under torchrun every rank measures the same setting at once (see distributed/_joint.py), and a
# step_fn that runs DDP collectives blocks until every rank has called it as often. So
# the ranks take every decision of the loop (warm-up over, a window closed, stop, time
# up, a failure) at the same batch: at checkpoints every few batches (as many as take
# about _CHECKPOINT_SECONDS, the same count on every rank), where each says what it saw
# and all act on what any saw. A rank whose loader fails or hangs (found by its own
# deadline) does not leave the loop at once: it steps a spare batch (the last good one)
# until the next checkpoint, so that the others' collectives are matched, and there
# every rank abandons the trial together. A worker's death is reported at the next
# fetch, never in the middle of a step (whose collectives might be half done). Alone,
# every batch is a checkpoint and nothing is exchanged: the loop is what it always was.


class Runner(Protocol):
    """Measures one setting at a time: in this process, or each in a process of its own."""

    batch_size: int

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
    ) -> Measurement: ...


class TrialRunner:
    """Times the training loop for one DataLoader setting at a time.

    Args:
        dataset (Dataset): the user's dataset.
        step_fn (callable): the user's training step; receives one batch.
        batch_size (int): samples per batch.
        fixed_kwargs (dict, optional): the user's DataLoader options kept in every trial.
        device (torch.device, optional): batches are moved here before ``step_fn``
            and the device is synchronised at the edges of each timing window.
        memory_budget (int): bytes the process tree may use; passing it stops the trial.
        target_relative_error (float, optional): stop measuring once the rate is known
            this well. (default: ``0.05``)
        min_windows (int, optional): timing windows needed before stopping. (default: ``4``)
        min_window_seconds (float, optional): shortest timing window. (default: ``0.1``)
        memory_peers (sequence of int, optional): other processes whose trees count
            in ``memory_budget``: the other ranks of a torchrun job on this node, whose
            workers the watch stops too. (default: ``()``)
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        step_fn: Callable[[Any], object],
        *,
        batch_size: int,
        memory_budget: int,
        fixed_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | None = None,
        target_relative_error: float = 0.05,
        min_windows: int = 4,
        min_window_seconds: float = 0.1,
        memory_peers: Sequence[int] = (),
    ) -> None:
        self.dataset = dataset
        self.step_fn = step_fn
        self.batch_size = batch_size
        self.memory_budget = memory_budget
        self.fixed_kwargs = dict(fixed_kwargs or {})
        self.device = device
        self.target_relative_error = target_relative_error
        self.min_windows = min_windows
        self.min_window_seconds = min_window_seconds
        self.memory_peers = tuple(memory_peers)

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
        lockstep: Lockstep | None = None,
    ) -> Measurement:
        """Measure the loop with ``params`` for at most about ``max_seconds``.

        Args:
            params: tuned DataLoader settings (see ``SearchSpace``).
            max_seconds: time cap; the trial stops earlier once the rate is stable.
            on_window: called after each timing window with the estimate so far; the
                trial stops there, with that estimate, when it returns True.
            deadlines: how long one batch may take before the trial is failed as hung;
                ``None`` waits as long as it takes. Once a window has set the trial's
                pace, a batch may also take no more than ``NOTE [ Pace deadline ]``
                allows.
            max_batches: stop once this many batches are timed, if set.
            lockstep: how this process keeps in step with the others measuring the
                same setting (every rank of a torchrun job); ``None`` measures alone.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: the dataset, collate_fn or step_fn raised or hung
                (``TrialTimeout``), or a worker died.
        """

        def build() -> DataLoader[Any]:
            kwargs = merge_loader_kwargs(
                params, batch_size=self.batch_size, fixed=self.fixed_kwargs
            )
            return build_loader(self.dataset, kwargs)

        return self._measure(
            build, params, max_seconds, on_window, deadlines, max_batches, lockstep or Alone()
        )

    def measure_loader(
        self,
        loader: DataLoader[Any],
        *,
        max_seconds: float,
        deadlines: Deadlines | None = None,
    ) -> Measurement:
        """Measure the loop over a DataLoader built elsewhere (the user's own, for
        :func:`autoloader.diagnose`). Its workers are stopped at the end; the loader
        starts new ones the next time it is iterated.

        Raises:
            The same as :meth:`measure`.
        """
        workers = loader.num_workers
        params = {
            "num_workers": workers,
            "prefetch_factor": loader.prefetch_factor if workers else None,
            "pin_memory": loader.pin_memory,
            "worker_kind": getattr(loader, "worker_kind", "processes"),
        }
        return self._measure(lambda: loader, params, max_seconds, None, deadlines, None, Alone())

    def first_batches(
        self, build: Callable[[], DataLoader[Any]], count: int, *, seconds: float
    ) -> list[Any]:
        """The first ``count`` batches of the loader ``build`` makes (fewer if it ends
        first), all within ``seconds``, under the same watchdog as a trial: the checks
        made before the search read through it. Its workers are stopped at the end.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: user code raised, a worker died, or ``seconds`` ran out
                (its ``error`` a :class:`TrialTimeout`).
        """

        def read(loader: DataLoader[Any], guard: Guard) -> list[Any]:
            ends = perf_counter() + seconds
            iterator = guard.iterator = guard.deaths.start(loader)
            batches: list[Any] = []
            while len(batches) < count:
                guard.alarm.arm("loading a batch", max(1e-3, ends - perf_counter()))
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    break
                except Exception as error:
                    raise TrialError("loading a batch", error, guard.watch.peak) from error
                finally:
                    guard.alarm.disarm()
            return batches

        return self._guarded(build, seconds, read)

    def _measure(
        self,
        build: Callable[[], DataLoader[Any]],
        params: Mapping[str, Any],
        max_seconds: float,
        on_window: WindowCallback | None,
        deadlines: Deadlines | None,
        max_batches: int | None,
        lockstep: Lockstep,
    ) -> Measurement:
        return self._guarded(
            build,
            max_seconds,
            lambda loader, guard: self._time_loop(
                loader, guard, params, deadlines, max_seconds, on_window, max_batches, lockstep
            ),
            joint=lockstep.joint,
        )

    def _guarded(
        self,
        build: Callable[[], DataLoader[Any]],
        max_seconds: float,
        run: Callable[[DataLoader[Any], Guard], _T],
        *,
        joint: bool = False,
    ) -> _T:
        """``run`` over the loader ``build`` makes, under the memory watch, the workers'
        death handler and the alarm; its workers stopped afterwards, killed if it failed."""
        started = perf_counter()
        watch = MemoryWatch(
            self.memory_budget, ends_at=time.monotonic() + max_seconds, others=self.memory_peers
        ).start()
        with (
            WorkerDeaths(watch, defer=joint).handled() as deaths,
            Alarm().installed() as alarm,
            warnings.catch_warnings(),
        ):
            # Trials run more workers than cores on purpose; torch warns against it.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            guard = Guard(watch=watch, deaths=deaths, alarm=alarm, started=started)
            failed = True
            try:
                guard.loader = loader = build()
                outcome = run(loader, guard)
                failed = False
                return outcome
            except MemoryBudgetExceeded:
                raise
            except Exception as error:
                deaths.expected = True  # from here on, a death is part of this failure
                if watch.exceeded:  # a worker the watch killed surfaced as an error
                    raise watch.error() from error
                if not isinstance(error, TrialError) and not worker_died(error):
                    raise
                # DataLoader's report of a dead worker can surface at any bytecode of the
                # loop, not only in next(): it is still the worker's failure.
                failure = (
                    error
                    if isinstance(error, TrialError)
                    else TrialError("loading a batch", error, watch.peak)
                )
                failure.worker_signals, failure.worker_exit_codes = worker_exits(
                    guard.iterator, failure.error
                )
                if failure is error:
                    raise
                raise failure from error
            finally:
                alarm.disarm()
                watch.stop()
                deaths.expected = True
                if failed:
                    # Discarded anyway, and possibly hung: do not wait for them.
                    kill(watch.new_children())
                stop_workers(guard, abandon=failed)

    def _time_loop(
        self,
        loader: DataLoader[Any],
        guard: Guard,
        params: Mapping[str, Any],
        deadlines: Deadlines | None,
        max_seconds: float,
        on_window: WindowCallback | None,
        max_batches: int | None,
        lockstep: Lockstep,
    ) -> Measurement:
        deaths, watch, alarm, started = guard.deaths, guard.watch, guard.alarm, guard.started
        iterator = guard.iterator = deaths.start(loader)
        deadline = started + max_seconds
        workers = int(params["num_workers"])
        non_blocking = bool(params.get("pin_memory"))
        # NOTE [ Warm-up ]
        # At start-up every worker loads prefetch_factor batches at once, so the first
        # workers * prefetch_factor batches arrive faster than the steady rate. They are
        # excluded, or an under-provisioned setting would look fast in a short trial. The
        # exclusion is capped at WARMUP_SHARE of the trial's time, so a slow loader
        # still leaves time to measure.
        warmup = workers * int(params.get("prefetch_factor") or 0)
        warmup_deadline = started + WARMUP_SHARE * max_seconds
        window_batches = max(2, workers)
        first_limit = deadlines.first if deadlines else None
        each_limit = deadlines.each if deadlines else None
        # A joint trial's failure waits for the next checkpoint (NOTE [ Joint trials ]).
        failure: TrialError | MemoryBudgetExceeded | None = None

        def fetch(it: Iterator[Any], limit: float | None) -> Any:
            if failure is not None:
                return lockstep.spare
            alarm.arm("loading a batch", limit)
            try:
                with deaths.fetching():
                    return next(it)
            except StopIteration:
                raise
            except Exception as error:
                return failed(TrialError("loading a batch", error, watch.peak), error)
            finally:
                alarm.disarm()

        def step(batch: Any) -> None:
            if failure is not None:
                # Only to keep the step's collectives matched with the other ranks'.
                with contextlib.suppress(Exception):
                    self._step(batch, non_blocking)
                return
            alarm.arm("running step_fn", each_limit)
            try:
                self._step(batch, non_blocking)
                watch.check()
            except MemoryBudgetExceeded as error:
                failed(error, None)
            except Exception as error:
                failed(TrialError("running step_fn", error, watch.peak), error)
            else:
                if lockstep.joint:
                    lockstep.spare = batch
            finally:
                alarm.disarm()

        def failed(error: TrialError | MemoryBudgetExceeded, cause: BaseException | None) -> Any:
            """Alone, raise ``error``; in a joint trial keep it for the next checkpoint
            and hand back the spare batch to step in the meantime."""
            nonlocal failure
            if not lockstep.joint or lockstep.spare is None:
                raise error from cause
            failure = error
            return lockstep.spare

        def restart() -> Iterator[Any]:
            try:
                return deaths.start(loader)
            except Exception as error:
                failed(TrialError("loading a batch", error, watch.peak), error)
                return iterator

        lockstep.begin()
        batch = fetch(iterator, first_limit)
        time_to_first_batch = perf_counter() - started
        batch_bytes = tensor_bytes(batch)
        step(batch)
        epochs = Epochs(loader_length(loader), in_flight=warmup)
        restarts: list[float] = []
        windows: list[Totals] = []
        total = Totals()
        window: Totals | None = None
        window_start = 0.0
        to_skip = warmup
        warming = True
        burst_left = 0
        since_checkpoint = 0
        restarted_since = False
        checkpoint_at = perf_counter()

        def estimate_so_far() -> Measurement:
            return self._estimate(
                windows, total, time_to_first_batch, restarts, started, watch, batch_bytes,
                epochs, burst_left,
            )  # fmt: skip

        def checkpoint(**said: bool) -> Checkpoint:
            nonlocal checkpoint_at, since_checkpoint, restarted_since
            now = perf_counter()
            agreed = lockstep.agree(
                Checkpoint(
                    time_up=now >= deadline,
                    failed=failure is not None,
                    seconds=now - checkpoint_at,
                    **said,
                )
            )
            checkpoint_at, since_checkpoint, restarted_since = now, 0, False
            if agreed.failed:
                raise failure if failure is not None else PeerFailed()
            return agreed

        agreed = checkpoint()
        while not agreed.time_up:
            t0, cpu0 = perf_counter(), process_time()
            restarted = False
            try:
                batch = fetch(iterator, each_limit)
            except StopIteration:
                # A new epoch: workers restart unless persistent; time it, warm up again.
                iterator = guard.iterator = restart()
                batch = fetch(iterator, first_limit)
                restarts.append(perf_counter() - t0)
                restarted = True
            t1, cpu1 = perf_counter(), process_time()
            step(batch)
            t2, cpu2 = perf_counter(), process_time()
            if restarted:
                epochs.restarted()
                restarted_since = True
            epochs.add(batch_length(batch, self.batch_size), t2)
            ready = last = False
            if restarted:
                window, to_skip = None, warmup
            elif window is None:
                warming = to_skip > 0 and t2 < warmup_deadline
                to_skip -= warming
            else:
                window.samples += batch_length(batch, self.batch_size)
                window.batches += 1
                window.wait += t1 - t0
                window.wait_cpu += cpu1 - cpu0
                window.step_cpu += cpu2 - cpu1
                window.step += t2 - t1
                elapsed = t2 - window_start
                last = max_batches is not None and total.batches + window.batches >= max_batches
                ready = window.batches >= window_batches and elapsed >= self.min_window_seconds
            since_checkpoint += 1
            if since_checkpoint < lockstep.every():
                continue
            agreed = checkpoint(
                restarted=restarted_since,
                warming=window is None and warming,
                not_ready=window is not None and not (ready or last),
            )
            if agreed.restarted:
                window, to_skip = None, warmup
                continue
            if window is None:
                if agreed.warming:
                    continue
                if not restarts and not windows:
                    burst_left = to_skip  # the first window starts: what the cap left queued
                if epochs.mark is None:
                    epochs.start(t2)
                synchronize(self.device)
                window, window_start = Totals(), perf_counter()
                continue
            if agreed.not_ready:
                continue
            synchronize(self.device)
            end = perf_counter()
            window.seconds = end - window_start
            windows.append(window)
            for name in (f.name for f in fields(Totals)):
                setattr(total, name, getattr(total, name) + getattr(window, name))
            mine = estimate_so_far()
            estimate = lockstep.combine(mine)
            stop = (
                (on_window is not None and on_window(len(windows), estimate))
                or last
                or (
                    len(windows) >= self.min_windows
                    and estimate.relative_error <= self.target_relative_error
                    and not epochs.due(end, total.seconds / total.batches, deadline)
                )
            )
            if lockstep.decide(stop):
                return mine
            if each_limit is not None and workers > 0:
                each_limit = min(each_limit, pace_limit(total, workers))
            window, window_start = Totals(), end

        if not windows and window is not None and window.batches > 0:
            # The cap came before a full window: keep the partial one, flagged uncertain.
            window.seconds = perf_counter() - window_start
            windows.append(window)
            total = window
        if not windows:
            # Not one batch after warm-up: fall back to the first batch alone.
            total = Totals(
                samples=batch_length(batch, self.batch_size),
                batches=1,
                seconds=time_to_first_batch,
                wait=time_to_first_batch,
            )
        return estimate_so_far()

    def _step(self, batch: Any, non_blocking: bool) -> None:
        if self.device is not None:
            batch = move_to_device(batch, self.device, non_blocking=non_blocking)
        self.step_fn(batch)

    def _estimate(
        self,
        windows: list[Totals],
        total: Totals,
        time_to_first_batch: float,
        restarts: list[float],
        started: float,
        watch: MemoryWatch,
        batch_bytes: int,
        epochs: Epochs,
        burst_left: int,
    ) -> Measurement:
        rate = total.samples / total.seconds if total.seconds > 0 else 0.0
        relative_error = math.inf
        if len(windows) >= 2 and rate > 0:
            rates = [w.samples / w.seconds for w in windows]
            spread = statistics.stdev(rates) / math.sqrt(len(rates))
            relative_error = t95(len(rates) - 1) * spread / statistics.fmean(rates)
        return Measurement(
            samples_per_second=rate,
            relative_error=relative_error,
            data_wait_fraction=min(1.0, total.wait / total.seconds) if total.seconds else 1.0,
            load_seconds=total.wait / total.batches,
            step_seconds=total.step / total.batches,
            time_to_first_batch=time_to_first_batch,
            epoch_restart_seconds=statistics.median(restarts) if restarts else None,
            batches=total.batches,
            duration=perf_counter() - started,
            peak_memory=watch.peak,
            batch_bytes=batch_bytes,
            load_cpu_seconds=total.wait_cpu / total.batches,
            step_cpu_seconds=total.step_cpu / total.batches,
            epochs_samples_per_second=epochs.rate(),
            burst_left=burst_left,
        )
