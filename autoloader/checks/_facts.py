"""The checks made before the search, and the facts the report's advice rests on.

Measured once, before the search, and saved with the result (``TuneResult.facts``):

- ``dataset_length``: items in the dataset, or ``None`` without ``__len__``.
- ``shm_bytes``: size of ``/dev/shm``, where workers put the tensors of the batches they
  hand over, or ``None`` where there is none.
- ``random_items``: two reads of item 0 in this process differ (random augmentations),
  or ``None`` if not checked (an iterable dataset).
- ``workers_repeat_randomness``: with ``random_items``, the first read of item 0 in two
  different workers gave the same result. A dataset that holds its own random generator
  (``self.rng = np.random.default_rng()``) has it copied into every worker, so the
  workers draw the same "random" numbers; ``None`` if not checked.
- ``worker_start_seconds``: seconds to start one worker process with the user's loader
  options (its start method, ``worker_init_fn``) and get its first item, less the time
  to read that item here (see ``NOTE [ Worker start-up ]``); ``None`` if not measured
  (no worker processes searched). ``worker_start_at_least``: the check ran out of its
  time first, so the figure is the time it had, a lower bound. ``start_method``: how
  the user's loader starts worker processes (``fork``, ``spawn``, ``forkserver``).
- ``copy_on_read``: with fork, bytes of its parent's memory a forked process copies per
  item it reads for the first time (``NOTE [ Copy-on-read probe ]``; below what the
  report speaks of, an upper bound), and ``copy_on_read_items``, how many items that
  was measured over; ``None`` if not measured (another start method, an iterable
  dataset, fewer than 1,000 items, no worker processes searched);
  ``process_bytes``, this process's resident memory then, which bounds the copy.
- ``missing``: for each fact a check could not establish, why (it ran out of its time,
  or the dataset raised in it).

Before any of them, an ``IterableDataset`` is checked for workers that repeat each other's
samples (see ``NOTE [ Repeated samples ]``): that is refused, not recorded.

NOTE [ Checks before the search ]
The checks read items and start processes, out of the run's time budget: together they
get ``checks_seconds(time_budget)``, a small share of it, and each check a fixed share of
that (``_SHARES``). Each is held to its time: in this process by the trial's alarm
(:func:`~autoloader.measure._deadlines.time_limit`), with workers through
:meth:`TrialRunner.first_batches <autoloader.measure._runner.TrialRunner.first_batches>` (the
trial's watchdog, deadline and clean-up), in a forked process (the threads check, the
copy-on-read probe: NOTE [ Checks that can be abandoned ]) by waiting for it no
longer and killing it. A check that overruns costs its share and no more; its fact is
recorded missing with the reason, the run goes on, and the report says what was not
checked. Its clean-up past its time (workers stopped, a process killed, slower on a
busy machine) is not charged to the checks after it, which get their shares all the
same: it comes out of the search's time.

NOTE [ Worker start-up ]
Under fork a worker starts in a few milliseconds. Under spawn and forkserver (Windows,
macOS, Python 3.14's default on Linux) every worker imports torch and unpickles the
dataset, serially in the parent's pickling: 3 s a worker on the development VM for a
dataset of 300,000 Python records, 12 s for 4 workers, 27 s for 8. A search that does
not know this spends its budget starting workers: its first guess (16 workers) took 52
s of a 60 s budget to its first batch. So before the search one worker is started the
way the user's loader starts them, and its time to the first item, less that item's
read, is the start-up per worker: the search then sizes trials and deadlines with it,
and searches no more workers than it can start in the time of two trials (see
``resolve_space``). It also reads item 0 in a second worker where the items are random,
for ``workers_repeat_randomness``. Under fork the other checks need the time; under
another start method the copy-on-read probe does not run, and this check gets what
the checks have left.

NOTE [ Forked processes ]
A process forked from one that has run torch's intra-op thread pool (OpenMP: any op on
more than ~32k elements, such as normalising a 3x112x112 image) inherits a pool whose
threads do not exist, and deadlocks at its own first such op. DataLoader's workers are
safe because they set one thread before reading; the probe, the one process autoloader
forks itself, does the same.
"""

from __future__ import annotations

import itertools
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from autoloader._exceptions import InvalidInputError
from autoloader.checks._batched_fetch import batched_fetch_problem, same_batch
from autoloader.checks._copy_on_read import copy_on_read
from autoloader.checks._forked import ForkedCheckFailed, can_fork, run_forked
from autoloader.loader import build_loader, merge_loader_kwargs, new_loader
from autoloader.measure import (
    TrialError,
    TrialRunner,
    TrialTimeout,
    default_memory_budget,
    describe_error,
    time_limit,
)

_T = TypeVar("_T")

# Options of the user's loader that decide how workers start and read.
_WORKER_OPTIONS = ("worker_init_fn", "multiprocessing_context", "collate_fn")

# The checks' share of the run's time budget, and its bounds in seconds.
_CHECKS_SHARE = 0.1
_MIN_CHECKS_SECONDS = 1.0
_MAX_CHECKS_SECONDS = 20.0
# Each check's share of the checks' time (see NOTE [ Checks before the search ]). A
# map-style dataset meets the first four, an iterable one the last.
_SHARES = {
    "batched_fetch": 0.15,
    "threads": 0.2,
    "random_items": 0.05,
    "workers": 0.15,
    "copy_on_read": 0.45,
    "repeated_samples": 0.5,
}
# The thread-workers check (see NOTE [ Threads check ]): batches of at most this many
# items, read by this many threads. Twelve items in all, so that a dataset whose items
# take 50 ms a read (remote storage, where threads pay most) is checked in about 1 s, the
# check's share of a 60 s budget's checks.
_THREAD_CHECK_BATCHES = 3
_THREAD_CHECK_ITEMS = 4
_THREAD_CHECK_THREADS = 2
# How the reason of a check that ran out of its time begins; the reason of one that had
# no time to start.
_OUT_OF_TIME = "the check did not finish within"
_NO_TIME = "not checked: the checks before the search ran out of time"
# A check given less time than this is not started.
_MIN_CHECK_SECONDS = 0.05


def checks_seconds(time_budget: float) -> float:
    """The time all checks before the search may take, out of the run's ``time_budget``."""
    return min(_MAX_CHECKS_SECONDS, max(_MIN_CHECKS_SECONDS, _CHECKS_SHARE * time_budget))


class Checks:
    """The checks made before the search, each held to its share of ``seconds`` (see
    ``NOTE [ Checks before the search ]``).

    Args:
        dataset (Dataset): the user's dataset.
        fixed (dict): the user's DataLoader options.
        batch_size (int): samples per batch.
        seconds (float): the time all the checks may take together.
        memory_budget (int, optional): bytes the process tree may use while a check runs
            workers; ``None`` means the default budget. (default: ``None``)
        processes (bool): whether worker processes are searched. Without them no worker
            is started for them, and the copy-on-read probe, whose fact is theirs, does
            not run: its share goes to the checks before it. (default: ``True``)
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        fixed: Mapping[str, Any],
        *,
        batch_size: int,
        seconds: float,
        memory_budget: int | None = None,
        processes: bool = True,
    ) -> None:
        self.dataset = dataset
        self.fixed = dict(fixed)
        self.batch_size = batch_size
        self.seconds = seconds
        self.missing: dict[str, str] = {}
        self._spent = 0.0  # seconds earlier checks took of what they were given
        self.processes = processes
        # Seconds earlier checks left of their shares, and the shares of checks not made.
        self._unused = 0.0 if processes else _SHARES["copy_on_read"] * seconds
        self._item_seconds = 0.0  # to read item 0 here, once read before
        self._allotted = 0.0  # seconds the check under way was given
        self._runner = TrialRunner(
            dataset,
            _no_step,
            batch_size=batch_size,
            memory_budget=memory_budget if memory_budget is not None else default_memory_budget(),
            fixed_kwargs=fixed,
        )

    def _run(self, name: str, check: Callable[[float], _T], *, last: bool = False) -> _T | None:
        """``check(seconds)`` within its share of the checks' time, and what earlier
        checks left of theirs (all that is left, for the ``last``); ``None``, with the
        reason in :attr:`missing`, if it overran it or failed."""
        left = self.seconds - self._spent  # an overrun is not charged to the checks after it
        share = _SHARES[name] * self.seconds + self._unused
        seconds = left if last else min(share, left)
        if seconds < _MIN_CHECK_SECONDS:
            self.missing[name] = _NO_TIME
            return None
        started = time.monotonic()
        self._allotted = seconds
        try:
            return check(seconds)
        except Exception as error:  # out of time, or a broken dataset (the baseline says)
            self.missing[name] = self._why(error, seconds)
            return None
        finally:
            took = time.monotonic() - started
            self._spent += min(took, seconds)
            self._unused = max(0.0, seconds - took)

    def _why(self, error: Exception, seconds: float) -> str:
        cause = error.error if isinstance(error, TrialError) else error
        if isinstance(cause, TrialTimeout):
            return (
                f"{_OUT_OF_TIME} {seconds:.1f} s, its share of the "
                f"{self.seconds:.1f} s the checks before the search may take"
            )
        if isinstance(error, TrialError):
            return f"the check failed: {error.summary}"
        if isinstance(error, ForkedCheckFailed):
            return f"the check failed: {error}"
        return f"the check failed: {describe_error(error)[0]}"

    def batched_fetch_problem(self) -> str | None:
        """Why the dataset cannot be fetched a batch at a time, or ``None`` if it can (see
        :func:`~autoloader.checks._batched_fetch.batched_fetch_problem`)."""

        def check(seconds: float) -> str | None:
            with time_limit(seconds, "checking batched fetch"):
                return batched_fetch_problem(self.dataset, self.batch_size, self.fixed)

        problem = self._run("batched_fetch", check)
        if problem is None and "batched_fetch" in self.missing:
            return _unfinished(self.missing["batched_fetch"])
        return problem

    # NOTE [ Threads check ]
    # Thread workers read the dataset from several threads of this process at once (NOTE
    # [ Thread workers ]). A dataset that keeps per-read state in itself (a buffer it
    # fills, a file handle it seeks) then mixes up its items, or raises. Before threads
    # are offered, a few batches of scattered items are read by two threads, and in this
    # thread alone, and must come out the same, tensor for tensor. Items that differ
    # between two reads in one thread (random augmentations) cannot be compared: for
    # them the batches must have the same layout (types, dtypes and shapes). A fault
    # that shows only now and then can pass this check; a thread trial that then fails
    # is recorded failed, and no thread setting is run again. The check runs in a forked
    # process (NOTE [ Checks that can be abandoned ]): a dataset whose reads block
    # forever leaves no thread of this process blocked.
    def threads_problem(self) -> str | None:
        """Why thread workers cannot load the dataset, or ``None`` if they can (see
        ``NOTE [ Threads check ]``)."""
        if isinstance(self.dataset, IterableDataset):
            return (
                "an IterableDataset is split among worker processes by get_worker_info(), "
                "which threads do not have"
            )
        for option in ("worker_init_fn", "multiprocessing_context"):
            if self.fixed.get(option) is not None:
                return f"loader_kwargs sets {option}, which sets up worker processes"
        try:
            length = len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            return "the dataset has no __len__"
        size = min(self.batch_size, _THREAD_CHECK_ITEMS, length)
        count = min(_THREAD_CHECK_BATCHES * size, length)
        indices = random.Random(0).sample(range(length), count)
        options = {
            "batch_size": size,
            "sampler": indices,
            "collate_fn": self.fixed.get("collate_fn"),
            "pin_memory": False,
        }
        batches = math.ceil(count / size)

        def check(seconds: float) -> str | None:
            arguments = (self.dataset, options, batches)
            stage = "reading batches from threads and from one"
            if can_fork():
                return run_forked(
                    _threads_verdict,
                    arguments,
                    seconds=seconds,
                    stage=stage,
                    name="autoloader-threads-check",
                )
            with time_limit(seconds, stage):
                return _threads_verdict(*arguments)

        problem = self._run("threads", check)
        if problem is None and "threads" in self.missing:
            return _unfinished(self.missing["threads"])
        return problem

    def repeated_samples(self) -> None:
        """Refuse an IterableDataset whose workers yield the same samples (see
        ``NOTE [ Repeated samples ]``).

        Raises:
            InvalidInputError: the first batches of two workers hold the same samples.
        """
        if not isinstance(self.dataset, IterableDataset):
            return
        options = merge_loader_kwargs(
            {"num_workers": 2, "prefetch_factor": 1}, batch_size=self.batch_size, fixed=self.fixed
        )

        def build() -> DataLoader[Any]:
            return build_loader(self.dataset, options)

        def check(seconds: float) -> list[Any]:
            return self._runner.first_batches(build, 2, seconds=seconds)

        batches = self._run("repeated_samples", check)
        if batches is not None and len(batches) == 2 and same_samples(*batches):
            raise InvalidInputError(
                f"The workers of this {type(self.dataset).__name__} repeat each other's "
                "samples: the first batch of DataLoader worker 0 and of worker 1 hold the "
                "same samples. An IterableDataset must split its items between workers "
                "with torch.utils.data.get_worker_info() (WebDataset: keep "
                "workersplitter=wds.split_by_worker); otherwise each of n workers yields "
                "the whole dataset, an epoch holds every sample n times, and more workers "
                "only seem faster. Shard it, then tune again."
            )

    def facts(self, dataset_length: int | None, *, start_method: str) -> dict[str, Any]:
        """Measure the facts of the module docstring; none of them raises.

        Args:
            dataset_length: items in the dataset, ``None`` without ``__len__``.
            start_method: how the user's loader starts its worker processes.
        """
        random_items = self._random_items(dataset_length)
        start, at_least, repeat = None, False, None
        if self.processes or random_items:
            # Under fork the copy-on-read probe comes next and needs its share.
            start, at_least, repeat = self._workers(
                bool(random_items), last=start_method != "fork", start_method=start_method
            )
        facts = {
            "shm_bytes": shm_bytes(),
            "random_items": random_items,
            "workers_repeat_randomness": repeat,
            "worker_start_seconds": start,
            "worker_start_at_least": at_least,
            "start_method": start_method,
            **self.copy_on_read(dataset_length, start_method=start_method),
        }
        facts["missing"] = dict(self.missing)
        return facts

    def copy_on_read(self, dataset_length: int | None, *, start_method: str) -> dict[str, Any]:
        """``dataset_length``, ``copy_on_read``, ``copy_on_read_items`` and
        ``process_bytes`` of the module docstring."""
        measured = None
        if start_method == "fork" and dataset_length and self.processes:
            measured = self._run(
                "copy_on_read", lambda seconds: copy_on_read(self.dataset, dataset_length, seconds)
            )
        per_item, items = measured or (None, None)
        return {
            "dataset_length": dataset_length,
            "copy_on_read": per_item,
            "copy_on_read_items": items,
            "process_bytes": psutil.Process().memory_info().rss,
        }

    def _random_items(self, dataset_length: int | None) -> bool | None:
        if isinstance(self.dataset, IterableDataset) or not dataset_length:
            return None

        def check(seconds: float) -> bool:
            with time_limit(seconds, "reading item 0 twice"):
                # Collated, so that numpy arrays and numbers compare as tensors.
                first = default_collate([self.dataset[0]])
                started = time.perf_counter()
                second = default_collate([self.dataset[0]])
                self._item_seconds = time.perf_counter() - started
            return not same_batch(first, second)

        return self._run("random_items", check)

    def _workers(
        self, random_items: bool, *, last: bool, start_method: str
    ) -> tuple[float | None, bool, bool | None]:
        """Start a worker as the user's loader would and time its first item (see ``NOTE
        [ Worker start-up ]``); with ``random_items``, read item 0 first in each of two
        workers and compare what they returned. Returns the start-up per worker, whether
        that is only a lower bound (the check ran out of time before the first item),
        and whether the workers repeat each other's randomness (``None`` if unchecked)."""
        options = {k: self.fixed[k] for k in _WORKER_OPTIONS if k in self.fixed}
        count = 2 if random_items else 1

        # An IterableDataset takes no sampler: its first item, whichever it is.
        sampler = {} if isinstance(self.dataset, IterableDataset) else {"sampler": [0] * count}

        def build() -> DataLoader[Any]:
            return new_loader(
                self.dataset, {"batch_size": 1, "num_workers": count, **sampler, **options}
            )

        def check(seconds: float) -> tuple[float, bool, bool | None]:
            arrived: list[float] = []
            try:
                batches = self._runner.first_batches(build, count, seconds=seconds, times=arrived)
            except TrialError as error:
                if not isinstance(error.error, TrialTimeout):
                    raise
                if not arrived:
                    raise
                # The first worker started; the second did not deliver in time.
                self.missing["workers_repeat_randomness"] = self._why(error, seconds)
                return max(0.0, arrived[0] - self._item_seconds), False, None
            start = max(0.0, arrived[0] - self._item_seconds)
            return start, False, bool(same_batch(*batches)) if len(batches) == 2 else None

        measured = self._run("workers", check, last=last)
        if measured is not None:
            return measured
        why = self.missing.pop("workers")
        if random_items:
            self.missing["workers_repeat_randomness"] = why
        if not why.startswith(_OUT_OF_TIME):
            self.missing["worker_start"] = why
            return None, False, None
        # Not one worker delivered in the time: the start-up is at least that.
        seconds = self._allotted
        self.missing["worker_start"] = (
            f"{why}; starting a worker ({start_method}) takes more than that, and the "
            f"search takes {seconds:.1f} s as its start-up"
        )
        return seconds, True, None


def _unfinished(why: str) -> str:
    """The problem of a choice whose check did not finish, ``why`` (``Checks.missing``)."""
    if why.startswith((_OUT_OF_TIME, _NO_TIME)):
        return f"its check was cut short ({why}; a longer time_budget gives it more)"
    return f"its check could not be made ({why})"


def _threads_verdict(dataset: Dataset[Any], options: dict[str, Any], batches: int) -> str | None:
    """Why thread workers cannot load the dataset, or ``None`` if they can: the first
    ``batches`` batches read by threads, then by this thread alone (twice where they
    differ), compared (see ``NOTE [ Threads check ]``)."""
    threaded_options = {**options, "num_workers": _THREAD_CHECK_THREADS, "prefetch_factor": 1}
    try:
        loader = new_loader(dataset, threaded_options, threads=True)
        threaded = list(itertools.islice(loader, batches))
    except TrialTimeout:
        raise
    except Exception as error:
        summary = describe_error(error)[0]
        return f"reading it from {_THREAD_CHECK_THREADS} threads raised {summary}"
    first = list(new_loader(dataset, options))
    if same_batch(threaded, first):
        return None
    second = list(new_loader(dataset, options))
    if not same_batch(first, second) and same_batch(threaded, first, values=False):
        return None  # random items: the layout is all that can be compared
    return (
        f"reading it from {_THREAD_CHECK_THREADS} threads gave other batches than "
        "reading it from one: it keeps state of its own between reads"
    )


def shm_bytes() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


# NOTE [ Repeated samples ]
# DataLoader gives each worker a copy of an IterableDataset and takes batches from the
# workers in turn; a dataset that does not split its items by get_worker_info() makes
# every worker yield everything. The first batch of worker 0 and of worker 1 are then
# the same samples. Random augmentations make their tensors differ, so batches are the
# same samples when they are equal throughout, or when every field that is not floating
# point (labels, keys, ids) is equal and one of them identifies samples: its values in
# the batch all differ, as keys and ids do (labels repeat within a batch).
def same_samples(first: Any, second: Any) -> bool:
    """Whether two collated batches hold the same samples (see ``NOTE [ Repeated
    samples ]``)."""
    if same_batch(first, second):
        return True
    left, right = dict(_fields(first)), dict(_fields(second))
    if left.keys() != right.keys():
        return False
    identifying = False
    for path, value in left.items():
        other = right[path]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            continue
        if not same_batch(value, other):
            return False
        # Strings collate to a list, or to a tuple inside a batch of tuples.
        entries = value.tolist() if isinstance(value, torch.Tensor) else value
        if isinstance(entries, list | tuple) and len(entries) > 1:
            identifying |= len({repr(entry) for entry in entries}) == len(entries)
    return identifying


def _fields(batch: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The leaves of a collated batch: tensors, and lists of strings or numbers."""
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _fields(value, (*path, key))
    elif isinstance(batch, list | tuple) and not all(
        isinstance(entry, str | bytes | int | float) for entry in batch
    ):
        for index, value in enumerate(batch):
            yield from _fields(value, (*path, index))
    else:
        yield path, batch


def _no_step(batch: object) -> None:
    """The step of the checks' reads: they only load."""
