"""Memory: sizes in bytes, memory available to this process tree, and a watchdog.

The tree's memory is the sum of each process's PSS (proportional set size): a page
shared by the main process and its forked workers is counted once, split between them,
where summing RSS would count it once per worker and overstate a fork-heavy tree.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import psutil

from autoloader._exceptions import InvalidInputError
from autoloader.measure._process_memory import (
    rss_sums,
    tree_memory,
    tree_memory_parts,
)
from autoloader.measure._units import format_bytes, parse_bytes

_logger = logging.getLogger(__name__)

# Share of the currently available memory a default budget may take on top of what the
# tree already uses: the rest is head-room for the page cache and other processes.
DEFAULT_BUDGET_SHARE = 0.8


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (no limit) or unreadable
        return None
    return int(text)


def _cgroup_limit_and_usage(root: Path) -> tuple[int | None, int | None]:
    """The memory limit and usage of this process's cgroup (v2, else v1), if limited."""
    limit = _read_int(root / "memory.max")
    if limit is not None:
        return limit, _read_int(root / "memory.current")
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    # cgroup v1 reports an absurdly large number when unlimited.
    if limit is not None and limit < 1 << 60:
        return limit, _read_int(root / "memory" / "memory.usage_in_bytes")
    return None, None


def total_memory(*, cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Physical memory, or the cgroup's memory limit where that is smaller."""
    total = int(psutil.virtual_memory().total)
    limit, _ = _cgroup_limit_and_usage(cgroup_root)
    return min(total, limit) if limit is not None else total


def available_memory(*, cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory that can still be allocated: the host's available, capped by the cgroup."""
    available = int(psutil.virtual_memory().available)
    limit, usage = _cgroup_limit_and_usage(cgroup_root)
    if limit is not None and usage is not None:
        available = min(available, max(0, limit - usage))
    return available


def default_memory_budget() -> int:
    """What the tree uses now plus a safe share of the memory still available."""
    return tree_memory() + int(DEFAULT_BUDGET_SHARE * available_memory())


def resolve_memory_budget(memory_budget: int | str | None) -> int:
    """Bytes the process tree may use: ``memory_budget`` parsed and checked, or the
    default (:func:`default_memory_budget`) for ``None``.

    Raises:
        InvalidInputError: the budget is malformed or below what the tree uses now.
    """
    if memory_budget is None:
        return default_memory_budget()
    budget = parse_bytes(memory_budget)
    in_use = tree_memory()
    if budget <= in_use:
        raise InvalidInputError(
            f"memory_budget {format_bytes(budget)} is below what this process tree already "
            f"uses ({format_bytes(in_use)}); every trial would be stopped. Give a larger "
            "budget, or None for a safe share of the available memory."
        )
    return budget


def is_oom_error(error: BaseException) -> bool:
    """Whether ``error`` is an allocator out-of-memory error (CPU, CUDA or other device).

    ``torch.OutOfMemoryError`` covers CUDA and other accelerators; the CPU allocator
    raises a plain ``RuntimeError`` whose message says it cannot allocate memory.
    """
    if isinstance(error, MemoryError):
        return True
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError):
        message = str(error)
        return (
            "out of memory" in message.lower()
            or "DefaultCPUAllocator: can't allocate memory" in message
            or "DefaultCPUAllocator: not enough memory" in message
        )
    return False


class MemoryBudgetExceeded(Exception):
    """The trial's process tree passed the memory budget, or was about to (internal).

    Attributes:
        peak: bytes, the highest the tree was seen to use.
        budget: bytes the tree may use.
        projected: bytes the tree would have reached by the trial's end at the rate it
            was growing, when that projection (not the tree itself) passed the budget.
        tree: the tree watched, as the message names it; under torchrun on several
            nodes, the node's (see :func:`autoloader.distributed._joint.job_outcome`).
    """

    def __init__(
        self, peak: int, budget: int, projected: int | None = None, tree: str = "process tree"
    ) -> None:
        if projected is None:
            message = (
                f"{tree} reached {format_bytes(peak)}, over the memory budget of "
                f"{format_bytes(budget)}"
            )
        else:
            message = (
                f"{tree} grew to {format_bytes(peak)} and, at the rate it was "
                f"growing, would reach {format_bytes(projected)} by the end of the trial, "
                f"over the memory budget of {format_bytes(budget)}"
            )
        super().__init__(message)
        self.peak = peak
        self.budget = budget
        self.projected = projected
        self.tree = tree

    def __reduce__(
        self,
    ) -> tuple[type[MemoryBudgetExceeded], tuple[int, int, int | None, str]]:
        return type(self), (self.peak, self.budget, self.projected, self.tree)


class Growth:
    """How fast the tree's memory grows in a sustained way, over the last ``window`` s.

    The samples are split in two halves of time, and the rate is the smaller of the
    two halves' rates: a steady leak grows in both, while a one-off burst (a worker
    allocating its buffers once, a queue filling) grows in one only and counts as none.

    Args:
        window (float): seconds of samples kept.
        min_span (float): seconds of samples needed before a rate is given.
    """

    def __init__(self, *, window: float, min_span: float) -> None:
        self.window = window
        self.min_span = min_span
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, when: float, used: int) -> None:
        self._samples.append((when, used))
        while self._samples and when - self._samples[0][0] > self.window:
            self._samples.popleft()

    def reset(self) -> None:
        self._samples.clear()

    def rate(self) -> float | None:
        """Bytes per second, or ``None`` until the samples span ``min_span``."""
        if len(self._samples) < 3:
            return None
        (first, start), (last, end) = self._samples[0], self._samples[-1]
        if last - first < self.min_span:
            return None
        middle = (first + last) / 2
        when, used = min(list(self._samples)[1:-1], key=lambda s: abs(s[0] - middle))
        return min((used - start) / (when - first), (end - used) / (last - when))


class MemoryWatch:
    """Samples the process tree's memory on a thread and records its peak.

    When the tree passes ``budget``, or grows fast enough to pass it before ``ends_at``
    (see ``NOTE [ Growth projection ]``), the watch marks itself exceeded and SIGKILLs
    the trial's workers, those ``workers`` names and nothing else (``NOTE [ Only the
    trial's own processes ]``). Killing them frees the memory at once and unblocks a
    main thread stuck waiting for a batch: the DataLoader then raises, and the trial
    runner reports the budget as the cause.

    Args:
        budget (int): bytes the whole tree may use.
        interval (float, optional): seconds between samples. (default: ``0.1``)
        ends_at (float, optional): ``time.monotonic()`` time the trial ends, to which
            growth is projected; ``None`` disables the projection. (default: ``None``)
        others (sequence of int, optional): pids of other processes whose trees count in
            the budget with this one's (the other ranks of a torchrun job on this node).
            Their workers are theirs to stop: see ``NOTE [ Only the trial's own
            processes ]``. (default: ``()``)
        workers (callable, optional): the pids of the trial's worker processes as they
            are now, the only processes the watch kills; settable after construction, as
            the trial's loader starts them later. (default: none)
    """

    # NOTE [ Only the trial's own processes ]
    # autoloader runs in the user's process, beside whatever else that process starts: a
    # logger, an uploader, an evaluation job. Its memory counts in the budget (the budget
    # is the tree's), but the watch, the trial's clean-up and its reaping act only on the
    # processes the trial's loader started, read from its iterator (``_workers``), and on
    # what those started: never on another child of the process, never on a pid it did
    # not start (a kill by pid is sent only to a worker multiprocessing has not reaped,
    # so the pid cannot have been reused). A worker that is still starting (inside
    # ``iter()``, before its iterator exists) is not yet named: the main thread is then
    # sent the SIGCHLD a death would send, which raises the overrun there
    # (``WorkerDeaths``), and every later sample kills the workers named by then.
    # Under torchrun the node's first rank watches the node's tree (every rank's
    # workers count) but stops only its own workers: its trial fails, and every rank
    # leaves the trial with it at the next checkpoint and stops its own workers there
    # (``NOTE [ Joint trials ]``). Reading the other ranks' workers from /proc would
    # not tell them from those ranks' other children, and sending them through the
    # process group takes a collective the watch's thread cannot make.

    # NOTE [ Cheap memory sampling ]
    # The tree's PSS is exact but costs a page-table walk per process: about 4 ms for
    # each process that imported torch, 50-60 ms for a 12-worker tree on a 2-core
    # machine, which slowed the loop being measured by 2-3% when read every 100 ms.
    # So each sample sums RSS (a counter read, ~0.01 ms per process) and estimates
    #     PSS ~ last exact PSS + growth of the RSS sum since then,
    # counting new pages as private. A forked worker's RSS includes every page it still
    # shares with its parent, so whenever the set of processes changes the exact PSS
    # is read again. Copy-on-write copies do not grow RSS and show up only at the next
    # exact reading, which happens as often as its cost stays under _CALIBRATION_DUTY
    # of the time (about once a second for 12 workers), and always before a trial is
    # stopped, so only a real excess stops it. The list of processes is refreshed
    # every _CHILDREN_REFRESH seconds: scanning /proc for children costs ~2 ms.
    _CALIBRATION_DUTY = 0.05
    _CHILDREN_REFRESH = 0.5

    # NOTE [ Growth projection ]
    # Sampling every 100 ms cannot stop a tree that allocates faster than the head-room
    # left in 100 ms, and the kernel's OOM killer does not wait for the next sample. A
    # tree that grows steadily (a leak, copy-on-read of Python objects in forked
    # workers, a cache without a bound) shows it long before: the watch measures the
    # growth rate over the last _GROWTH_WINDOW seconds and projects it to the trial's
    # end. When the projection passes the budget on _CONFIRMATIONS samples in a row,
    # the exact PSS is read and, if it still projects over, the trial is stopped there,
    # under the budget. Training runs longer than a trial, so a setting stopped this way
    # would have passed the budget in training too. The rate is measured afresh
    # whenever the set of processes changes, and only over _MIN_GROWTH_SPAN seconds or
    # more: workers starting, and queues filling once, are bursts that then stop.
    #
    # NOTE [ Growth of the tree's own memory ]
    # The growth rate is read from the memory the tree allocated itself (anonymous pages
    # and shared memory: PSS less its file pages; between exact readings, RSS less its
    # file pages), not from the whole PSS. A file page's PSS is divided among every
    # process mapping it, the tree's or not: when four processes elsewhere on the
    # machine imported torch, this process's PSS fell 57 MB within 1.5 s (libtorch's
    # pages re-divided), and rose again as they ended. Read as growth, such a step hid a
    # 30 MB/s leak (a torchrun rank's trial then reported its peer's hang instead of its
    # own memory fault, where other jobs on the machine started), or could make a tree
    # that does not grow look as if it did. File pages are the page cache's to reclaim,
    # too: a dataset read through a memory map grows them without a fault to project.
    # The file pages between readings come from /proc/<pid>/status, not from statm
    # (``memory_info()``), whose "shared" counts shared memory with them: the tree's
    # /dev/shm batches and MAP_SHARED maps then grew only at the exact readings, steps a
    # half of the window could miss, and a 128 MiB/s leak passed the budget without a
    # projection beside other tests. The budget itself still counts the whole PSS.
    _GROWTH_WINDOW = 2.0
    _MIN_GROWTH_SPAN = 1.0
    _CONFIRMATIONS = 3

    def __init__(
        self,
        budget: int,
        *,
        interval: float = 0.1,
        ends_at: float | None = None,
        others: Sequence[int] = (),
        workers: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self.budget = budget
        self.interval = interval
        self.ends_at = ends_at
        self.peak = 0
        self.projected: int | None = None
        self._process = psutil.Process()
        self._others = [psutil.Process(pid) for pid in others if _exists(pid)]
        self.workers = workers
        self._killed: set[int] = set()
        self._exceeded = threading.Event()
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tree: list[psutil.Process] = []
        self._tree_read_at = -math.inf
        self._exact = 0
        self._rss_at_exact = 0
        self._exact_own = 0  # NOTE [ Growth of the tree's own memory ]
        self._own_rss_at_exact = 0
        self._used: int | None = None
        self._exact_at = -math.inf
        self._exact_every = 0.0
        self._growth = Growth(window=self._GROWTH_WINDOW, min_span=self._MIN_GROWTH_SPAN)
        self._over_projections = 0

    @property
    def exceeded(self) -> bool:
        return self._exceeded.is_set()

    def start(self, *, sample: bool = True) -> MemoryWatch:
        """With ``sample``, watch the tree's memory on a thread until :meth:`stop`."""
        if not sample:
            return self
        self.sample()
        self._thread = threading.Thread(target=self._run, name="autoloader-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling; from any thread, the watch's own included (a finalizer run by
        the garbage collector there)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            _join(thread)

    @property
    def running(self) -> bool:
        """Whether the watch's thread is sampling."""
        return self._thread is not None

    def sample(self) -> int:
        """Estimate the tree's memory now (see ``NOTE [ Cheap memory sampling ]``)."""
        now = time.monotonic()
        changed = False
        if now - self._tree_read_at >= self._CHILDREN_REFRESH:
            tree = [self._process, *self._process.children(recursive=True)]
            tree += [*self._others, *_descendants(self._others)]
            changed = {p.pid for p in tree} != {p.pid for p in self._tree}
            self._tree, self._tree_read_at = tree, now
        rss, own_rss = rss_sums(self._tree)
        if changed or now - self._exact_at >= self._exact_every:
            used = self._calibrate(rss, own_rss)
        else:
            used = self._exact + max(0, rss - self._rss_at_exact)
            if used > self.budget:
                used = self._calibrate(rss, own_rss)
        if changed:
            self._growth.reset()
        self._growth.add(now, self._exact_own + own_rss - self._own_rss_at_exact)
        self._used = used
        self.peak = max(self.peak, used)
        if self._exceeded.is_set():
            kill(self._unkilled())  # workers that were still starting when it passed
            return used
        if used > self.budget:
            self._stop_trial(f"memory budget exceeded ({format_bytes(used)})")
        elif self._projects_over(now, used, rss, own_rss):
            self._stop_trial(f"memory projected to reach {format_bytes(self.projected or 0)}")
        return used

    def _projects_over(self, now: float, used: int, rss: int, own_rss: int) -> bool:
        """Whether growth at the current rate passes the budget by ``ends_at``."""
        rate = self._growth.rate()
        if self.ends_at is None or rate is None or rate <= 0:
            self._over_projections = 0
            return False
        left = max(0.0, self.ends_at - now)
        if used + rate * left <= self.budget:
            self._over_projections = 0
            return False
        self._over_projections += 1
        if self._over_projections < self._CONFIRMATIONS:
            return False
        exact = self._calibrate(rss, own_rss)
        self.peak = max(self.peak, exact)
        projected = exact + rate * left
        if projected <= self.budget:
            return False
        self.projected = int(projected)
        return True

    def _stop_trial(self, why: str) -> None:
        self._exceeded.set()
        _logger.info("%s; stopping the trial", why)
        workers = self._unkilled()
        kill(workers)
        main = threading.main_thread().ident
        if not workers and main is not None:
            # Thread workers, or processes still starting: no process dies to wake a
            # main thread waiting for a batch, so it is sent the signal a worker's death
            # would send (the trial's handler raises the overrun there), to that thread:
            # sent to the process, the signal may be taken by another thread and leave
            # the main one asleep.
            signal.pthread_kill(main, signal.SIGCHLD)

    def _unkilled(self) -> list[int]:
        """The trial's workers not killed yet (``NOTE [ Only the trial's own processes ]``)."""
        pids = [pid for pid in self.workers() if pid not in self._killed]
        self._killed.update(pids)
        return pids

    def _calibrate(self, rss: int, own_rss: int) -> int:
        started = time.monotonic()
        parts = [tree_memory_parts(self._process)]
        parts += [tree_memory_parts(other) for other in self._others if _exists(other.pid)]
        self._exact = sum(pss for pss, _ in parts)
        self._exact_own = self._exact - sum(in_files for _, in_files in parts)
        self._rss_at_exact, self._own_rss_at_exact = rss, own_rss
        self._exact_at = time.monotonic()
        self._exact_every = (self._exact_at - started) / self._CALIBRATION_DUTY
        return self._exact

    def outgrows(self, seconds: float) -> MemoryBudgetExceeded | None:
        """The error to report if the tree's sustained growth passes the budget within
        ``seconds`` (``NOTE [ Growth projection ]``); ``None`` if it does not. Asked when
        a batch overran its deadline: the growth is the fault, not the wait. The trial's
        workers are left to the runner to stop."""
        rate, used = self._growth.rate(), self._used
        if rate is None or rate <= 0 or used is None or used + rate * seconds <= self.budget:
            return None
        self.projected = int(used + rate * seconds)
        self._exceeded.set()
        _logger.info(
            "memory growing %s/s, projected to reach %s; stopping the trial",
            format_bytes(int(rate)),
            format_bytes(self.projected),
        )
        return self.claim()

    def check(self) -> None:
        """Raise :class:`MemoryBudgetExceeded` the first time this finds the budget passed."""
        error = self.claim()
        if error is not None:
            raise error

    def claim(self) -> MemoryBudgetExceeded | None:
        """The error to raise if the budget was passed and no one has raised it yet."""
        if not self._exceeded.is_set() or self._reported:
            return None
        self._reported = True
        return self.error()

    def error(self) -> MemoryBudgetExceeded:
        """The error that says how the tree passed, or was to pass, the budget."""
        return MemoryBudgetExceeded(self.peak, self.budget, self.projected)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except psutil.Error:  # pragma: no cover - the tree changed mid-read
                continue

    def __enter__(self) -> MemoryWatch:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _exists(pid: int) -> bool:
    return bool(psutil.pid_exists(pid))


def _descendants(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            found += process.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of the trial's worker processes ``pids`` that is still there, and
    what each has started (its tree: processes the user's dataset code started in the
    worker die with it, as in a killed process group).

    The pids must be the trial's own, not yet reaped (``NOTE [ Only the trial's own
    processes ]``): nothing else is looked up or signalled.
    """
    for pid in pids:
        try:
            tree = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for target in (pid, *(p.pid for p in tree)):
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


# A thread whose start() a Ctrl-C cut short may run without having said so yet:
# join() refuses it ("cannot join thread before it is started") until it does.
_START_WAIT = 1.0


def _join(thread: threading.Thread) -> None:
    """Join ``thread``, whose ``start()`` may have been cut short by a Ctrl-C between
    creating the thread and its saying it runs (a CLI run beside a busy loop turned the
    interrupt into that RuntimeError): wait up to ``_START_WAIT`` for it to say so,
    then join it; one that never started is left to the collector."""
    given_up = time.monotonic() + _START_WAIT
    while True:
        try:
            thread.join()
            return
        except RuntimeError:
            if time.monotonic() > given_up:
                return
            time.sleep(0.001)
