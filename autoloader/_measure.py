"""One trial: build a DataLoader with given settings and time the training loop.

The runner knows nothing of Optuna or of other trials: everything it needs is passed
in, so the same measurement can run in another process or on every rank of a job.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import statistics
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from time import perf_counter
from types import FrameType
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.signal_handling import _set_SIGCHLD_handler

from autoloader._device import move_to_device, synchronize
from autoloader._loader import merge_loader_kwargs
from autoloader._memory import MemoryBudgetExceeded, MemoryWatch

# Two-sided 95% Student t quantiles by degrees of freedom; 1.96 beyond the table.
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14,
        2.13, 2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05,
        2.05, 2.04)  # fmt: skip
# Seconds to wait for the trial's workers to exit before killing them.
_REAP_TIMEOUT = 5.0


def _t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 1.96


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one trial measured of the training loop ``next(loader)`` then ``step_fn``.

    Attributes:
        samples_per_second: steady-state rate of the loop, warm-up excluded.
        relative_error: half-width of the 95% confidence interval of that rate, as a
            fraction of it (``inf`` when too few windows were measured to tell).
        data_wait_fraction: share of the loop's time spent blocked in ``next()``.
        load_seconds: mean seconds per batch blocked in ``next()``.
        step_seconds: mean seconds per batch in the step (transfer included).
        time_to_first_batch: seconds from ``iter(loader)`` to the first batch: worker
            start-up plus the first batch's load.
        epoch_restart_seconds: the same for a later epoch, if the trial crossed one.
        batches: batches measured after warm-up.
        duration: seconds the whole trial took.
        peak_memory: bytes, highest PSS of the process tree during the trial.
    """

    samples_per_second: float
    relative_error: float
    data_wait_fraction: float
    load_seconds: float
    step_seconds: float
    time_to_first_batch: float
    epoch_restart_seconds: float | None
    batches: int
    duration: float
    peak_memory: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrialError(Exception):
    """User code raised during a trial.

    Attributes:
        stage: what the loop was doing: "loading a batch" or "running step_fn".
        error: the exception user code raised (re-raised by DataLoader for workers).
        summary: one line, ``"ValueError: corrupt record 3"``, with the worker's
            traceback that DataLoader folds into the message left out.
        where: ``"file:line in function"`` where it was raised, or ``""``.
        peak_memory: bytes, the tree's peak before the error.
    """

    def __init__(self, stage: str, error: BaseException, peak_memory: int) -> None:
        self.stage = stage
        self.error = error
        self.summary, self.where = describe_error(error)
        self.peak_memory = peak_memory
        super().__init__(f"{self.summary} while {stage}")


_WORKER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def describe_error(error: BaseException) -> tuple[str, str]:
    """One line naming the exception, and where it was raised.

    DataLoader re-raises a worker's exception with a message that embeds the worker's
    traceback ("Caught ValueError in DataLoader worker process 0. Original Traceback
    ..."): its last line is the original message and its last frame the origin.
    """
    message = str(error)
    lines = [line for line in message.splitlines() if line.strip()]
    if message.startswith("Caught ") and "Original Traceback" in message and lines:
        worker = lines[0].removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
        frames = [m for m in map(_WORKER_FRAME.match, lines) if m]
        where = (
            f"{frames[-1]['file']}:{frames[-1]['line']} in {frames[-1]['name']}" if frames else ""
        )
        return f"{lines[-1].strip()} (in {worker})", where
    stack = traceback.extract_tb(error.__traceback__)
    where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
    first = lines[0] if lines else ""
    return f"{type(error).__name__}: {first}".rstrip(": "), where


WindowCallback = Callable[[int, Measurement], None]


@dataclass(slots=True)
class _Totals:
    """Sums over measured batches."""

    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    step: float = 0.0


def _batch_length(batch: Any, default: int) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else default
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            if isinstance(item, torch.Tensor | Mapping | list | tuple):
                return _batch_length(item, default)
    return default


@contextlib.contextmanager
def _expected_deaths(watch: MemoryWatch) -> Iterator[None]:
    """Treat the deaths of workers the memory watch killed as expected, not as failures.

    DataLoader's SIGCHLD handler raises "worker killed by signal" in the main thread,
    once per death, wherever the main thread is, including in the middle of handling
    the first such error. While the watch is stopping the trial this handler raises
    MemoryBudgetExceeded once, which wakes a main thread blocked in next(), and
    swallows the rest; any other death still reaches DataLoader's handler, which is
    installed first (DataLoader does so once per process, when workers first start).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set, and only run, in the main thread
        return
    _set_SIGCHLD_handler()
    previous = signal.getsignal(signal.SIGCHLD)

    def handler(signum: int, frame: FrameType | None) -> None:
        if watch.exceeded:
            error = watch.claim()
            if error is not None:
                raise error
            return
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGCHLD, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


@contextlib.contextmanager
def _sigchld_deferred() -> Iterator[None]:
    """Hold SIGCHLD while workers are shut down.

    DataLoader's SIGCHLD handler raises in the main thread when a worker died. While a
    trial is being torn down after its workers were killed, that error would land in
    the middle of the clean-up; deferred, it is delivered once the workers are
    unregistered, when the handler has nothing left to report.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
    ) -> Measurement:
        """Measure the loop with ``params`` for at most about ``max_seconds``.

        Args:
            params: tuned DataLoader settings (see ``SearchSpace``).
            max_seconds: time cap; the trial stops earlier once the rate is stable.
            on_window: called after each timing window with the estimate so far; an
                exception it raises (e.g. ``optuna.TrialPruned``) stops the trial.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: the dataset, collate_fn or step_fn raised.
        """
        started = perf_counter()
        watch = MemoryWatch(self.memory_budget).start()
        loader: DataLoader[Any] | None = None
        iterator: Iterator[Any] | None = None
        with _expected_deaths(watch), warnings.catch_warnings():
            # Trials run more workers than cores on purpose; torch warns against it.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            try:
                kwargs = merge_loader_kwargs(
                    params, batch_size=self.batch_size, fixed=self.fixed_kwargs
                )
                loader = DataLoader(self.dataset, **kwargs)
                iterator = iter(loader)
                return self._time_loop(
                    loader, iterator, params, watch, started, started + max_seconds, on_window
                )
            except MemoryBudgetExceeded:
                raise
            except Exception as error:
                # A worker the watch killed may surface as a DataLoader or user-code error.
                if watch.exceeded:
                    raise MemoryBudgetExceeded(watch.peak, watch.budget) from error
                raise
            finally:
                watch.stop()
                with _sigchld_deferred():
                    _shutdown(iterator, loader)
                    _reap(watch.new_children())

    def _time_loop(
        self,
        loader: DataLoader[Any],
        iterator: Iterator[Any],
        params: Mapping[str, Any],
        watch: MemoryWatch,
        started: float,
        deadline: float,
        on_window: WindowCallback | None,
    ) -> Measurement:
        workers = int(params["num_workers"])
        non_blocking = bool(params.get("pin_memory"))
        # NOTE [ Warm-up ]
        # At start-up every worker loads prefetch_factor batches at once, so the first
        # workers * prefetch_factor batches arrive faster than the steady rate. They are
        # excluded, or an under-provisioned setting would look fast in a short trial. The
        # exclusion is capped in time so a slow loader still leaves time to measure.
        warmup = workers * int(params.get("prefetch_factor") or 0)
        warmup_deadline = started + 0.3 * (deadline - started)
        window_batches = max(2, workers)

        def fetch(it: Iterator[Any]) -> Any:
            try:
                return next(it)
            except StopIteration:
                raise
            except Exception as error:
                raise TrialError("loading a batch", error, watch.peak) from error

        def step(batch: Any) -> None:
            try:
                if self.device is not None:
                    batch = move_to_device(batch, self.device, non_blocking=non_blocking)
                self.step_fn(batch)
            except Exception as error:
                raise TrialError("running step_fn", error, watch.peak) from error

        batch = fetch(iterator)
        time_to_first_batch = perf_counter() - started
        step(batch)
        watch.check()
        restarts: list[float] = []
        windows: list[_Totals] = []
        total = _Totals()
        window: _Totals | None = None
        window_start = 0.0
        to_skip = warmup

        while perf_counter() < deadline:
            t0 = perf_counter()
            try:
                batch = fetch(iterator)
            except StopIteration:
                # A new epoch: workers restart unless persistent; time it, warm up again.
                iterator = iter(loader)
                batch = fetch(iterator)
                restarts.append(perf_counter() - t0)
                step(batch)
                window, to_skip = None, warmup
                continue
            t1 = perf_counter()
            step(batch)
            watch.check()
            t2 = perf_counter()
            if to_skip > 0 and t2 < warmup_deadline:
                to_skip -= 1
                continue
            if window is None:
                synchronize(self.device)
                window, window_start = _Totals(), perf_counter()
                continue
            window.samples += _batch_length(batch, self.batch_size)
            window.batches += 1
            window.wait += t1 - t0
            window.step += t2 - t1
            elapsed = t2 - window_start
            if window.batches >= window_batches and elapsed >= self.min_window_seconds:
                synchronize(self.device)
                end = perf_counter()
                window.seconds = end - window_start
                windows.append(window)
                for name in ("samples", "batches", "seconds", "wait", "step"):
                    setattr(total, name, getattr(total, name) + getattr(window, name))
                estimate = self._estimate(
                    windows, total, time_to_first_batch, restarts, started, watch
                )
                if on_window is not None:
                    on_window(len(windows), estimate)
                if (
                    len(windows) >= self.min_windows
                    and estimate.relative_error <= self.target_relative_error
                ):
                    return estimate
                window, window_start = _Totals(), end

        if not windows and window is not None and window.batches > 0:
            # The cap came before a full window: keep the partial one, flagged uncertain.
            window.seconds = perf_counter() - window_start
            windows.append(window)
            total = window
        if not windows:
            # Not one batch after warm-up: fall back to the first batch alone.
            total = _Totals(
                samples=_batch_length(batch, self.batch_size),
                batches=1,
                seconds=time_to_first_batch,
                wait=time_to_first_batch,
            )
        return self._estimate(windows, total, time_to_first_batch, restarts, started, watch)

    def _estimate(
        self,
        windows: list[_Totals],
        total: _Totals,
        time_to_first_batch: float,
        restarts: list[float],
        started: float,
        watch: MemoryWatch,
    ) -> Measurement:
        rate = total.samples / total.seconds if total.seconds > 0 else 0.0
        relative_error = math.inf
        if len(windows) >= 2 and rate > 0:
            rates = [w.samples / w.seconds for w in windows]
            spread = statistics.stdev(rates) / math.sqrt(len(rates))
            relative_error = _t95(len(rates) - 1) * spread / statistics.fmean(rates)
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
        )


def _shutdown(iterator: object, loader: DataLoader[Any] | None) -> None:
    """Stop the workers of a trial's iterator (and of a persistent loader's own)."""
    for it in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    if loader is not None:
        loader._iterator = None


def _reap(children: list[psutil.Process]) -> None:
    """Wait for the trial's leftover processes to exit; kill those that do not."""
    _, alive = psutil.wait_procs(children, timeout=_REAP_TIMEOUT)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=_REAP_TIMEOUT)
