"""One trial: build a DataLoader with given settings and time the training loop.

The runner knows nothing of Optuna or of other trials: everything it needs is passed
in, so the same measurement can run in another process or on every rank of a job.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import pickle
import re
import signal
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from time import perf_counter, process_time
from types import FrameType
from typing import Any, Protocol, TypeVar

import psutil
import torch
from torch._C import _error_if_any_worker_fails
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.signal_handling import _set_SIGCHLD_handler

from autoloader._deadlines import Alarm, Deadlines, TrialTimeout
from autoloader._device import move_to_device, synchronize
from autoloader._loader import build_loader, merge_loader_kwargs
from autoloader._memory import MemoryBudgetExceeded, MemoryWatch, kill

_logger = logging.getLogger(__name__)

# Two-sided 95% Student t quantiles by degrees of freedom; 1.96 beyond the table.
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14,
        2.13, 2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05,
        2.05, 2.04)  # fmt: skip
# The most of a trial's time its warm-up may take (NOTE [ Warm-up ]). Each rank of a
# torchrun job has a share of the cores and drains its burst slower: with 2 ranks on 2
# cores, 8 workers x prefetch 2 took about 1 s of a 3 s trial, and at 0.3 every setting
# of 8 workers or more was pruned as too short (the joint choice fell to 4 workers).
_WARMUP_SHARE = 0.5
# Seconds to wait for the trial's workers to exit before killing them.
_REAP_TIMEOUT = 5.0
# Seconds the shutdown of a trial's loader may take before its workers are killed.
_STOP_TIMEOUT = 60.0


_T = TypeVar("_T")


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
        burst_left: batches of the start-up burst (``num_workers x prefetch_factor``)
            not yet drained when the warm-up's time cap started the timing.
        epochs_samples_per_second: the rate over whole epochs, timed from the first
            batch after warm-up to the same batch of the next epoch (see
            ``NOTE [ Whole epochs ]``), if the trial got that far; ``None`` if not.
        batches: batches measured after warm-up.
        duration: seconds the whole trial took.
        peak_memory: bytes, highest PSS of the process tree during the trial.
        batch_bytes: bytes of the tensors in the first batch.
        load_cpu_seconds: mean CPU seconds this process spent per batch while blocked in
            ``next()``. With ``num_workers=0`` it tells CPU-bound loading (close to
            ``load_seconds``) from waiting on I/O (close to 0).
        step_cpu_seconds: mean CPU seconds this process spent per batch in the step,
            all its threads counted: a step that trains on the CPU keeps as many cores
            busy as ``step_cpu_seconds / step_seconds``, cores workers then compete for.
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
    batch_bytes: int = 0
    load_cpu_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    epochs_samples_per_second: float | None = None
    burst_left: int = 0

    @property
    def too_short(self) -> bool:
        """Whether the trial was too short to trust: fewer than two timing windows (the
        rate has no error estimate: the time ran out during start-up and warm-up), or
        timing began before the start-up burst drained (see ``burst_undrained``)."""
        return not math.isfinite(self.relative_error) or self.burst_undrained

    @property
    def burst_undrained(self) -> bool:
        """Whether timing began with so much of the start-up burst still queued (a
        tenth of the batches timed or more) that the rate counts batches loaded before
        the clock started, and no whole epoch was timed to stand in for it. A loader
        slower than the step then looks as fast as the step: 7 workers x prefetch 8 on
        an epoch of 63 batches measured 1,810 samples/s, and ran 1,134 in training."""
        undrained = self.burst_left > 0 and self.burst_left >= 0.1 * self.batches
        return undrained and self.epochs_samples_per_second is None

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
        worker_signals: signals that killed the trial's workers, if any.
        worker_exit_codes: non-zero exit codes of the trial's workers, if any.
        rank: under torchrun, the rank it happened on (set by the rank that gathered it).
    """

    def __init__(self, stage: str, error: BaseException, peak_memory: int) -> None:
        self.stage = stage
        self.error = error
        self.summary, self.where = describe_error(error)
        self.peak_memory = peak_memory
        self.worker_signals: tuple[int, ...] = ()
        self.worker_exit_codes: tuple[int, ...] = ()
        self.rank: int | None = None
        super().__init__(f"{self.summary} while {stage}")

    def __reduce__(self) -> tuple[Callable[..., TrialError], tuple[Any, ...]]:
        # Sent from a trial's own process (isolation="subprocess"): pickling keeps
        # neither tracebacks nor causes, so the summary and the chain of causes, which
        # the fault classifier reads, are sent as they are.
        return _restore_trial_error, (
            self.stage,
            portable_chain(self.error),
            self.peak_memory,
            self.summary,
            self.where,
            self.worker_signals,
            self.worker_exit_codes,
        )


class RemoteError(Exception):
    """Stands for an exception from a trial's process that could not be sent as itself."""


def portable_chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes, each as itself if it survives pickling, else a stand-in."""
    links: list[BaseException] = []
    for link in exception_chain(error):
        try:
            links.append(pickle.loads(pickle.dumps(link)))
        except Exception:  # an exception whose __init__ does not take its own args
            links.append(RemoteError(f"{type(link).__qualname__}: {link}"))
    return links


def restore_chain(links: list[BaseException]) -> BaseException:
    """The first of ``links``, with each one the ``__cause__`` of the one before."""
    for link, cause in itertools.pairwise(links):
        link.__cause__ = cause
    return links[0]


def _restore_trial_error(
    stage: str,
    chain: list[BaseException],
    peak_memory: int,
    summary: str,
    where: str,
    worker_signals: tuple[int, ...],
    worker_exit_codes: tuple[int, ...],
) -> TrialError:
    error = TrialError(stage, restore_chain(chain), peak_memory)
    error.summary, error.where = summary, where
    error.worker_signals, error.worker_exit_codes = worker_signals, worker_exit_codes
    return error


class TrialProcessDied(Exception):
    """The process running the trial died (``isolation="subprocess"``).

    Attributes:
        exit_code: its exit code; negative for the signal that killed it.
    """

    def __init__(self, exit_code: int) -> None:
        how = (
            f"was killed by {signal.Signals(-exit_code).name}"
            if exit_code < 0
            else f"exited with code {exit_code}"
        )
        super().__init__(f"the trial's process {how}")
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[type[TrialProcessDied], tuple[int]]:
        return type(self), (self.exit_code,)


_WORKER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def describe_error(error: BaseException) -> tuple[str, str]:
    """One line naming the exception, and where it was raised: the exception's type and
    the first line of its message (``"ValueError: No samples found ..."``).

    DataLoader re-raises a worker's exception with a message that embeds the worker's
    traceback ("Caught ValueError in DataLoader worker process 0. Original Traceback
    ..."). Its last frame is the origin; the exception's own line is the first line
    after that frame that is not indented (source lines and ``^^^`` markers are). The
    message's later lines are often advice on silencing a check, not what went wrong.
    """
    message = str(error)
    lines = [line for line in message.splitlines() if line.strip()]
    if message.startswith("Caught ") and "Original Traceback" in message and lines:
        worker = lines[0].removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
        frames = [(n, m) for n, m in enumerate(map(_WORKER_FRAME.match, lines)) if m]
        if not frames:
            return f"{lines[-1].strip()} (in {worker})", ""
        last, frame = frames[-1]
        after = [line for line in lines[last + 1 :] if not line[0].isspace()]
        raised = after[0].strip() if after else lines[-1].strip()
        return f"{raised} (in {worker})", f"{frame['file']}:{frame['line']} in {frame['name']}"
    stack = traceback.extract_tb(error.__traceback__)
    where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
    first = lines[0].strip() if lines else ""
    return f"{type(error).__name__}: {first}".rstrip(": "), where


# Called after each timing window with the window's number and the estimate so far;
# returns True to stop the trial there (a vote, not an exception: the runner returns
# the estimate as measured, and every process of a trial can stop at the same window).
WindowCallback = Callable[[int, Measurement], bool]


# NOTE [ Joint trials ]
# Under torchrun every rank measures the same setting at once (see _joint.py), and a
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


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What one process measuring a setting saw since the last checkpoint; agreed, what
    any of the processes saw (for ``seconds``, the longest)."""

    time_up: bool = False  # the trial's time has run out
    warming: bool = False  # still in the warm-up
    not_ready: bool = False  # its timing window is not yet long enough to close
    restarted: bool = False  # it began a new epoch
    failed: bool = False  # its loader or step failed; it steps the spare batch
    seconds: float = 0.0  # since the last checkpoint


class Lockstep(Protocol):
    """How the processes that measure one setting together (every rank of a torchrun
    job) take the loop's decisions at the same batch (``NOTE [ Joint trials ]``)."""

    joint: bool
    # The last batch stepped well: a joint trial steps it in place of one it failed to load.
    spare: Any

    def begin(self) -> None:
        """A trial starts."""

    def every(self) -> int:
        """Batches from one checkpoint to the next."""

    def agree(self, mine: Checkpoint) -> Checkpoint:
        """What any process saw."""

    def combine(self, estimate: Measurement) -> Measurement:
        """The job's estimate from each process's."""

    def decide(self, stop: bool) -> bool:
        """The driving process's decision to stop, on every process."""


class Alone:
    """A process measuring on its own: every batch a checkpoint, nothing exchanged."""

    joint = False
    spare = None

    def begin(self) -> None:
        return None

    def every(self) -> int:
        return 1

    def agree(self, mine: Checkpoint) -> Checkpoint:
        return mine

    def combine(self, estimate: Measurement) -> Measurement:
        return estimate

    def decide(self, stop: bool) -> bool:
        return stop


class PeerFailed(Exception):
    """Another process of a joint trial failed; this one stopped with it (internal)."""

    def __init__(self) -> None:
        super().__init__("the trial failed on another rank")

    def __reduce__(self) -> tuple[type[PeerFailed], tuple[()]]:
        return type(self), ()


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


@dataclass(slots=True)
class _Totals:
    """Sums over measured batches."""

    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    wait_cpu: float = 0.0
    step: float = 0.0
    step_cpu: float = 0.0


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


@dataclass(slots=True)
class _Epochs:
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


# NOTE [ Pace deadline ]
# A hang in one worker while the others deliver (a fault at worker index k and above)
# stalls the loop at that worker's batch. The trial's deadlines come from the
# baseline, with a floor of seconds; once a timing window has shown this trial's own
# pace, a batch may take no more than _PACE_FACTOR times what each worker takes per
# batch at that pace (workers x seconds per batch: batches come in turn), and at least
# _MIN_PACE_SECONDS. A log-normal latency with sigma 1 stays an order of magnitude
# under it; a hung worker is found in seconds instead of the baseline's floor. Without
# workers (the baseline) there is no worker to hang, and a false timeout there would
# stop the run: the baseline keeps its own deadline.
_PACE_FACTOR = 20.0
_MIN_PACE_SECONDS = 2.0


def _pace_limit(total: _Totals, workers: int) -> float:
    per_batch = total.seconds / total.batches if total.batches else math.inf
    return max(_MIN_PACE_SECONDS, _PACE_FACTOR * max(1, workers) * per_batch)


def _loader_length(loader: DataLoader[Any]) -> int | None:
    """Batches in one epoch of ``loader``, ``None`` where it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None


def _batch_bytes(batch: Any) -> int:
    """Bytes of every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return sum(_batch_bytes(item) for item in batch)
    return 0


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


class _WorkerDeaths:
    """Decides what the death of a trial's worker means while the trial runs.

    DataLoader's SIGCHLD handler raises "worker killed by signal" in the main thread,
    once per death, wherever the main thread is, even in the middle of handling the
    first such error. Blocking the signal does not help: the kernel hands it to another
    thread, and Python runs the handler in the main thread all the same. So during a
    trial this handler stands in front of DataLoader's:

    - the memory watch killed the workers: raise MemoryBudgetExceeded once, which wakes
      a main thread blocked in next(), and ignore the other deaths;
    - the trial is being torn down (``expected``): its workers are being killed on
      purpose, ignore;
    - otherwise a worker really died: DataLoader's handler reports it, once; the
      deaths that follow are part of the same failure.
    - in a joint trial (``defer``), a death while the main thread is not fetching is
      held back until the next fetch begins (:meth:`fetching`): raised in a step, it
      could cut short a step whose collectives are half done (``NOTE [ Joint trials ]``).

    DataLoader installs its handler once per process, when workers first start; it is
    installed first here so that it is the one this handler passes deaths on to.
    """

    def __init__(self, watch: MemoryWatch, *, defer: bool = False) -> None:
        self.watch = watch
        self.defer = defer
        self._fetching = False
        self.expected = False
        self._deferring = False
        self._deferred = False
        self._previous: Any = None

    def start(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """``iter(loader)``, with a worker's death reported after it, not in the middle.

        Starting an iterator puts work on the workers' queues; an error raised there by
        the handler can leave a queue's lock held, and the next put then waits forever.
        So a death while the iterator starts is held back and reported once ``iter()``
        has returned, by DataLoader's own check, which raises its usual error.
        """
        self._deferring, self._deferred = True, False
        try:
            iterator = iter(loader)
        finally:
            self._deferring = False
        if self._deferred:
            self._deferred = False
            try:
                _error_if_any_worker_fails()
            finally:
                _shutdown(iterator, loader, abandon=True)
        return iterator

    @contextlib.contextmanager
    def handled(self) -> Iterator[_WorkerDeaths]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set, and only run, in the main thread
            return
        _set_SIGCHLD_handler()
        self._previous = signal.signal(signal.SIGCHLD, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGCHLD, self._previous)

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """A fetch is under way: a death held back outside one (``defer``) is reported
        as it starts, and a death during it at once."""
        self._fetching = True
        try:
            if self._deferred and not self._deferring:
                self._deferred = False
                self.watch.check()
                _error_if_any_worker_fails()
            yield
        finally:
            self._fetching = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring or (self.defer and not self._fetching):
            self._deferred = True
            return
        if self.watch.exceeded:
            error = self.watch.claim()
            if error is not None:
                raise error
            return
        if not self.expected and callable(self._previous):
            try:
                self._previous(signum, frame)
            except BaseException:
                self.expected = True  # the trial fails with this error; later deaths follow
                raise


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

        def read(loader: DataLoader[Any], guard: _Guard) -> list[Any]:
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
        run: Callable[[DataLoader[Any], _Guard], _T],
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
            _WorkerDeaths(watch, defer=joint).handled() as deaths,
            Alarm().installed() as alarm,
            warnings.catch_warnings(),
        ):
            # Trials run more workers than cores on purpose; torch warns against it.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            guard = _Guard(watch=watch, deaths=deaths, alarm=alarm, started=started)
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
                if not isinstance(error, TrialError) and not _worker_died(error):
                    raise
                # DataLoader's report of a dead worker can surface at any bytecode of the
                # loop, not only in next(): it is still the worker's failure.
                failure = (
                    error
                    if isinstance(error, TrialError)
                    else TrialError("loading a batch", error, watch.peak)
                )
                failure.worker_signals, failure.worker_exit_codes = _worker_exits(
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
                _stop_workers(guard, abandon=failed)

    def _time_loop(
        self,
        loader: DataLoader[Any],
        guard: _Guard,
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
        # exclusion is capped at _WARMUP_SHARE of the trial's time, so a slow loader
        # still leaves time to measure.
        warmup = workers * int(params.get("prefetch_factor") or 0)
        warmup_deadline = started + _WARMUP_SHARE * max_seconds
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
        batch_bytes = _batch_bytes(batch)
        step(batch)
        epochs = _Epochs(_loader_length(loader), in_flight=warmup)
        restarts: list[float] = []
        windows: list[_Totals] = []
        total = _Totals()
        window: _Totals | None = None
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
            epochs.add(_batch_length(batch, self.batch_size), t2)
            ready = last = False
            if restarted:
                window, to_skip = None, warmup
            elif window is None:
                warming = to_skip > 0 and t2 < warmup_deadline
                to_skip -= warming
            else:
                window.samples += _batch_length(batch, self.batch_size)
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
                window, window_start = _Totals(), perf_counter()
                continue
            if agreed.not_ready:
                continue
            synchronize(self.device)
            end = perf_counter()
            window.seconds = end - window_start
            windows.append(window)
            for name in (f.name for f in fields(_Totals)):
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
                each_limit = min(each_limit, _pace_limit(total, workers))
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
        return estimate_so_far()

    def _step(self, batch: Any, non_blocking: bool) -> None:
        if self.device is not None:
            batch = move_to_device(batch, self.device, non_blocking=non_blocking)
        self.step_fn(batch)

    def _estimate(
        self,
        windows: list[_Totals],
        total: _Totals,
        time_to_first_batch: float,
        restarts: list[float],
        started: float,
        watch: MemoryWatch,
        batch_bytes: int,
        epochs: _Epochs,
        burst_left: int,
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
            batch_bytes=batch_bytes,
            load_cpu_seconds=total.wait_cpu / total.batches,
            step_cpu_seconds=total.step_cpu / total.batches,
            epochs_samples_per_second=epochs.rate(),
            burst_left=burst_left,
        )


@dataclass(slots=True)
class _Guard:
    """What watches over one run of a loader, and what to clean up after it: the
    loader and its current iterator (a new one each epoch)."""

    watch: MemoryWatch
    deaths: _WorkerDeaths
    alarm: Alarm
    started: float
    loader: DataLoader[Any] | None = None
    iterator: Iterator[Any] | None = None


# Errors that mean the other end of a worker's pipe or socket went away.
_PEER_GONE = (ConnectionError, EOFError)
_WORKER_DIED = ("exited unexpectedly", "is killed by signal")
# How long a worker that is dying gets to finish, so its exit status can be read.
_DEATH_GRACE = 1.0


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``, else ``__context__``), and so on."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _worker_died(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says a worker died or its pipe went away."""
    return any(
        isinstance(link, _PEER_GONE) or any(text in str(link) for text in _WORKER_DIED)
        for link in exception_chain(error)
    )


def _worker_exits(
    iterator: object, error: BaseException
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Signals that killed the iterator's workers, and their non-zero exit codes.

    A worker that dies while handing over a batch can make the main process fail
    first (a connection reset, an EOF) while the worker is still dying; for such errors
    the workers get a moment to finish, or the signal would be missed.
    """
    workers = list(getattr(iterator, "_workers", None) or ())
    if workers and _worker_died(error):
        give_up = time.monotonic() + _DEATH_GRACE
        while time.monotonic() < give_up and all(w.exitcode is None for w in workers):
            time.sleep(0.02)
    signals, codes = [], []
    for worker in workers:
        code = worker.exitcode
        if code is not None and code < 0:
            signals.append(-code)
        elif code:
            codes.append(code)
    if not signals and not codes:
        # The worker was already reaped elsewhere (rarely seen in the test suite): torch's
        # own message still names the exit code.
        found = _TORCH_EXIT_CODE.search(str(error))
        if found:
            code = int(found["code"])
            (signals if code < 0 else codes).append(abs(code))
    return tuple(signals), tuple(codes)


# DataLoader's message for a worker that exited: "DataLoader worker (pid 32512) exited
# unexpectedly with exit code 3. Details are lost due to multiprocessing. ..."
_TORCH_EXIT_CODE = re.compile(r"exited unexpectedly with exit code (?P<code>-?\d+)")


def _shutdown(iterator: object, loader: DataLoader[Any] | None, *, abandon: bool = False) -> None:
    """Stop the workers of a trial's iterator (and of a persistent loader's own).

    With ``abandon`` (the trial failed and its workers were killed), the shutdown
    touches nothing a killed worker may have left locked: it skips telling each worker
    to stop through its queue (a put interrupted by a worker-death error may have left
    that queue's lock held) and the shared "done" event. The workers are dead; joining
    them and closing the queues is enough.
    """
    for it in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is None:
            continue
        if abandon and hasattr(it, "_workers_status"):
            it._workers_status = [False] * len(it._workers_status)
            it._persistent_workers = False  # type: ignore[union-attr]
            # Workers check this event in their loop, under a lock they share with this
            # process: one killed while it held the lock would make setting the event
            # wait forever. The workers are dead; nobody is left to see it set.
            it._workers_done_event = threading.Event()  # type: ignore[union-attr]
        shutdown()
    if loader is not None:
        loader._iterator = None


def _stop_workers(guard: _Guard, *, abandon: bool) -> None:
    """Shut the trial's loader down, under a deadline like every other wait.

    A shutdown that overruns it (a lock a dead worker left held, in a way not foreseen
    in :func:`_shutdown`, or workers slow to exit) has its workers killed. It changes
    nothing about the trial: a measurement taken to the end is kept, and a trial that
    failed keeps its own error (a memory overrun is not turned into a timeout).
    """
    guard.alarm.arm("stopping the trial's workers", _STOP_TIMEOUT)
    try:
        _shutdown(guard.iterator, guard.loader, abandon=abandon)
    except TrialTimeout:
        _logger.warning(
            "the trial's workers did not stop within %.0f s; they were killed", _STOP_TIMEOUT
        )
        kill(guard.watch.new_children())
    finally:
        guard.alarm.disarm()
        _reap(guard.watch.new_children())


def _reap(children: list[psutil.Process]) -> None:
    """Wait for the trial's leftover processes to exit; kill those that do not."""
    _, alive = psutil.wait_procs(children, timeout=_REAP_TIMEOUT)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=_REAP_TIMEOUT)
